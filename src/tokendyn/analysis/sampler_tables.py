"""The sampler's shape and the sign split in `tokendyn analyze`: tables ``mismatch_hist``, ``mismatch_tail``
(`tokendyn.analysis.mismatch_tail`), ``mismatch_sign`` and ``update_sign`` (`tokendyn.analysis.sign_split`), built
from a run's records and printed as terminal tables."""

from __future__ import annotations

import polars as pl
from rich.console import Console
from rich.table import Table

from tokendyn.analysis.load import select_steps
from tokendyn.analysis.mismatch_seeds import first_stage
from tokendyn.analysis.mismatch_tail import cell_label, mismatch_hist, mismatch_tail
from tokendyn.analysis.sign_split import mismatch_by_sign, update_share_by_sign

NAMES = ("mismatch_hist", "mismatch_tail", "mismatch_sign", "update_sign")


def sampler_tables(run, steps=None, stage: str | None = None) -> dict[str, pl.DataFrame]:
    """The four tables of a `tokendyn.analysis.run.Run` over the selection: the first three when it has `sampler`
    records (each token once: a Lopti run's first stage), ``update_sign`` when it has `token_shares` records."""
    out: dict[str, pl.DataFrame] = {}
    if "sampler" in run.kinds:
        sampler = first_stage(select_steps(run["sampler"], steps, stage).collect())
        out["mismatch_hist"] = mismatch_hist(sampler)
        out["mismatch_tail"] = mismatch_tail(sampler, run.config)
        tokens = select_steps(run["tokens"], steps, stage) if "tokens" in run.kinds else None
        out["mismatch_sign"] = mismatch_by_sign(sampler, tokens)
    if "token_shares" in run.kinds:
        shares = select_steps(run["shares"], steps, stage) if "shares" in run.kinds else None
        out["update_sign"] = update_share_by_sign(select_steps(run["token_shares"], steps, stage), shares)
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 or v != v or abs(v) == float("inf") else f"{v:.2e}"
    return str(v)


def _print(console: Console, df: pl.DataFrame, title: str, columns: dict[str, str]) -> None:
    table = Table(title=title, header_style="bold")
    cols = [c for c in columns if c in df.columns]
    for c in cols:
        table.add_column(columns[c], justify="left" if df.schema[c] == pl.Utf8 else "right", no_wrap=True)
    for row in df.select(cols).iter_rows():
        table.add_row(*(_fmt(v) for v in row))
    console.print(table)


def _bin_label() -> pl.Expr:
    """The bin as text: "all" for bin -1, "[lo, hi)", the last closed "[lo, 1]"."""
    close = pl.when(pl.col("bin_hi") >= 1.0).then(pl.lit("]")).otherwise(pl.lit(")"))
    label = pl.format("[{}, {}{}", pl.col("bin_lo"), pl.col("bin_hi"), close)
    return pl.when(pl.col("bin") < 0).then(pl.lit("all")).otherwise(label).alias("bin")


def print_sampler_tables(console: Console, tables: dict[str, pl.DataFrame]) -> None:
    """The histogram as one row per cell (a column per pi_old bin, counts), the tail, the sign splits."""
    hist = tables.get("mismatch_hist")
    if hist is not None and hist.height:
        labels = [cell_label(lo, hi) for lo, hi in hist.select("edge_lo", "edge_hi").iter_rows()]
        wide = hist.with_columns(_bin_label(), pl.Series("log rho", labels)).pivot("bin", index=["cell", "log rho"], values="count",
                                                          sort_columns=False).sort("cell", nulls_last=True)  # fmt: skip
        _print(console, wide.drop("cell"), "Histogram of log rho per pi_old bin (token counts)",
               {c: c for c in wide.columns if c != "cell"})  # fmt: skip
    tail = tables.get("mismatch_tail")
    if tail is not None and tail.height:
        _print(console, tail.with_columns(_bin_label()), "The ratio's tail: share of tokens with rho > hi and "
               "rho < lo, per pi_old bin", {"bin": "bin", "source": "threshold", "mode": "mode", "rho_hi": "hi",
               "rho_lo": "lo", "count": "tokens", "above": "rho > hi", "below": "rho < lo",
               "outside": "outside"})  # fmt: skip
        for note in tail.filter(pl.col("tau").is_null())["note"].unique().to_list():
            console.print(f"[yellow]mismatch_tail: {note}; the fixed band only[/yellow]")
    sign = tables.get("mismatch_sign")
    if sign is not None and sign.height:
        _print(console, sign.with_columns(_bin_label()), "The mismatch by the sign of the advantage (sampler rows "
               "joined to the token sample)", {"bin": "bin", "sign": "sign", "count": "tokens", "mean_log_rho":
               "mean log rho", "abs_mean": "mean |log rho|", "sampler_tokens": "bin's tokens", "unmatched":
               "unmatched"})  # fmt: skip
    update = tables.get("update_sign")
    if update is not None and update.height:
        _print(console, update.with_columns(_bin_label()), "The update share by the sign of the advantage (exact "
               "where the token sample holds the whole bin)", {"stage": "stage", "bin": "bin", "sign": "sign",
               "tokens": "tokens", "share": "share", "units": "steps", "complete_units": "complete"})  # fmt: skip
