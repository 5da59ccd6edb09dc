"""The spike trigger against hand-worked sequences: |x_t| > k * median(|x| of the earlier probed steps' window),
after at least n of them; what it does while warming up, with a median of 0, and on a value that is not finite."""

from __future__ import annotations

import math

import pytest

from tokendyn.effects.spike_trigger import (
    CALM,
    NO_REFERENCE,
    NOT_FINITE,
    SPIKE,
    WARMING_UP,
    SpikeWatch,
    check_value,
    strongest,
)


def test_a_gradient_norm_sequence_worked_by_hand():
    # k = 3, n = 3:  step 4: 4 / median(1, 2, 1.5) = 4 / 1.5 = 2.67 (calm); step 5: 5 / median(1, 2, 1.5, 4) = 5 / 1.75
    # = 2.86 (calm); step 6: 1 / 2 = 0.5 (calm); step 7: 20 / median(1, 1, 1.5, 2, 4, 5) = 20 / 1.75 = 11.4 (spike)
    watch = SpikeWatch(k=3.0, min_history=3)
    got = [watch.check({"grad_norm": v})[0] for v in (1.0, 2.0, 1.5, 4.0, 5.0, 1.0, 20.0)]
    assert [c.outcome for c in got] == [WARMING_UP] * 3 + [CALM, CALM, CALM, SPIKE]
    assert [c.median for c in got[3:]] == [1.5, 1.75, 2.0, 1.75]
    assert got[-1].ratio == pytest.approx(20 / 1.75)
    assert [c.fired for c in got] == [False] * 6 + [True]
    assert got[0].median is None and got[0].ratio is None


def test_the_threshold_is_strict_and_the_loss_is_judged_by_its_absolute_value():
    assert check_value(6.0, [2.0, 2.0, 2.0], k=3.0).outcome == CALM  # exactly k x median: not a spike
    assert check_value(6.0001, [2.0, 2.0, 2.0], k=3.0).outcome == SPIKE
    # a signed loss: median(|-0.1|, |0.2|, |-0.3|) = 0.2; |-0.7| / 0.2 = 3.5 > 3
    c = check_value(-0.7, [-0.1, 0.2, -0.3], k=3.0, quantity="loss")
    assert (c.outcome, c.median, c.quantity) == (SPIKE, 0.2, "loss") and c.ratio == pytest.approx(3.5)
    assert check_value(-0.5, [-0.1, 0.2, -0.3], k=3.0).outcome == CALM  # 2.5


def test_warming_up_no_reference_and_values_that_are_not_finite():
    assert check_value(100.0, [1.0, 1.0], min_history=3).outcome == WARMING_UP
    assert check_value(100.0, [1.0, 1.0], min_history=2).outcome == SPIKE
    assert check_value(1.0, [0.0, 0.0, 0.0]).outcome == NO_REFERENCE  # k * 0 would call anything a spike
    for bad in (math.nan, math.inf):
        assert check_value(bad, []).outcome == NOT_FINITE and check_value(bad, []).fired
    watch = SpikeWatch(min_history=1)
    watch.check({"grad_norm": 1.0})
    assert watch.check({"grad_norm": math.nan})[0].outcome == NOT_FINITE
    assert list(watch.history["grad_norm"]) == [1.0]  # the NaN did not join the history


def test_the_window_keeps_only_the_last_values():
    # window 3: at the last step the window is (1, 1, 1): 4 / 1 = 4 > 3; over all six, median(10,10,10,1,1,1) = 5.5
    values = (10.0, 10.0, 10.0, 1.0, 1.0, 1.0, 4.0)
    short, long = SpikeWatch(window=3), SpikeWatch(window=20)
    last = [(short.check({"loss": v})[0], long.check({"loss": v})[0]) for v in values][-1]
    assert (last[0].outcome, last[0].median) == (SPIKE, 1.0)
    assert (last[1].outcome, last[1].median) == (CALM, 5.5)


def test_quantities_not_measured_are_skipped_and_the_strongest_check_is_picked():
    watch = SpikeWatch(min_history=1)
    watch.check({"grad_norm": 1.0, "loss": 1.0, "max_abs_log_rho": None})
    checks = watch.check({"grad_norm": 5.0, "loss": 10.0, "max_abs_log_rho": None})
    assert [c.quantity for c in checks] == ["grad_norm", "loss"]
    assert strongest(checks).quantity == "loss"
    assert strongest([check_value(math.inf, [], quantity="grad_norm"), *checks]).outcome == NOT_FINITE
    assert strongest(watch.check({"grad_norm": 1.0})) is None
    assert "max_abs_log_rho" not in watch.history


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": 1.0}, r"^spike: k must be a number > 1, got 1\.0$"),
        ({"k": math.nan}, r"^spike: k must be a number > 1"),
        ({"min_history": 0}, r"^spike: min_history must be an integer >= 1, got 0$"),
        ({"min_history": 5, "window": 4}, r"^spike: window must be an integer >= min_history = 5, got 4$"),
    ],
)
def test_bad_options_fail_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpikeWatch(**kwargs)


def test_an_unknown_quantity_is_refused():
    with pytest.raises(ValueError, match=r"^spike: unknown quantities \['norm'\]; allowed: "):
        SpikeWatch().check({"norm": 1.0})


def test_the_signed_loss_fires_on_noise_and_so_is_not_judged_by_default():
    """A zero-mean Gaussian loss with calm gradient norms: |L| > 3 median|L| fires on several percent of the steps
    (the reason `DEFAULT_QUANTITIES` leaves the loss out); the same series judged by the defaults never fires."""
    import random

    from tokendyn.effects.spike_trigger import DEFAULT_QUANTITIES

    rng = random.Random(0)
    steps = [{"grad_norm": 1.0 + 0.05 * rng.random(), "loss": rng.gauss(0.0, 1.0)} for _ in range(2000)]
    on_loss, default = SpikeWatch(), SpikeWatch()
    loss_fired = sum(strongest(on_loss.check(v)) is not None for v in steps)
    default_fired = sum(
        strongest(default.check({q: x for q, x in v.items() if q in DEFAULT_QUANTITIES})) is not None
        for v in steps
    )
    assert "loss" not in DEFAULT_QUANTITIES and default_fired == 0
    assert 0.03 < loss_fired / len(steps) < 0.12, loss_fired
