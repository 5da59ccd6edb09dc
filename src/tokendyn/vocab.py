"""The one vocabulary of tokendyn: every name that code, records, tables, figures and the CLI share is defined here.

A leaf module (no torch, no polars): the probe, the trainer glue, the record schemas and the readers import it.

Stages (the ``stage`` column of every record, and ``update_stage`` of the counterfactual updates):
    ``train``  one update with every token (plain GRPO, or the whole loss of a Lopti run)
    ``low``    Lopti's stage that updates the tokens with pi_old < eta
    ``high``   Lopti's stage that updates the tokens with pi_old >= eta
    ``lopti``  both Lopti stages, in the run's order (an update only: ``update_stage``)
The trainer counts the stages of a rollout batch 0 (no Lopti), 1 (first), 2 (second); `stage_name` turns that count
into the name, given the order (``low_first``: the method; ``high_first``: the paper's ablation).

The old policy's probability enters everywhere as its log, ``old_logp`` (one name: the batch field, the rollouts
column, `GradientProbe.begin_step`'s argument); records carry pi_old = exp(old_logp) in the column ``pi_old``.

Probe points (the ``point`` column, `ProbeConfig.points`): ``layers.{i}.out`` (decoder layer i's output) and
``final_norm.out`` (the LM head's input); a selection is a name or a glob pattern (`fnmatch`), ``all`` = every point.

Parameter groups (the ``group`` column of the ``shares`` record): ``all`` (every trainable parameter),
``embeddings``, ``layers.{i}``, ``final_norm``, ``lm_head``, ``other``.

Run directories written before these names were fixed still load: `RETIRED` maps each old name to the new one, and
`tokendyn.records.upgrade_frame` applies it when a record file is read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

# ---- stages ------------------------------------------------------------------------------------------------------
TRAIN = "train"
LOW = "low"
HIGH = "high"
LOPTI = "lopti"
STAGES = (TRAIN, LOW, HIGH)
UPDATE_STAGES = (TRAIN, LOW, HIGH, LOPTI)
FULL_UPDATES = (LOPTI, TRAIN)  # the full update of a run: both Lopti stages, else the single one
LOPTI_ORDERS = ("low_first", "high_first")

# ---- the old policy's probability --------------------------------------------------------------------------------
OLD_LOGP = "old_logp"

# ---- probe points ------------------------------------------------------------------------------------------------
FINAL_NORM = "final_norm.out"
ALL_POINTS = "all"

# ---- parameter groups (the `shares` record's `group` column) -----------------------------------------------------
ALL_PARAMETERS = "all"
EMBEDDINGS = "embeddings"
FINAL_NORM_GROUP = "final_norm"
LM_HEAD = "lm_head"
OTHER = "other"

# ---- the rebalancing analyses ------------------------------------------------------------------------------------
ANALYSES = ("shares", "token_shares", "prob_change", "influence", "real_change")
# the paired comparison's update rules and step sizes (tokendyn.effects.compare)
COMPARE_RULES = (
    "base",
    "reweight",
    "lopti",
    "reweight_lopti",
    "clip_cov",
    "kl_cov",
    "80_20",
    "gspo",
    # the camp that protects low-probability tokens (docs/remedies.md)
    "logp_reweight",
    "dppo_tv",
    "dppo_kl",
    "aspo",
    "ce_gppo",
    "lp_reg",
    "w_reinforce",
    # the run's loss without the sampler's importance-sampling correction (TRL + vLLM): what the correction does
    "no_correction",
)
# the camp of each compared rule relative to GRPO on the same batch (docs/remedies.md): "tames" down-weights
# low-pi tokens (the paper's remedies), "protects" up-weights or restores them, "other" is neither by construction
CAMPS = ("tames", "protects", "other")
RULE_CAMPS = {
    "reweight": "tames", "lopti": "tames", "reweight_lopti": "tames",
    "logp_reweight": "protects", "dppo_tv": "protects", "dppo_kl": "protects", "aspo": "protects",
    "ce_gppo": "protects", "lp_reg": "protects",
    "clip_cov": "other", "kl_cov": "other", "80_20": "other", "gspo": "other", "w_reinforce": "other",
}  # fmt: skip
COMPARE_MODES = ("equal_norm", "optimizer")
# the precision of the analyses' counterfactual steps (tokendyn.effects.change.InPlaceUpdate)
# (float64: a float64 copy of the model, every op in float64; float64_step: the gradient in the model's dtype, the
# step and pi after it in float64, for plain SGD; model: the parameters' own dtype)
FLOAT64, FLOAT64_STEP = "float64", "float64_step"
STEP_PRECISIONS = (FLOAT64, FLOAT64_STEP, "model")
# a probe's choice: one of them, or "measured" (both made now and then, the model's dtype kept while they agree:
# tokendyn.effects.precision)
MEASURED = "measured"
PROBE_STEP_PRECISIONS = (MEASURED, *STEP_PRECISIONS)

# ---- names retired from records: kind -> {"columns": {old: new}, "values": {column: {old: new}}} ------------------
# the update stages were named by position: stage1 / stage2 (the first / second Lopti stage, which are low / high or
# high / low by the run's lopti_order: RETIRED_STAGE_COUNT and `stage_name`), all (one update) and total (both)
RETIRED: dict[str, dict[str, dict]] = {
    "shares": {"columns": {"layer": "group"}, "values": {}},  # the column holds parameter groups, not layers
    "prob_change": {"columns": {}, "values": {"update_stage": {"all": TRAIN, "total": LOPTI}}},
    "influence": {"columns": {}, "values": {"update_stage": {"all": TRAIN, "total": LOPTI}}},
}
RETIRED_STAGE_COUNT = {"stage1": 1, "stage2": 2}


def stage_name(count: int, order: str = "low_first") -> str:
    """The stage of the trainer's stage count: 0 -> ``train``; 1, 2 -> ``low``, ``high`` (``high``, ``low`` when the
    order is ``high_first``)."""
    if order not in LOPTI_ORDERS:
        raise ValueError(f"lopti_order must be one of {', '.join(LOPTI_ORDERS)}, got {order!r}")
    if count == 0:
        return TRAIN
    if count not in (1, 2):
        raise ValueError(f"stage count must be 0 (no Lopti), 1 or 2, got {count!r}")
    first, second = (LOW, HIGH) if order == "low_first" else (HIGH, LOW)
    return first if count == 1 else second


def layer_point(i: int) -> str:
    """The probe point of decoder layer i's output: ``layers.{i}.out``."""
    return f"layers.{i}.out"


def layer_group(i: int) -> str:
    """The parameter group of decoder layer i: ``layers.{i}``."""
    return f"layers.{i}"


def group_order(group: str) -> tuple[int, int]:
    """Sort key of parameter groups, in the model's order: all, embeddings, layers.0 .. layers.{L-1}, final_norm,
    lm_head, other."""
    if group.startswith("layers."):
        return (2, int(group.split(".")[1]))
    order = {ALL_PARAMETERS: 0, EMBEDDINGS: 1, FINAL_NORM_GROUP: 3, LM_HEAD: 4}
    return (order.get(group, 5), 0)


def point_order(point: str) -> tuple[int, int, str]:
    """Sort key of probe points, in forward order: layers.0.out .. layers.{L-1}.out, then final_norm.out."""
    parts = point.split(".")
    layer = int(parts[1]) if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() else 0
    return (point == FINAL_NORM, layer, point)


def select_names(
    names: Sequence[str], selection: str | Sequence[str] | None, what: str = "points"
) -> list[str]:
    """The names matching a selection of exact names or glob patterns (`layers.*.out`, `layers.1?.out`;
    comma-separated or a sequence), in the order of ``names``; None or ``all`` keeps every name. A selector that
    matches nothing is a ValueError listing the available names."""
    if selection is None or selection == ALL_POINTS:
        return list(names)
    selectors = [s.strip() for s in selection.split(",")] if isinstance(selection, str) else list(selection)
    selectors = [s for s in selectors if s]
    if not selectors:
        raise ValueError(f"{what}: empty selection; use None/'all', names or glob patterns")
    chosen: set[str] = set()
    for sel in selectors:
        matched = [n for n in names if fnmatch.fnmatchcase(n, sel)]
        if not matched:
            raise ValueError(f"{what}: {sel!r} matches no point; available: {', '.join(names)}")
        chosen.update(matched)
    return [n for n in names if n in chosen]
