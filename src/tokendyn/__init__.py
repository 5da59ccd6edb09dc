"""tokendyn: which tokens drive the update in RL on language models.

The entry points, importable from the root (as captum, TransformerLens and Opacus re-export theirs):

    from tokendyn import ProbeConfig, GradientProbe, instrument, load_run
    from tokendyn import TokendynGRPOConfig, TokendynGRPOTrainer        # TRL's GRPO with Reweight, Lopti, the probe
    from tokendyn import probe_rollouts, analyze_batch, RebalanceOptions, ProbeBatch, Objective
    from tokendyn import grpo_advantages, reweight_advantages, lopti_masks, build_report

Every name is resolved from its module on first use (`EXPORTS`; `tokendyn.vocab` is a module), so that
``import tokendyn`` and the CLI's start stay light (torch, TRL and matplotlib are imported by the names that need
them; `ProbeConfig` and `vocab` need none of them). The package root imports the rooms; no room imports the root.
"""

from __future__ import annotations

import importlib

from tokendyn.version import __version__

# name -> the module defining it
EXPORTS = {
    "ProbeConfig": "tokendyn.config",
    "GradientProbe": "tokendyn.probe.probe",
    "instrument": "tokendyn.hooks.loop",
    "Recorder": "tokendyn.hooks.loop",
    "probe_rollouts": "tokendyn.hooks.offline",
    "RecordWriter": "tokendyn.records",
    "load_run": "tokendyn.analysis.run",
    "Run": "tokendyn.analysis.run",
    "RebalanceOptions": "tokendyn.effects.rebalance",
    "analyze_batch": "tokendyn.effects.rebalance",
    "ProbeBatch": "tokendyn.probe.tokenloss",
    "Objective": "tokendyn.probe.tokenloss",
    "grpo_advantages": "tokendyn.remedies",
    "reweight_advantages": "tokendyn.remedies",
    "lopti_masks": "tokendyn.remedies",
    "TokendynGRPOConfig": "tokendyn.trainers.config",
    "TokendynGRPOTrainer": "tokendyn.trainers.grpo",
    "build_report": "tokendyn.figures.report",
}

__all__ = [  # the version, the vocabulary, and every name of EXPORTS
    "GradientProbe",
    "Objective",
    "ProbeBatch",
    "ProbeConfig",
    "RebalanceOptions",
    "RecordWriter",
    "Recorder",
    "Run",
    "TokendynGRPOConfig",
    "TokendynGRPOTrainer",
    "__version__",
    "analyze_batch",
    "build_report",
    "grpo_advantages",
    "instrument",
    "load_run",
    "lopti_masks",
    "probe_rollouts",
    "reweight_advantages",
    "vocab",
]

TYPE_CHECKING = False  # as typing.TYPE_CHECKING, without importing typing (8 ms) at the package's import

if TYPE_CHECKING:  # the same names for type checkers (and the layout test's import graph)
    from tokendyn import vocab
    from tokendyn.analysis.run import Run, load_run
    from tokendyn.config import ProbeConfig
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
    from tokendyn.figures.report import build_report
    from tokendyn.hooks.loop import Recorder, instrument
    from tokendyn.hooks.offline import probe_rollouts
    from tokendyn.probe.probe import GradientProbe
    from tokendyn.probe.tokenloss import Objective, ProbeBatch
    from tokendyn.records import RecordWriter
    from tokendyn.remedies import grpo_advantages, lopti_masks, reweight_advantages
    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.grpo import TokendynGRPOTrainer


def __getattr__(name: str):
    if name == "vocab":
        value = importlib.import_module("tokendyn.vocab")
    elif name in EXPORTS:
        value = getattr(importlib.import_module(EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'tokendyn' has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS, "vocab"})
