"""When a probed step spikes: its gradient norm, loss or importance weight against the running median of the previous
probed steps' values (pure functions and a small state; no torch).

For one quantity x with the values x_1 .. x_{t-1} of the previous probed steps (finite ones only) and the last
``window`` of them H = (x_{t-w} .. x_{t-1}):

    spike(x_t)  =  |H| >= n  and  median(|H|) > 0  and  |x_t| > k * median(|H|)

with k = ``k`` (default 3) and n = ``min_history`` (default 3). On the first n probed steps it never fires
("warming up": there is no running range yet); where the median is 0 (e.g. a loss of exactly 0 at every earlier step)
it does not fire either ("no reference"), as k * 0 would call any non-zero value a spike. A value that is not finite
(NaN or inf: a diverged gradient) fires whatever the history ("not finite") and is not added to it. Absolute values,
because a policy-gradient loss is signed. Every checked finite value joins the history, spikes included (the median
is robust to them).

The quantities (`SPIKE_QUANTITIES`): ``grad_norm`` ||g||, ``loss`` L, ``max_abs_log_rho`` max_t |log pi_old - log mu|
over the batch's scored tokens (the sampler's largest mismatch) and ``max_is_weight`` the largest importance weight the
loss applied. A quantity whose value is None (not measured on this step, e.g. no sampler) is not checked. A run's
trigger judges `DEFAULT_QUANTITIES` (the loss only when asked for: see there).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SPIKE_QUANTITIES = ("grad_norm", "loss", "max_abs_log_rho", "max_is_weight")
# what a run's trigger judges by default: the quantities that are scales (>= 0, their median a size). The loss is
# left out: a GRPO loss is signed and centred near 0, so |L| > k median|L| is a test on noise (about |z| > 2 sigma
# at k = 3: a zero-mean Gaussian loss fires on 6.6 % of the steps); it is judged only when asked for.
DEFAULT_QUANTITIES = ("grad_norm", "max_abs_log_rho", "max_is_weight")
DEFAULT_K = 3.0
DEFAULT_MIN_HISTORY = 3
DEFAULT_WINDOW = 20
SPIKE, CALM, WARMING_UP, NO_REFERENCE, NOT_FINITE = (
    "spike",
    "calm",
    "warming up",
    "no reference",
    "not finite",
)


def check_trigger_options(k: float, min_history: int, window: int) -> None:
    """One-line errors for bad options: k > 1, 1 <= min_history <= window."""
    if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 1):
        raise ValueError(f"spike: k must be a number > 1, got {k!r}")
    if not isinstance(min_history, int) or min_history < 1:
        raise ValueError(f"spike: min_history must be an integer >= 1, got {min_history!r}")
    if not isinstance(window, int) or window < min_history:
        raise ValueError(f"spike: window must be an integer >= min_history = {min_history}, got {window!r}")


@dataclass(frozen=True)
class SpikeCheck:
    """One quantity checked at one step: its value, the running median it was judged against (None while warming
    up), ratio = |value| / median (None without a median), and the outcome (`SPIKE`, `CALM`, `WARMING_UP`,
    `NO_REFERENCE`, `NOT_FINITE`); ``fired`` for `SPIKE` and `NOT_FINITE`."""

    quantity: str
    value: float
    median: float | None
    ratio: float | None
    outcome: str

    @property
    def fired(self) -> bool:
        return self.outcome in (SPIKE, NOT_FINITE)


def check_value(
    value: float,
    history: Sequence[float],
    *,
    k: float = DEFAULT_K,
    min_history: int = DEFAULT_MIN_HISTORY,
    quantity: str = "",
) -> SpikeCheck:
    """The trigger of one value against ``history`` (the window's earlier finite values, oldest first; module
    docstring): spike iff len(history) >= min_history, m = median(|history|) > 0 and |value| > k m."""
    v = float(value)
    if not math.isfinite(v):
        return SpikeCheck(quantity, v, None, None, NOT_FINITE)
    if len(history) < min_history:
        return SpikeCheck(quantity, v, None, None, WARMING_UP)
    m = statistics.median(abs(float(x)) for x in history)
    if m <= 0:
        return SpikeCheck(quantity, v, m, None, NO_REFERENCE)
    ratio = abs(v) / m
    return SpikeCheck(quantity, v, m, ratio, SPIKE if ratio > k else CALM)


@dataclass
class SpikeWatch:
    """The trigger over the probed steps of a run: one window of the last ``window`` finite values per quantity.
    `check` judges a step's values against the earlier steps', then adds them."""

    k: float = DEFAULT_K
    min_history: int = DEFAULT_MIN_HISTORY
    window: int = DEFAULT_WINDOW
    history: dict[str, deque] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_trigger_options(self.k, self.min_history, self.window)

    def check(self, values: Mapping[str, float | None]) -> list[SpikeCheck]:
        """The checks of one probed step's ``values`` (quantity -> value; None: not measured, skipped), in the order
        given; each finite value then joins its quantity's window."""
        unknown = sorted(set(values) - set(SPIKE_QUANTITIES))
        if unknown:
            raise ValueError(f"spike: unknown quantities {unknown}; allowed: {list(SPIKE_QUANTITIES)}")
        out = []
        for q, v in values.items():
            if v is None:
                continue
            h = self.history.setdefault(q, deque(maxlen=self.window))
            c = check_value(v, h, k=self.k, min_history=self.min_history, quantity=q)
            out.append(c)
            if math.isfinite(c.value):
                h.append(c.value)
        return out


def strongest(checks: Sequence[SpikeCheck]) -> SpikeCheck | None:
    """The check that fired hardest: a non-finite value first, then the largest ratio; None when none fired."""
    fired = [c for c in checks if c.fired]
    if not fired:
        return None
    return max(fired, key=lambda c: (c.outcome == NOT_FINITE, c.ratio or 0.0))
