"""A study run's identity: what a finished run must share with this study to be reused (`identity`: the size less
its method and seed lists, the model, the overrides; `run_mismatch`: the method's fields and every field of its
RunArguments and config that changes its result, compared on the fields the run recorded), and the checks that
refuse a finished run, or a reference study, made with other settings in one line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tokendyn.common import UsageError

DONE = "study_done.json"


def identity(spec, size, model: str | None, overrides: dict | None = None) -> dict:
    """What a finished run must share with this study to be reused: the size less the method and seed lists and
    n_boot, the model, the config overrides (keys of ``spec.optional`` only when set), as read back from json."""
    d = asdict(size)
    for k in ("methods", "seeds", "n_boot"):
        d.pop(k)
    d.update(model=model, overrides=dict(overrides or {}))
    for k in spec.optional:
        if not d[k]:
            d.pop(k)
    return json.loads(json.dumps(d))


def read_marker(folder: Path) -> dict:
    return json.loads((folder / DONE).read_text())


# a run's config fields its result does not depend on (where it trained, what it logs, the device: a study continues
# on another machine) or that the runner derives from the study's identity (rollouts, eval_every), and the probe's
# (it leaves training untouched; what it records is the study identity's probe_* fields)
NOT_RESULT = ("output_dir", "logging_dir", "run_name", "disable_tqdm", "report_to", "use_cpu", "hub_token",
              "max_steps", "eval_steps")  # fmt: skip
NOT_RESULT_PREFIXES = ("probe_", "logging_", "log_")


def result_fields(fields: dict) -> dict:
    """The fields of a run's config (or RunArguments) that change its result: all but `NOT_RESULT` and the
    `NOT_RESULT_PREFIXES`."""
    return {k: v for k, v in fields.items() if k not in NOT_RESULT and not k.startswith(NOT_RESULT_PREFIXES)}


def run_mismatch(folder: Path, run, cfg, method_fields: dict) -> str:
    """What the finished run in ``folder`` recorded differently from the run this study would make (``run``,
    ``cfg``: `run_config`; ``method_fields``: the method's), on the fields it recorded: its marker's method
    fields, and its run.json's RunArguments and config (`result_fields`, a field it did not record is not
    compared: runs made before a field existed stay valid). "" when nothing differs."""

    def plain(x):
        return json.loads(json.dumps(x))

    diffs = []
    marker = read_marker(folder) if (folder / DONE).is_file() else {}
    if "method_fields" in marker and marker["method_fields"] != plain(method_fields):
        diffs.append(f"method fields {marker['method_fields']!r} vs {plain(method_fields)!r}")
    meta = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    for part, now in (("run", plain(asdict(run))), ("config", plain(cfg.to_dict()))):
        stored = meta.get(part) or {}
        for k, v in result_fields(now).items():
            if k in stored and stored[k] != v:
                diffs.append(f"{part} {k} {stored[k]!r} vs {v!r}")
    return ", ".join(diffs)


def check_run(folder: Path, ident: dict, run, cfg, method_fields: dict) -> bool:
    """`is_done`, then (a finished run) `run_mismatch`: a finished run made with other settings is a one-line
    UsageError naming the fields that differ."""
    if not is_done(folder, ident):
        return False
    diff = run_mismatch(folder, run, cfg, method_fields)
    if diff:
        raise UsageError(
            f"out: {str(folder)!r} holds a finished run made with other settings ({diff}); give a new --out or "
            "the same settings"
        )
    return True


def check_reference(runs: dict[tuple[str, int], Path], reference: dict[tuple[str, int], Path],
                    field: str = "--reference") -> None:  # fmt: skip
    """A reference study's finished runs must be runs of this study's settings: each one's recorded study identity
    (its done marker's ``study``) equal to this study's runs'; else a one-line UsageError naming what differs."""
    idents = {json.dumps(read_marker(d).get("study"), sort_keys=True) for d in runs.values()}
    if len(idents) > 1:
        raise UsageError(f"out: its finished runs were made with different settings ({len(idents)} kinds)")
    if not idents:
        return
    want = json.loads(idents.pop())
    for (m, s), d in sorted(reference.items()):
        found = read_marker(d).get("study")
        if found != want:
            raise UsageError(
                f"{field}: its run {m}-s{s} was made with other settings than this study's ({_diff(found, want)})"
            )


def is_done(folder: Path, ident: dict) -> bool:
    """Whether ``folder`` holds a finished run of this study; a finished run of another study is a UsageError."""
    marker = folder / DONE
    if not marker.is_file():
        return False
    found = json.loads(marker.read_text()).get("study")
    if found != ident:
        raise UsageError(
            f"out: {str(folder)!r} holds a finished run of a different study ({_diff(found, ident)}); "
            "give a new --out or the same settings"
        )
    return True


def _diff(found: dict | None, want: dict) -> str:
    if not isinstance(found, dict):
        return "no settings recorded"
    keys = [k for k in want if found.get(k) != want[k]]
    return ", ".join(f"{k} {found.get(k)!r} vs {want[k]!r}" for k in keys) or "settings differ"
