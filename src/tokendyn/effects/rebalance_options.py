"""Which rebalancing analyses run, and how (`tokendyn.effects.rebalance.analyze_update`): `RebalanceOptions`."""

from __future__ import annotations

from dataclasses import dataclass

from tokendyn.config import TOKEN_SHARES_PER_BIN
from tokendyn.effects.shares import METHODS
from tokendyn.vocab import PROBE_STEP_PRECISIONS


@dataclass(frozen=True)
class RebalanceOptions:
    """Which analyses run. shares: per-bin gradients, norms per layer, projection shares (one forward, one
    backward for g and one per bin, streamed: `tokendyn.effects.shares.gradient_shares`; ``share_method`` "loop" or
    "batched" hold every per-bin gradient at once instead); token_shares: tokens per bin kept from the per-token
    JVP shares (0: no JVP); prob_change: the counterfactual update (lr, plain SGD); influence: one counterfactual
    update per source bin (and per Lopti stage); lr_sweep: further step sizes of the counterfactual update (with
    prob_change), recorded as update "sweep" with the update's ||delta theta|| / ||theta||, to see where the
    first-order picture of the paper's lr = 1e-3 step stops holding (list the main lr too to have it on the same
    curve), and before them its lr -> 0 limit (lr 0, ``limit`` true: d pi / d lr at lr = 0, `tokendyn.effects.limit`;
    skipped with a warning on FSDP2-sharded parameters or an attention kernel forward-mode AD refuses);
    view_sequences: sequences of the sample whose every token is recorded (`token_view`: its share, its
    counterfactual dpi, its own-gradient ratio; 0 = off); step_precision: the counterfactual steps' (influence
    sources, prob_change, the sweep; `tokendyn.effects.change.InPlaceUpdate`): "float64" (default: a float64 copy of
    the model for the analysis, so a step below the float32 rounding of theta is made whole), "float64_step" (the
    gradient in the model's dtype, the step and pi after it in float64: the memory of the model's own backward),
    "model" (the parameters' own dtype; each record's step_rounding says how much of the step that can lose) or
    "measured" (float64 steps and the model's dtype, compared, and the model's dtype kept while they agree:
    `tokendyn.effects.precision`; `analyze_update` then checks on every call unless it is given the run's
    `MeasuredPrecision`)."""

    shares: bool = True
    token_shares: int = TOKEN_SHARES_PER_BIN
    prob_change: bool = True
    influence: bool = True
    lr: float = 1e-3
    lr_sweep: tuple[float, ...] = ()
    share_method: str = "stream"
    seed: int = 0
    view_sequences: int = 0
    step_precision: str = "float64"

    def __post_init__(self) -> None:
        sweep = tuple(float(x) for x in (self.lr_sweep or ()))
        if any(not x > 0 for x in sweep):
            raise ValueError(f"rebalance: every lr_sweep value must be > 0, got {list(self.lr_sweep)!r}")
        object.__setattr__(self, "lr_sweep", tuple(sorted(set(sweep))))
        if self.share_method not in METHODS:
            raise ValueError(
                f"rebalance: share_method must be one of {', '.join(METHODS)}, got {self.share_method!r}"
            )
        if not isinstance(self.token_shares, int) or self.token_shares < 0:
            raise ValueError(f"rebalance: token_shares must be an integer >= 0, got {self.token_shares!r}")
        if not isinstance(self.view_sequences, int) or self.view_sequences < 0:
            raise ValueError(
                f"rebalance: view_sequences must be an integer >= 0, got {self.view_sequences!r}"
            )
        if not float(self.lr) > 0:
            raise ValueError(f"rebalance: lr must be > 0, got {self.lr!r}")
        if self.step_precision not in PROBE_STEP_PRECISIONS:
            raise ValueError(
                f"rebalance: step_precision must be one of {', '.join(PROBE_STEP_PRECISIONS)}, "
                f"got {self.step_precision!r}"
            )
