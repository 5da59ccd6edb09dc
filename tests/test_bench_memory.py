"""Smoke test of bench/probe_memory.py (its package bench/memory/): the allocator self-check is exact, and the
quick path's measurement and fit machinery runs on three tiny sizes (two to fit, one held out) (no memory
thresholds: the numbers are the bench's to report)."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

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


def test_quick_measure_and_fit(pm):
    tiny = pm.Size(layers=1, hidden=16, vocab=256, completion=16, rows=2, sample=2, heads=2, kv=1)
    train = [tiny, dataclasses.replace(tiny, hidden=32, completion=32)]
    held = [dataclasses.replace(tiny, layers=2)]
    res = pm.run(train, held, components=["probe", "change"], log=lambda *_: None)
    assert set(res["fits"]) == {"step", "probe", "probe_head", "probe_direct", "change"}
    for m in res["meas_train"] + res["meas_held"]:
        assert m["step"] > 0 and m["change"] > 0
        assert m["probe_head"] > 0 and m["probe_direct"] > 0
    for comp, fit in res["fits"].items():
        assert all(c >= 0 for c in fit.coef.values()), comp
        pred = fit.predict(pm.features(comp, held[0]))
        assert math.isfinite(pred)
    pred = pm.predict_7b(res["fits"])
    for key in ("step", "probe", "probe_nodirect", "change"):
        assert math.isfinite(pred[key]), key
    assert pred["probe_nodirect"] <= pred["probe"]
