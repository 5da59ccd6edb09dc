"""A finding: a measured quantity with its interval, the reference it is judged against and where that reference comes
from, a verdict (fine / watch / act) and what to try. A finding whose records are absent is *not measured*, with the
reason; it is never dropped.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from tokendyn.analysis.diagnosis.thresholds import THRESHOLDS, Threshold

FINE, WATCH, ACT = "fine", "watch", "act"
VERDICTS = (FINE, WATCH, ACT)
MEASURED, NOT_MEASURED = "measured", "not measured"
FAMILIES = ("dominance", "bound", "sampler", "concentration", "remedies", "health", "spikes")


@dataclass
class Finding:
    """One finding (module docstring). ``reference`` holds the threshold's levels and source, or a measured
    reference (the run's own floor); ``details`` what the value rests on (per step, per bin)."""

    family: str
    name: str
    title: str
    status: str = MEASURED
    value: float | None = None
    interval: list[float | None] | None = None
    unit: str = ""
    reference: dict = field(default_factory=dict)
    verdict: str | None = None
    try_flag: str | None = None
    reason: str = ""
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["try"] = d.pop("try_flag")
        return clean(d)


def clean(x):
    """JSON-safe: NaN / inf floats become None (an unknown value is null), numpy scalars plain floats."""
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def judge(threshold: Threshold, value: float | None, lo: float | None = None, hi: float | None = None, *,
          watch: float | None = None) -> str | None:  # fmt: skip
    """The verdict of ``value`` [lo, hi] against ``threshold`` (``watch`` overrides its watch level):

        higher is worse:  act   if lo >= act   (x >= act when there is no interval: lo not finite)
                          watch if x >= watch  (or x >= act, not resolved)
                          fine  otherwise
        lower is worse:   the same with every inequality reversed (hi <= act, x <= watch).

    None when ``value`` is not finite."""
    if not finite(value):
        return None
    w = threshold.watch if watch is None else watch
    a = threshold.act
    sign = 1.0 if threshold.higher_is_worse else -1.0
    x = sign * value
    edge = (
        sign * (lo if threshold.higher_is_worse else hi)
        if finite(lo if threshold.higher_is_worse else hi)
        else x
    )
    if a is not None and edge >= sign * a:
        return ACT
    if (w is not None and x >= sign * w) or (a is not None and x >= sign * a):
        return WATCH
    return FINE


def reference(name: str, **extra) -> dict:
    """The reference of threshold ``name``: its levels, direction and source (plus measured ``extra``)."""
    t = THRESHOLDS[name]
    out = {
        "threshold": t.name,
        "watch": t.watch,
        "act": t.act,
        "higher_is_worse": t.higher_is_worse,
        "source": t.source,
    }
    out.update(extra)
    return out


def measured(family: str, name: str, title: str, threshold: str, value, lo=None, hi=None, *,
             try_flag: str | None = None, watch: float | None = None, details: dict | None = None,
             reason: str = "", **ref) -> Finding:  # fmt: skip
    """A measured finding judged by ``threshold``; ``try_flag`` is kept for watch / act only."""
    t = THRESHOLDS[threshold]
    verdict = judge(t, value, lo, hi, watch=watch)
    extra = dict(ref)
    if watch is not None:
        extra["watch"] = watch
    interval = [lo, hi] if (finite(lo) or finite(hi)) else None
    return Finding(
        family,
        name,
        title,
        MEASURED if verdict is not None else NOT_MEASURED,
        value if finite(value) else None,
        interval,
        t.unit,
        reference(threshold, **extra),
        verdict,
        try_flag if verdict in (WATCH, ACT) else None,
        reason if verdict is not None else (reason or "the value is not finite (no tokens to measure it on)"),
        details or {},
    )


def not_measured(family: str, name: str, title: str, reason: str, *, try_flag: str | None = None,
                 threshold: str | None = None) -> Finding:  # fmt: skip
    """A finding the records cannot give: listed with the reason (and how to get it), never dropped."""
    ref = reference(threshold) if threshold else {}
    unit = THRESHOLDS[threshold].unit if threshold else ""
    return Finding(
        family, name, title, NOT_MEASURED, unit=unit, reference=ref, try_flag=try_flag, reason=reason
    )
