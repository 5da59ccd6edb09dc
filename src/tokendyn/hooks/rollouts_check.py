"""Checking a rollouts table (`tokendyn.hooks.rollouts_read.Table`): which mode (token ids or text) and which
advantages (given, or GRPO from reward + group), then every cross-column rule (lengths, padding layouts, masks,
log-probabilities, finiteness, one temperature), errors naming the column, the row and what is accepted."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np
import polars as pl
import torch

from tokendyn.hooks.rollouts_read import (
    COLUMNS,
    LOGP_TOL,
    PER_TOKEN,
    Table,
    column_from_python,
    column_from_series,
    error,
    rows_text,
    short_value,
)


def _suggest(names: Sequence[str], present: set[str]) -> str:
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, sorted(present - set(COLUMNS)), n=1, cutoff=0.75)
        if close:
            hints.append(f"'{close[0]}' -> '{name}'?")
    return f" (rename {', '.join(hints)})" if hints else ""


def _pick_mode(t: Table) -> str:
    has = set(t.columns)
    found = f"found columns: {', '.join(sorted(has)) or '(none)'}"
    ids, text = {"prompt_ids", "completion_ids"} & has, {"prompt", "completion"} & has
    if len(ids) == 2:
        return "ids"
    if len(ids) == 1:
        (given,) = ids
        (other,) = {"prompt_ids", "completion_ids"} - ids
        raise error(t.source, f"'{given}' is given but '{other}' is missing (token mode needs both); {found}")
    if len(text) == 2:
        return "text"
    missing = sorted({"prompt", "completion"} - text) if text else ["prompt_ids", "completion_ids"]
    raise error(
        t.source,
        "no completions: give prompt_ids + completion_ids (lists of token ids) or prompt + completion (text); "
        f"{found}{_suggest(missing + ['prompt', 'completion'], has)}",
    )


def _pick_advantage(t: Table) -> str:
    has = set(t.columns)
    if "advantage" in has:
        return "advantage"
    if {"reward", "group"} <= has:
        return "grpo"
    found = f"found columns: {', '.join(sorted(has))}"
    if "reward" in has:
        raise error(
            t.source,
            f"'reward' needs 'group' (the prompt each completion answers) for GRPO advantages; {found}",
        )
    raise error(
        t.source,
        "no advantages: give 'advantage' (a number per completion, or a list per completion token) or 'reward' + "
        f"'group' (GRPO advantages are computed per group); {found}{_suggest(['advantage', 'reward', 'group'], has)}",
    )


def _grpo(rewards: np.ndarray, groups: list, source: str) -> np.ndarray:
    """`grpo_advantages` per group, whatever the row order: rows are gathered by group and scattered back."""
    from tokendyn.remedies import grpo_advantages

    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    sizes: dict[int, list] = {}
    for g, rows in members.items():
        sizes.setdefault(len(rows), []).append(g)
    if len(sizes) > 1:
        common = max(sizes, key=lambda k: len(sizes[k]))
        odd = [(g, k) for k, gs in sizes.items() if k != common for g in gs]
        shown = ", ".join(f"{g!r} has {k}" for g, k in odd[:3]) + (" ..." if len(odd) > 3 else "")
        raise error(
            source,
            f"column 'group': every group must have the same number of completions for GRPO advantages; most "
            f"groups have {common}, but {shown} (or give an 'advantage' column instead)",
        )
    (size,) = sizes
    order = np.asarray([i for rows in members.values() for i in rows])
    adv = grpo_advantages(torch.as_tensor(rewards[order], dtype=torch.float64), size).numpy()
    out = np.empty_like(adv)
    out[order] = adv
    return out


def _check_lengths(t: Table, cols: dict, mode: str) -> None:
    where = t.where
    pairs = [("prompt_mask", "prompt_ids"), ("completion_mask", "completion_ids")]
    per_token = [c for c in PER_TOKEN if c in cols]
    if isinstance(cols.get("advantage"), list):
        per_token.append("advantage")
    if mode == "ids":
        pairs += [(c, "completion_ids") for c in per_token]
        for name in ("prompt_ids", "completion_ids"):
            empty = [i for i, v in enumerate(cols[name]) if len(v) == 0]
            if empty:
                raise error(t.source, f"column '{name}' must not be empty; see {rows_text(empty, where)}")
    for a, b in pairs:
        if a not in cols:
            continue
        bad = [i for i in range(t.n) if len(cols[a][i]) != len(cols[b][i])]
        if bad:
            i = bad[0]
            raise error(
                t.source,
                f"{where(i)}: {a} has {len(cols[a][i])} entries but {b} has {len(cols[b][i])} (they must be equal"
                f"{'' if len(bad) == 1 else f'; also {rows_text(bad[1:], where)}'})",
            )


def _check_values(t: Table, cols: dict, mode: str) -> None:
    where, src = t.where, t.source
    for name in ("prompt_mask", "completion_mask"):
        for i, m in enumerate(cols.get(name, ())):
            m = m.astype(np.int8)
            # prompts are left-padded (0..0 1..1), completions right-padded (1..1 0..0)
            layout_ok = np.all(np.diff(m) >= 0) if name == "prompt_mask" else np.all(np.diff(m) <= 0)
            if not layout_ok:
                side = "left-padded (0s then 1s)" if name == "prompt_mask" else "right-padded (1s then 0s)"
                raise error(
                    src, f"{where(i)}: {name} must be {side}, as TRL pads; got {short_value(m.tolist())}"
                )
            if name == "prompt_mask" and not m.any():
                raise error(src, f"{where(i)}: prompt_mask has no attended prompt token")
    n = t.n
    if mode == "ids":
        scored = [
            cols["loss_mask"][i]
            if "loss_mask" in cols
            else (
                cols["completion_mask"][i]
                if "completion_mask" in cols
                else np.ones(len(cols["completion_ids"][i]), bool)
            )
            for i in range(n)
        ]
        if "loss_mask" in cols and "completion_mask" in cols:
            bad = [i for i in range(n) if np.any(cols["loss_mask"][i] & ~cols["completion_mask"][i])]
            if bad:
                raise error(
                    src,
                    f"loss_mask scores tokens that completion_mask does not attend in {rows_text(bad, where)}",
                )
        if not any(s.any() for s in scored):
            raise error(src, "no scored completion token (every loss_mask / completion_mask is 0)")
    else:
        scored = [None] * n

    def on_scored(i, v):
        return v if scored[i] is None else v[scored[i]]

    for name in ("old_logp", "ref_logp", "sampler_logp"):
        for i, v in enumerate(cols.get(name, ())):
            x = on_scored(i, v)
            bad = np.flatnonzero(~np.isfinite(x) | (x > LOGP_TOL))
            if bad.size:
                hint = " (probabilities? take the log)" if x[bad[0]] > LOGP_TOL else ""
                raise error(
                    src,
                    f"{where(i)}: {name} must be finite log-probabilities <= 0 on scored tokens; scored token "
                    f"{int(bad[0])} is {float(x[bad[0]])!r}{hint}",
                )
    adv = cols["advantage"] if "advantage" in cols else None
    if isinstance(adv, np.ndarray):
        bad = np.flatnonzero(~np.isfinite(adv))
        if bad.size:
            raise error(src, f"column 'advantage' must be finite; see {rows_text(bad, where)}")
    elif adv is not None:
        bad = [i for i, v in enumerate(adv) if not np.isfinite(on_scored(i, v)).all()]
        if bad:
            raise error(
                src, f"column 'advantage' must be finite on scored tokens; see {rows_text(bad, where)}"
            )
    if "reward" in cols and adv is None:
        bad = np.flatnonzero(~np.isfinite(cols["reward"]))
        if bad.size:
            raise error(src, f"column 'reward' must be finite; see {rows_text(bad, where)}")


def _temperature(t: Table, values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    distinct = np.unique(values)
    if distinct.size > 1:
        raise error(
            t.source,
            f"column 'temperature' must hold one value (the sampling temperature), found {distinct[:4].tolist()}",
        )
    temp = float(distinct[0])
    if not (np.isfinite(temp) and temp > 0):
        raise error(t.source, f"column 'temperature' must be a number > 0, got {temp!r}")
    return temp


def validate_table(t: Table) -> dict:
    if t.n == 0:
        raise error(t.source, "holds no rows (one completion per row is expected)")
    mode = _pick_mode(t)
    adv_kind = _pick_advantage(t)
    use = ["prompt_ids", "completion_ids"] if mode == "ids" else ["prompt", "completion"]
    use += ["advantage"] if adv_kind == "advantage" else ["reward", "group"]
    use += [
        c
        for c in (
            "old_logp",
            "ref_logp",
            "sampler_logp",
            "loss_mask",
            "prompt_mask",
            "completion_mask",
            "temperature",
        )
        if c in t.columns
    ]
    if mode == "text":
        masks = [c for c in ("prompt_mask", "completion_mask", "loss_mask") if c in t.columns]
        if masks:
            raise error(
                t.source, f"{', '.join(masks)} need token ids: give prompt_ids + completion_ids with them"
            )
    cols = {}
    for name in use:
        values = t.columns[name]
        conv = column_from_series if isinstance(values, pl.Series) else column_from_python
        cols[name] = conv(name, values, t.source, t.where)
    _check_lengths(t, cols, mode)
    _check_values(t, cols, mode)
    if adv_kind == "grpo":
        advantages, source = _grpo(cols["reward"], cols["group"], t.source), "grpo(reward, group)"
    else:
        advantages, source = cols["advantage"], "advantage"
    return dict(
        source=t.source,
        n=t.n,
        prompt_ids=cols.get("prompt_ids"),
        completion_ids=cols.get("completion_ids"),
        prompts=cols.get("prompt"),
        completions=cols.get("completion"),
        advantages=advantages,
        advantage_source=source,
        old_logp=cols.get("old_logp"),
        ref_logp=cols.get("ref_logp"),
        sampler_logp=cols.get("sampler_logp"),
        prompt_mask=cols.get("prompt_mask"),
        completion_mask=cols.get("completion_mask"),
        loss_mask=cols.get("loss_mask"),
        temperature=_temperature(t, cols.get("temperature")),
        rewards=cols.get("reward"),
        groups=cols.get("group"),
        ignored=tuple(sorted(set(t.columns) - set(use))),
    )
