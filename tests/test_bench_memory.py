"""Smoke test of bench/probe_memory.py (its package bench/memory/): the allocator self-check is exact, the
quick path's measurement and fit machinery runs on three tiny sizes (two to fit, one held out) (no memory
thresholds: the numbers are the bench's to report), and the script exits 1 when its held-out target fails."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow_tier  # the slow tier: `make test-slow` (docs/development.md)

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def pm():
    # bench/memory/, the package behind bench/probe_memory.py, found as that script finds it: bench/ on the path
    sys.path.insert(0, str(BENCH))
    try:
        import memory
    finally:
        sys.path.remove(str(BENCH))
    return memory


def test_allocator_self_check_is_exact(pm):
    check = pm.self_check()
    assert check["allocator"] == check["expected"], check
    assert check["events"] == check["expected"], check


TINY = dict(layers=1, hidden=16, vocab=256, completion=16, rows=2, sample=2, heads=2, kv=1)


@pytest.fixture(scope="module")
def quick(pm):
    tiny = pm.Size(**TINY)
    train = [tiny, dataclasses.replace(tiny, hidden=32, completion=32)]
    held = [dataclasses.replace(tiny, layers=2)]
    return train, held, pm.run(train, held, components=["probe", "change"], log=lambda *_: None)


def test_quick_measure_and_fit(pm, quick):
    train, held, res = quick
    assert set(res["fits"]) == {
        "step",
        "probe",
        "probe_head",
        "probe_checks",
        "probe_gram",
        "probe_direct",
        "change",
    }
    for m in res["meas_train"] + res["meas_held"]:
        assert m["step"] > 0 and m["change"] > 0
        assert m["probe_head"] > 0 and m["probe_direct"] > 0
        assert m["probe_checks"] > 0 and m["probe_gram"] > 0
    for comp, fit in res["fits"].items():
        assert all(c >= 0 for c in fit.coef.values()), comp
        pred = fit.predict(pm.features(comp, held[0]))
        assert math.isfinite(pred)
    pred = pm.predict_7b(res["fits"])
    for key in ("step", "probe", "probe_nodirect", "change"):
        assert math.isfinite(pred[key]), key
    assert pred["probe_nodirect"] <= pred["probe"]


def test_exit_status_when_the_held_out_target_fails(pm, quick, tmp_path):
    """The script's --refit path on tiny measurements of every component with every held-out one tripled (so no
    fit can be within 15 % of it): it reports and exits 1."""
    train, held, _ = quick
    res = pm.run(train, held, log=lambda *_: None)
    spec = importlib.util.spec_from_file_location("probe_memory_script", BENCH / "probe_memory.py")
    script = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(BENCH))
    tripled = [{k: 3 * v for k, v in m.items()} for m in res["meas_held"]]
    payload = {
        "self_check": pm.self_check(),
        "seconds": 0.0,
        "train": [dataclasses.asdict(s) | m for s, m in zip(train, res["meas_train"], strict=True)],
        "held": [dataclasses.asdict(s) | m for s, m in zip(held, tripled, strict=True)],
    }
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(payload))
    assert script.main(["--refit", str(path)]) == 1
