"""The remedies' math, re-exported from :mod:`tokendyn.remedies` (where it lives, below both trainers/ and probe/);
this module keeps the old import path working."""

from tokendyn.remedies import (
    LOPTI_ORDERS,
    grpo_advantages,
    lopti_masks,
    lopti_threshold,
    reinforce_pp_advantages,
    reweight_advantages,
)

__all__ = [
    "LOPTI_ORDERS",
    "grpo_advantages",
    "lopti_masks",
    "lopti_threshold",
    "reinforce_pp_advantages",
    "reweight_advantages",
]
