"""The analyses' options of a `ProbeConfig`: the one place that turns the configuration into `RebalanceOptions`."""

from __future__ import annotations

from tokendyn.config import ProbeConfig
from tokendyn.effects.rebalance import RebalanceOptions


def rebalance_options(config: ProbeConfig, seed: int = 0) -> RebalanceOptions:
    """`RebalanceOptions` of the analyses switched on in ``config`` (``real_change`` is run by the trainer itself)."""
    on = config.active_analyses
    return RebalanceOptions(
        shares="shares" in on,
        token_shares=config.token_shares if "token_shares" in on else 0,
        prob_change="prob_change" in on,
        influence="influence" in on,
        lr=config.lr,
        lr_sweep=config.lr_sweep,
        share_method=config.share_method,
        seed=seed,
        view_sequences=config.view_sequences if on else 0,
        step_precision=config.step_precision,
    )
