"""Property tests (hypothesis): random malformed rollouts files and `tokendyn train` configs are rejected with the
project's input error (`UsageError`: `RolloutsError`, `ResumeError`, ...) naming a field, never another exception,
never a partial output."""

from __future__ import annotations

import json
import math
import shutil
import string

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokendyn.cli import main
from tokendyn.common import UsageError
from tokendyn.hooks.model_fit import check_fits, model_limits
from tokendyn.hooks.rollouts import COLUMNS, read_rollouts

torch.set_num_threads(1)

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run: a red suite is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---- values of every JSON kind, the odd ones included
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
id_lists = st.lists(st.integers(-5, 600), min_size=0, max_size=6)

VALID = {"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "advantage": 1.0, "old_logp": [-1.0, -0.5, -0.2]}


@st.composite
def malformed_rows(draw):
    """1..4 rows, each a valid row with a few columns dropped, replaced by random values or by near-valid lists."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        row = dict(VALID)
        for key in draw(st.lists(st.sampled_from(sorted(COLUMNS) + ["extra"]), max_size=3)):
            action = draw(st.sampled_from(["drop", "random", "ids"]))
            if action == "drop":
                row.pop(key, None)
            elif action == "random":
                row[key] = draw(values)
            else:
                row[key] = draw(id_lists)
        rows.append(row)
    return rows


def _jsonl(rows) -> str:
    return "".join(json.dumps(r, allow_nan=True) + "\n" for r in rows)


@pytest.fixture(scope="module")
def limits(tiny_model_dir):
    from tokendyn.policy import check_model_source

    return model_limits(check_model_source(tiny_model_dir))


def _accepted(path, limits) -> bool:
    """read_rollouts + the model checks (vocabulary, positions) of `tokendyn probe`: True if accepted; a rejection
    must be a RolloutsError naming a column, a row or a line."""
    try:
        rollouts = read_rollouts(path)
        check_fits(rollouts, *limits)
    except UsageError as exc:
        text = str(exc)
        assert "\n" not in text and text.startswith("rollouts ")
        assert any(w in text for w in ("column", "row", "line", "holds no rows", "cannot be read")), text
        event("rejected")
        return False
    event("accepted")
    return True


@SETTINGS
@given(rows=malformed_rows())
def test_random_rollouts_are_accepted_or_rejected_cleanly(rows, limits, tmp_path_factory):
    path = tmp_path_factory.mktemp("r") / "r.jsonl"
    path.write_text(_jsonl(rows))
    if _accepted(path, limits):  # then every value really is usable
        r = read_rollouts(path)
        assert all(a.min() >= 0 and a.max() < limits[0] for a in r.completion_ids if a.size)
        assert all(
            math.isfinite(float(x)) for x in (r.advantages if not isinstance(r.advantages, list) else [])
        )


@SETTINGS
@given(data=st.binary(max_size=64), suffix=st.sampled_from([".jsonl", ".parquet"]))
def test_random_bytes_are_rejected_cleanly(data, suffix, limits, tmp_path_factory):
    path = tmp_path_factory.mktemp("b") / f"r{suffix}"
    path.write_bytes(data)
    assert not _accepted(path, limits)


@pytest.fixture(scope="module")
def weightless(tiny_model_dir, tmp_path_factory):
    """The tiny model's config and tokenizer, no weights: `tokendyn probe` must stop before it needs them."""
    out = tmp_path_factory.mktemp("weightless") / "model"
    shutil.copytree(tiny_model_dir, out)
    for f in out.glob("*.safetensors"):
        f.unlink()
    return out


@settings(SETTINGS, max_examples=25)
@given(rows=malformed_rows())
def test_probe_command_never_leaves_output(rows, weightless, tmp_path_factory, capsys):
    """Through the command: exit 2, one line, no RUN_DIR (valid files fail too here: the model has no weights)."""
    tmp = tmp_path_factory.mktemp("p")
    (tmp / "r.jsonl").write_text(_jsonl(rows))
    argv = [
        "probe",
        "--model",
        str(weightless),
        "--rollouts",
        str(tmp / "r.jsonl"),
        "--out",
        str(tmp / "out"),
    ]
    assert main(argv + ["--analyses", "none", "--device", "cpu"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tokendyn probe: error:")]
    assert len(err) == 1
    assert not (tmp / "out").exists() and [p.name for p in tmp.iterdir()] == ["r.jsonl"]
    event("rejected")


# ---- configs
FIELDS = {  # field -> a strategy of plausible and implausible values
    "temperature": st.one_of(st.floats(allow_nan=True), st.text(max_size=4), st.integers(-3, 3)),
    "learning_rate": st.one_of(st.floats(allow_nan=True), st.text(max_size=4)),
    "num_generations": st.one_of(st.integers(-2, 9), st.text(max_size=3)),
    "per_device_train_batch_size": st.integers(-2, 9),
    "max_completion_length": st.one_of(st.integers(-2, 300), st.floats()),
    "beta": st.one_of(st.floats(allow_nan=True), st.none()),
    "epsilon": st.floats(-1, 2),
    "loss_type": st.sampled_from(["dapo", "grpo", "bogus", ""]),
    "steps_per_generation": st.integers(-1, 5),
    "save_steps": st.one_of(st.integers(-2, 7), st.floats(-1, 3)),
    "lopti_eta": st.one_of(st.floats(allow_nan=True), st.none(), st.text(max_size=3)),
    "lopti_quantile": st.one_of(st.floats(-1, 2), st.none()),
    "lopti_order": st.sampled_from(["low_first", "high_first", "middle", ""]),
    "advantage_reweight_alpha": st.one_of(st.floats(allow_nan=True), st.booleans()),
    "advantage_estimator": st.sampled_from(["grpo", "reinforce_pp", "ppo"]),
    "probe_every": st.one_of(st.integers(-2, 3), st.floats()),
    "probe_bins": st.sampled_from(["0,0.5,1", "0,2", "quantiles:0", "intervals:3", "x"]),
    "probe_analyses": st.sampled_from(["shares", "none", "shares,bogus", ""]),
    "probe_flush_seconds": st.one_of(st.floats(allow_nan=True), st.text(max_size=3)),
    "people": st.one_of(st.lists(st.integers(0, 10), max_size=3), st.integers(0, 10), st.text(max_size=3)),
    "eval_n": st.integers(-5, 200),
    "rollouts": st.integers(-3, 5),
    "train_split": st.sampled_from(["official", "fresh", "test"]),
    "template": st.sampled_from(["qwen-instruct", "base", "chatml"]),
    "resume_from_checkpoint": st.sampled_from(["true", "/nonexistent/checkpoint-5", "false"]),
    "bf16": st.one_of(st.booleans(), st.text(max_size=3)),
    "seed": st.one_of(st.integers(-3, 3), st.text(max_size=3)),
}


def _known() -> set[str]:
    from dataclasses import fields

    from tokendyn.trainers.config import TokendynGRPOConfig
    from tokendyn.trainers.runner import RunArguments

    return {f.name for cls in (RunArguments, TokendynGRPOConfig) for f in fields(cls)} | {"argument --config"}


KNOWN = _known()
config_maps = st.dictionaries(
    st.one_of(st.sampled_from(sorted(FIELDS)), st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)),
    st.none(),
    max_size=5,
).flatmap(lambda keys: st.fixed_dictionaries({k: FIELDS.get(k, values) for k in keys}))


@settings(SETTINGS, max_examples=80)
@given(config=config_maps)
def test_random_configs_parse_or_fail_naming_a_field(config, tmp_path_factory):
    from tokendyn.trainers.runner import prepare
    from tokendyn.trainers.train_cli import parse

    tmp = tmp_path_factory.mktemp("c")
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    try:
        run_args, cfg = parse(["--config", str(path), "--output_dir", str(tmp / "run")])
        prepare(run_args, cfg)
    except UsageError as exc:
        text = str(exc)
        assert "\n" not in text
        assert (
            text.split(":")[0].strip("-") in KNOWN or "config:" in text or any(k in text for k in config)
        ), text
        event("rejected")
    else:
        event("accepted")
    assert not (tmp / "run").exists()
