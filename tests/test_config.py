"""One probe configuration (`tokendyn.ProbeConfig`): validated at construction naming the field and the allowed values,
taken by every entry point, and the only source of the trainer's ``probe_<field>`` options and of `tokendyn probe`'s
``--<field>`` flags (same names, same defaults, same help)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tokendyn
from tokendyn import ProbeConfig
from tokendyn.config import TOKEN_SHARES_PER_BIN, ProbeConfigError

SRC = Path(tokendyn.__file__).parent

BAD = {
    "points": ([], "points: empty selection"),
    "bins": ("0,2", "bins: edges must start at 0 and end at 1"),
    "sample_tokens": (-1, "sample_tokens: must be an integer >= 0, got -1"),
    "view_sequences": (-2, "view_sequences: must be an integer >= 0, got -2"),
    "direct_tokens": (1.5, "direct_tokens: must be an integer >= 0"),
    "direct_every": (0, "direct_every: must be an integer >= 1, got 0"),
    "direct_chunk": (0, "direct_chunk: must be an integer >= 1"),
    "direct_memory_mb": (0, "direct_memory_mb: must be None (no cap) or a number > 0, got 0"),
    "check_tokens": (-2, "check_tokens: must be None (every token) or an integer >= 0"),
    "check_budget": (0, "check_budget: must be None (no budget) or a number > 0, got 0"),
    "direct_budget": (-0.1, "direct_budget: must be None (no budget) or a number > 0, got -0.1"),
    "sigma_every": (0, "sigma_every: must be an integer >= 1, got 0"),
    "flush_seconds": (float("nan"), "flush_seconds: must be a number >= 0"),
    "sample_sequences": (True, "sample_sequences: must be an integer >= 0"),
    "analyses": ("shares,bogus", "analyses: unknown ['bogus']; allowed: shares, token_shares"),
    "token_shares": (-1, "token_shares: must be an integer >= 0"),
    "lr": (0.0, "lr: must be a number > 0"),
    "lr_sweep": ((1e-3, -1.0), "lr_sweep: must be a list of numbers > 0"),
    "spike_k": (1.0, "spike_k: must be None (off) or a number > 1, got 1.0"),
    "share_method": ("fast", "share_method: must be one of stream, loop, batched, got 'fast'"),
    "step_precision": (
        "float16",
        "step_precision: must be one of measured, float64, float64_step, model, got 'float16'",
    ),
    "precision_check_every": (0, "precision_check_every: must be an integer >= 1, got 0"),
    "compare_rules": ("lopti,ppo2", "compare_rules: unknown ['ppo2']; allowed: base, reweight, lopti"),
    "compare_modes": ("adam", "compare_modes: unknown ['adam']; allowed: equal_norm, optimizer"),
    "compare_inner_steps": (0, "compare_inner_steps: must be an integer >= 1, got 0"),
    "compare_lr": (-1e-4, "compare_lr: must be None (the analyses' lr) or a number > 0, got -0.0001"),
    "compare_c_sweep": ([-2.0], "compare_c_sweep: must be a list of numbers in [-1, 10], got [-2.0]"),
    "compare_eta_sweep": ([1.0], "compare_eta_sweep: must be a list of numbers in (0, 1), got [1.0]"),
}


def test_every_field_has_help_and_a_bad_value_case():
    names = [f.name for f in dataclasses.fields(ProbeConfig)]
    assert set(BAD) == set(names)
    assert all(f.metadata["help"].strip() for f in dataclasses.fields(ProbeConfig))
    assert {"sigma_every", "direct_memory_mb"} <= set(names)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_names_the_field_and_what_is_allowed(name):
    value, message = BAD[name]
    with pytest.raises(ProbeConfigError, match=re.escape(message)) as info:
        ProbeConfig(**{name: value})
    assert info.value.field == name


def test_values_are_normalised_and_the_config_is_frozen():
    cfg = ProbeConfig(
        points="layers.*.out, final_norm.out", bins=4, analyses="prob_change,shares", lr_sweep=[1, 0.1]
    )
    assert cfg.points == ("layers.*.out", "final_norm.out") and cfg.bins == "intervals:4"
    assert cfg.analyses == ("shares", "prob_change") and cfg.lr_sweep == (0.1, 1.0)
    assert ProbeConfig(points="all").points is None and ProbeConfig(analyses="none").analyses == ()
    assert ProbeConfig(sample_sequences=0).active_analyses == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    with pytest.raises(TypeError, match="no option 'layers'"):
        cfg.replace(layers="x")
    assert ProbeConfig().sigma_every == 16 and ProbeConfig().direct_memory_mb == 512.0


def test_one_token_share_default_everywhere():
    from tokendyn import RebalanceOptions

    assert ProbeConfig().token_shares == RebalanceOptions().token_shares == TOKEN_SHARES_PER_BIN


def test_the_trainer_fields_are_made_from_probe_config():
    from tokendyn import TokendynGRPOConfig

    trainer = {f.name: f for f in dataclasses.fields(TokendynGRPOConfig) if f.name.startswith("probe_")}
    probe = {f.name: f for f in dataclasses.fields(ProbeConfig)}
    # the trainer's own switches (which steps, whether to dump rollouts, the floor: two splits of its micro-batch)
    # are the only probe_ fields not derived
    assert set(trainer) == {f"probe_{n}" for n in probe} | {
        "probe_every",
        "probe_dump_rollouts",
        "probe_floor",
    }
    for name, f in probe.items():
        t = trainer[f"probe_{name}"]
        default = t.default_factory() if t.default is dataclasses.MISSING else t.default
        assert default == (list(f.default) if isinstance(f.default, tuple) else f.default), name
        assert t.metadata["help"].startswith(f.metadata["help"])


def test_the_trainer_builds_the_probe_config_and_names_its_fields(tmp_path):
    from tokendyn import TokendynGRPOConfig

    def config(**kw):
        return TokendynGRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **kw)

    cfg = config(probe_points=["layers.0.out"], probe_analyses=["shares,prob_change"], probe_sigma_every=4)
    assert cfg.probe_config() == ProbeConfig(
        points="layers.0.out", analyses="shares,prob_change", sigma_every=4
    )
    with pytest.raises(ValueError, match=r"^probe_direct_memory_mb: must be None \(no cap\) or a number > 0"):
        config(probe_direct_memory_mb=-1.0)


def test_the_trainer_cli_reads_none_for_the_optional_numbers(tmp_path):
    """`--probe_check_tokens none` / `--probe_direct_memory_mb none` mean every token / no cap, as their help says."""
    from transformers import HfArgumentParser

    from tokendyn import TokendynGRPOConfig

    parser = HfArgumentParser(TokendynGRPOConfig)
    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    (cfg,) = parser.parse_args_into_dataclasses(
        [*base, "--probe_check_tokens", "none", "--probe_direct_memory_mb", "None"]
    )
    assert cfg.probe_config().check_tokens is None and cfg.probe_config().direct_memory_mb is None
    (cfg,) = parser.parse_args_into_dataclasses(
        [*base, "--probe_check_tokens", "64", "--probe_direct_memory_mb", "128.5"]
    )
    assert (cfg.probe_config().check_tokens, cfg.probe_config().direct_memory_mb) == (64, 128.5)


def test_bin_edges_are_kept_exactly():
    """The canonical bins text reads back as the very edges given (no rounding to 6 digits: 0.9999999 is a bin edge
    a study of near-certain tokens uses)."""
    from tokendyn.config import parse_bins

    for edges in ([0, 1 / 3, 2 / 3, 1], [0, 0.5, 0.9999999, 1], [0, 0.25, 0.5, 0.75, 1]):
        text = ProbeConfig(bins=edges).bins
        assert parse_bins(text)[2] == tuple(float(e) for e in edges), text
    assert ProbeConfig().bins == "0,0.25,0.5,0.75,1"


def test_the_offline_cli_has_one_flag_per_field():
    from tokendyn.hooks import offline_cli

    parser = argparse.ArgumentParser()
    offline_cli.add_probe_arguments(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == {f.name for f in dataclasses.fields(ProbeConfig)}
    args = parser.parse_args(
        ["--points", "layers.*.out", "--check_tokens", "none", "--lr_sweep", "1e-3", "1"]
    )
    assert offline_cli.probe_config(args) == ProbeConfig(
        points="layers.*.out", check_tokens=None, lr_sweep=(1e-3, 1)
    )
    with pytest.raises(ValueError, match=r"^--sigma_every: must be an integer >= 1"):
        offline_cli.probe_config(parser.parse_args(["--sigma_every", "0"]))


def test_entry_points_take_the_config_and_keyword_options():
    from _models import tiny_qwen2

    from tokendyn import GradientProbe

    model = tiny_qwen2()
    probe = GradientProbe(model, ProbeConfig(points="layers.*.out", sigma_every=2), direct_memory_mb=None)
    assert probe.point_names == ["layers.0.out", "layers.1.out"]
    assert (
        probe.sigma_every == 2 and probe.direct_memory_mb is None and probe.config.points == ("layers.*.out",)
    )
    with pytest.raises(ProbeConfigError, match="direct_every: must be an integer >= 1"):
        GradientProbe(model, direct_every=0)


def test_retired_names_are_gone_from_the_source():
    """The retired names appear nowhere in src/ but in the vocabulary's map for old run directories."""
    retired = [
        r"\bold_logps\b",  # now old_logp
        r"\bprobe_layers\b",  # now probe_points
        r"\bprobe_analysis_set\b",  # now ProbeConfig.active_analyses
        r"def tokens\(",  # the alias of begin_step
        r"\"--point\"",  # now --points
        r"\"--layers\"",  # now --points
        r"analysis_records",  # merged into tokendyn.records
        r"hooks\.records",  # merged into tokendyn.records
        r"\bwrite_atomic\b",  # one atomic writer: tokendyn.common.atomic_write
        r"pl\.col\(\"layer\"\)",  # the shares column is `group`
        r"\"stage[12]\"",  # the update stages low / high (tokendyn.vocab)
        r"\"update_stage\"\)\.is_in\(\[\"all\"",  # the full update is vocab.FULL_UPDATES
    ]
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "vocab.py":  # RETIRED: the loader's map for old run directories
            continue
        text = path.read_text()
        found += [f"{path.relative_to(SRC)}: {pat}" for pat in retired if re.search(pat, text)]
    assert not found, found


def test_import_tokendyn_stays_light():
    code = (
        "import sys, tokendyn; from tokendyn import ProbeConfig; "
        "print(sorted(m for m in ('torch', 'trl', 'matplotlib', 'polars') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert set(tokendyn.__all__) == {"__version__", "vocab", *tokendyn.EXPORTS}
    for name in tokendyn.EXPORTS:
        assert getattr(tokendyn, name) is not None
