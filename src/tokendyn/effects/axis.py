"""One continuous axis through both camps, and what the comparison measures of each rule's whole distribution.

The axis. Advantage Reweighting (A_t <- (alpha pi_old,t + 1 - alpha) A_t, the paper's, tames low-pi tokens) and the
Delta-log-p reweight (A_t <- (1 + c - c pi_old,t) A_t, "Beyond Magnitude", protects them) are one family::

    A_t <- (1 + c (1 - pi_old,t)) A_t,        c in [-1, C_MAX]

c < 0 is Reweight with alpha = -c (its weight alpha pi + 1 - alpha = 1 + c (1 - pi)), c > 0 the Delta-log-p reweight
with c, c = 0 the base rule (GRPO); c = -1 weighs each token by pi_old itself (Reweight's alpha = 1, the weight stays
>= 0). `axis_rules` makes the comparison's rule for each c (rule name ``c=<c>``, ``sweep`` "c"), so that c = -alpha
*is* the Reweight rule (same code, same numbers) and c = 0 the base rule; and for each of Lopti's eta (``eta=<eta>``,
``sweep`` "eta", two stages low first).

What the comparison measures of each point's whole distribution (entropy change, KL to the base update):
`tokendyn.effects.distributions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokendyn.config import C_RANGE
from tokendyn.effects.compare import Rule

C_MIN, C_MAX = (
    C_RANGE  # c = -1: Reweight's alpha = 1 (weight pi_old >= 0); at 10 a low token weighs up to 11x
)


def axis_name(kind: str, value: float) -> str:
    """The rule name of one point of a sweep: ``c=-0.3``, ``eta=0.5``."""
    return f"{kind}={value:g}"


def axis_rules(base, c_values: Sequence[float] = (), eta_values: Sequence[float] = ()) -> list:
    """The comparison's rules of the sweeps on top of the run's loss ``base``: per c, Reweight with alpha = -c (c <
    0), the base rule (c = 0) or the Delta-log-p reweight with c (c > 0); per eta, Lopti's two stages (low first)."""
    rules = []
    for c in c_values:
        c = float(c)
        if not C_MIN <= c <= C_MAX:
            raise ValueError(f"compare: every c of the sweep must be in [{C_MIN:g}, {C_MAX:g}], got {c!r}")
        rules.append(
            Rule(axis_name("c", c), base, alpha=-c if c < 0 else 0.0, logp_c=max(c, 0.0), sweep=("c", c))
        )
    for eta in eta_values:
        eta = float(eta)
        if not 0.0 < eta < 1.0:
            raise ValueError(f"compare: every eta of the sweep must be in (0, 1), got {eta!r}")
        rules.append(Rule(axis_name("eta", eta), base, eta=eta, sweep=("eta", eta)))
    return rules
