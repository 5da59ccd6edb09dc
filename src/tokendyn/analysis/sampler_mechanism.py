"""Why a remedy helps under a mismatched sampler, from the records a run already writes (no model, no torch).

Two per-run quantities, each summarised over training seeds by the study report:

* **The update carried by mismatched tokens, per π_old bin.** A token is *mismatched* when |log ρ_t| > τ (default
  τ = log 1.1: the sampler's ratio outside [1/1.1, 1.1]). With S the run's probed steps, b a bin and s_t(r) the
  token's share of rule r's update (Σ_t s_t = 1 over a step's analysed sample):

      carried_b(r) = Σ_{t in b, |log ρ_t| > τ} s_t(r) / S

  From the token view (``token_view``: the run's own update, s_t = ``share``) and, where the run compared rules from
  its own states (``token_view_rules``), for every rule at once: ``minus_base`` = carried_b(r) − carried_b(base) is
  then paired on the same tokens and states.

* **Does the correction take weight from the sequences that carry the reward?** Per sequence q of a probed step,
  its importance weight w_q (the weight the loss applied: 0 when masked; TRL's sequence modes give one weight per
  sequence, a token mode its mean over the sequence's tokens) and its advantage A_q; the Pearson correlation

      r = Σ (w_q − w̄)(A_q − Ā) / sqrt(Σ (w_q − w̄)² Σ (A_q − Ā)²)

  over the run's sequences with a signal (A_q ≠ 0), and the weight removed, mean(1 − w_q), among A_q > 0 and A_q < 0
  apart. r is null where either side has no spread (every weight 1, or no signal).
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

TAU = math.log(1.1)
_TOKEN = ["step", "seq", "pos"]


def _frame(x: pl.LazyFrame | pl.DataFrame | None) -> pl.DataFrame:
    if x is None:
        return pl.DataFrame()
    return x.collect() if isinstance(x, pl.LazyFrame) else x


def carried_by_bin(
    view: pl.LazyFrame | pl.DataFrame,
    view_rules: pl.LazyFrame | pl.DataFrame | None = None,
    *,
    tau: float = TAU,
) -> pl.DataFrame:
    """One row per (rule, bin): ``tokens``, ``mismatched`` (token counts), ``carried`` (module docstring) and, for
    rules from ``view_rules``, ``minus_base``. Rule ``own`` is the run's own update (the view's ``share``). Tokens
    with a null log ρ or a null share are left out; the counts say how many were kept. Empty when the view has no
    log ρ (a run sampled by ``generate``)."""
    view = _frame(view)
    if view.height == 0 or "log_rho" not in view.columns:
        return pl.DataFrame()
    tokens = view.filter(pl.col("log_rho").is_not_null()).select(
        *_TOKEN, "bin", (pl.col("log_rho").abs() > tau).alias("mismatched"), pl.col("share").alias("own")
    )
    if tokens.height == 0:
        return pl.DataFrame()
    steps = tokens["step"].n_unique()
    long = tokens.select(
        *_TOKEN, "bin", "mismatched", pl.lit("own").alias("rule"), pl.col("own").alias("share")
    )
    rules = _frame(view_rules)
    if rules.height:
        if "mode" in rules.columns:  # the equal-norm comparison: the rules' updates at one size
            rules = rules.filter(pl.col("mode") == "equal_norm")
        long = pl.concat(
            [long, rules.join(tokens.drop("own"), on=_TOKEN, how="inner").select(long.columns)],
            how="vertical_relaxed",
        )
    long = long.filter(pl.col("share").is_not_null())
    out = (
        long.group_by("rule", "bin")
        .agg(
            pl.len().alias("tokens"),
            pl.col("mismatched").sum().cast(pl.Int64).alias("mismatched"),
            (pl.col("share").filter(pl.col("mismatched")).sum() / steps).alias("carried"),
        )
        .sort("rule", "bin")
    )
    if "base" in out["rule"].to_list():
        base = out.filter(pl.col("rule") == "base").select("bin", pl.col("carried").alias("_base"))
        out = (
            out.join(base, on="bin", how="left")
            .with_columns(
                pl.when(pl.col("rule") == "own")
                .then(None)
                .otherwise(pl.col("carried") - pl.col("_base"))
                .alias("minus_base")
            )
            .drop("_base")
        )
    return out.with_columns(pl.lit(steps).alias("steps"))


def sequence_weights(
    sampler: pl.LazyFrame | pl.DataFrame, tokens: pl.LazyFrame | pl.DataFrame
) -> pl.DataFrame:
    """One row per sequence (step, stage, rank, micro, row): ``weight`` (the mean importance weight the loss applied
    over its tokens, 0 when masked) and ``advantage`` (from the probe's token rows at the same positions). A
    sequence with a null weight (no correction recorded) or no advantage is left out."""
    sampler, tokens = _frame(sampler), _frame(tokens)
    if sampler.height == 0 or tokens.height == 0 or "is_weight" not in sampler.columns:
        return pl.DataFrame()
    key = ["step", "stage", "rank", "micro", "row"]
    weights = (
        sampler.filter(pl.col("is_weight").is_not_null())
        .group_by(key)
        .agg(pl.col("is_weight").mean().alias("weight"))
    )
    adv = tokens.group_by(key).agg(pl.col("advantage").first())
    return weights.join(adv, on=key, how="inner").drop_nulls("advantage").sort(key)


def weight_reward_stats(seqs: pl.DataFrame) -> dict:
    """``sequences`` with a signal (A ≠ 0), the Pearson ``r`` of weight and advantage over them (module docstring;
    null without spread), and the mean weight removed, 1 − w, among positive and negative advantages."""
    sig = seqs.filter(pl.col("advantage") != 0) if seqs.height else seqs
    out = {"sequences": sig.height, "r": None, "removed_pos": None, "removed_neg": None}
    if sig.height == 0:
        return out
    w, a = sig["weight"].cast(pl.Float64), sig["advantage"].cast(pl.Float64)
    dw, da = w - w.mean(), a - a.mean()
    den = math.sqrt(float((dw * dw).sum()) * float((da * da).sum()))
    out["r"] = float((dw * da).sum()) / den if den > 0 else None
    for name, part in (
        ("removed_pos", sig.filter(pl.col("advantage") > 0)),
        ("removed_neg", sig.filter(pl.col("advantage") < 0)),
    ):
        out[name] = float((1.0 - part["weight"]).mean()) if part.height else None
    return out


def read_kind(run_dir: str | Path, kind: str) -> pl.DataFrame | None:
    """Every shard of one record kind of a run, or None when the run wrote none."""
    files = sorted((Path(run_dir) / "records").glob(f"{kind}-*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files], how="diagonal_relaxed") if files else None


def _seed_summary(values: list[float]) -> dict:
    from tokendyn.analysis.seed_tests import paired_t, sign_agreement

    t = paired_t(values)
    k, n = sign_agreement(values)
    return {"seeds": n, "mean": t["mean"], "t_lo": t["lo"], "t_hi": t["hi"], "agree": f"{k}/{n}"}


def carried_over_seeds(runs: dict[int, str | Path]) -> tuple[pl.DataFrame, list[str]]:
    """Per (rule, bin), over the seeds of one method's runs (``runs``: seed -> run folder): the mean of each seed's
    ``minus_base`` (rules from the run's own states) with its seed-level t-interval (``seed_tests.paired_t``: the
    per-seed values as the paired differences) and the seeds that agree in sign; ``carried`` the mean of the rule's
    own. Second value: the runs left out, each with its reason."""
    per_seed, excluded = [], []
    for seed, run in sorted(runs.items()):
        view = read_kind(run, "token_view")
        if view is None or "log_rho" not in view.columns:
            excluded.append(
                f"seed {seed}: its token view has no log rho (none written, or written before it held one)"
            )
            continue
        table = carried_by_bin(view, read_kind(run, "token_view_rules"))
        if table.height == 0 or "minus_base" not in table.columns:
            excluded.append(f"seed {seed}: no rule compared from its states at the view's tokens")
            continue
        per_seed.append(table.filter(pl.col("rule") != "own").with_columns(pl.lit(seed).alias("seed")))
    if not per_seed:
        return pl.DataFrame(), excluded
    long = pl.concat(per_seed, how="diagonal_relaxed")
    rows = []
    for (rule, b), part in long.group_by("rule", "bin", maintain_order=True):
        if rule == "base":
            continue
        summary = _seed_summary(part["minus_base"].to_list())
        rows.append({"rule": rule, "bin": b, "carried": float(part["carried"].mean()), "minus_base": summary.pop("mean"),
                     **summary})  # fmt: skip
    return pl.DataFrame(rows).sort("rule", "bin"), excluded


def weight_reward_over_seeds(runs: dict[int, str | Path]) -> tuple[dict, list[str]]:
    """Over the seeds of one method's runs: the per-seed Pearson r of a sequence's importance weight with its
    advantage (`weight_reward_stats`), its mean with the seed-level t-interval and sign agreement, and the mean weight
    removed among positive and negative advantages. Second value: the runs left out, each with its reason."""
    stats, excluded = [], []
    for seed, run in sorted(runs.items()):
        sampler, tokens = read_kind(run, "sampler"), read_kind(run, "tokens")
        if sampler is None or tokens is None:
            excluded.append(f"seed {seed}: no {'sampler' if sampler is None else 'tokens'} records")
            continue
        s = weight_reward_stats(sequence_weights(sampler, tokens))
        if s["r"] is None:
            excluded.append(
                f"seed {seed}: r undefined ({s['sequences']} sequences with a signal, or no spread)"
            )
            continue
        stats.append(s)
    if not stats:
        return {}, excluded
    out = _seed_summary([s["r"] for s in stats])
    for key in ("removed_pos", "removed_neg"):
        vals = [s[key] for s in stats if s[key] is not None]
        out[key] = float(sum(vals) / len(vals)) if vals else None
    out["sequences"] = int(sum(s["sequences"] for s in stats))
    return out, excluded
