"""Spikes: the probed steps whose gradient norm, max |log rho| or importance weight exceeded k x the running median of the
earlier probed steps' values, and the tokens behind each (the `spikes` records, `tokendyn.effects.spike`).

    value = #spiking probed steps;  verdict watch from one on (never act on its own: a spike is a step to look at)

The text lists, for the latest spiking steps, the trigger (quantity, ratio to its running median), the top tokens
by update share with their text, pi_old, advantage, log rho (where a sampler), bin, sequence and position, and the
command that opens the token view at the spike (`view_command`; the run needs `token_view` records for that).
"""

from __future__ import annotations

import shlex

import polars as pl

from tokendyn.analysis.diagnosis.context import RunContext
from tokendyn.analysis.diagnosis.finding import Finding, finite, measured, not_measured
from tokendyn.analysis.diagnosis.thresholds import try_flag

FAMILY = "spikes"
NAME, TITLE = (
    "spikes.tokens",
    "Spikes: probed steps k x above their running median, and the tokens behind them",
)
SHOWN_STEPS = 3  # spiking steps listed in the text (the latest)
SHOWN_TOKENS = 3  # tokens per spiking step listed in the text
TRIGGER_KEY = "probe_spike_k"  # the run's config key that turns the trigger on
# the earlier analysed rollouts a live trigger needs before it judges one (`effects.spike_trigger.DEFAULT_MIN_HISTORY`,
# which the records do not carry; tests/test_spike_doctor.py keeps the two equal)
DEFAULT_MIN_HISTORY = 3
# verl's probe records no spikes whatever its ProbeConfig's spike_k: its engine shards the parameters (FSDP2, also in
# one process), and the JVP that gives each token's exact update share does not run on sharded parameters
VERL_REASON = (
    "the spike trigger runs in the TRL trainer only: verl's engine shards its parameters (FSDP2), where the per-token "
    "update shares that name a spike's tokens are not taken"
)
PROBE_REASON = (
    "the spike trigger runs in the TRL trainer only: `tokendyn probe` offline sees one rollout batch, and a loop "
    "under `instrument` has no trigger"
)


def _num(x) -> str:
    return "-" if not finite(x) else (f"{x:.1e}" if abs(x) < 1e-2 else f"{x:.3g}")


def token_text(row: dict) -> str:
    """``'text' pi 1.0e-04 A 3 log rho 0.1 share 0.38 (bin 0, seq 3, pos 17)``."""
    rho = f" log rho {_num(row['log_rho'])}" if row.get("log_rho") is not None else ""
    return (
        f"{row['text']!r} pi {_num(row['pi_old'])} A {_num(row['advantage'])}{rho} share {_num(row['share'])} "
        f"(bin {row['bin']}, seq {row['seq']}, pos {row['pos']})"
    )


def view_command(run_dir, step: int) -> str:
    """``tokendyn view RUN_DIR --spike STEP``: the token view opened at that spike's top token."""
    return f"tokendyn view {shlex.quote(str(run_dir))} --spike {int(step)}"


def spike_steps(df: pl.DataFrame) -> list[dict]:
    """One entry per spiking (step, stage), latest first: the trigger and the tokens by rank."""
    out = []
    for (step, stage), g in df.sort("rank").group_by(["step", "stage"], maintain_order=True):
        first = g.row(0, named=True)
        out.append(
            {
                "step": step,
                "stage": stage,
                "trigger": first["trigger"],
                "ratio": first["trigger_ratio"],
                "k": first["k"],
                "tokens": g.select(
                    "rank", "text", "pi_old", "advantage", "log_rho", "bin", "seq", "pos", "share"
                ).to_dicts(),
            }
        )
    return sorted(out, key=lambda s: (s["step"], s["stage"] or ""), reverse=True)


def unarmed(ctx: RunContext) -> str | None:
    """Why a run with the trigger on could not have fired it (None: it was armed): the trigger judges the analysed
    rollouts of a single process, each against at least `DEFAULT_MIN_HISTORY` earlier ones."""
    if not ctx.has("shares"):
        return "the trigger judges the analysed rollouts, and this run has no `shares` records"
    ranks = ctx.frame("binstats")["rank"].unique().to_list() if ctx.has("binstats") else []
    if len(ranks) > 1:
        return f"the trigger runs in a single process; this run's records come from {len(ranks)} ranks"
    analysed = ctx.frame("shares")["step"].n_unique()
    if analysed <= DEFAULT_MIN_HISTORY:
        return (
            f"the trigger judges a rollout against at least {DEFAULT_MIN_HISTORY} earlier analysed ones; this run "
            f"analysed {analysed}"
        )
    return None


def spike_findings(ctx: RunContext) -> list[Finding]:
    if not ctx.has("spikes"):
        if ctx.stack == "verl":
            reason = VERL_REASON
        elif ctx.stack == "probe":
            reason = PROBE_REASON
        elif not ctx.config.get(TRIGGER_KEY):
            reason = "no `spikes` records: the spike trigger was off"
        else:
            reason = unarmed(ctx)
        if reason is not None:  # a trigger that could not fire is not a measured 0
            return [not_measured(FAMILY, NAME, TITLE, reason, threshold="spikes")]
        return [measured(FAMILY, NAME, TITLE, "spikes", 0.0, details={"steps": []})]
    steps = spike_steps(ctx.frame("spikes"))
    viewed = ctx.has("token_view")
    parts = []
    for s in steps:
        s["view"] = view_command(ctx.run.path, s["step"]) if viewed else None
    for s in steps[:SHOWN_STEPS]:
        how = f"{s['trigger']} {_num(s['ratio'])}x its median" if s["trigger"] else "no trigger recorded"
        toks = "; ".join(token_text(t) for t in s["tokens"][:SHOWN_TOKENS])
        parts.append(f"step {s['step']} ({how}): {toks}; open it: {s['view']}" if viewed else
                     f"step {s['step']} ({how}): {toks}")  # fmt: skip
    if not viewed and steps:
        parts.append("no token view recorded (--probe_view_sequences N) to open them in")
    more = f" (and {len(steps) - SHOWN_STEPS} earlier)" if len(steps) > SHOWN_STEPS else ""
    low = sum(s["tokens"][0]["bin"] == 0 for s in steps if s["tokens"])
    flag = try_flag("remedy_reweight", ctx.stack) if 2 * low > len(steps) else None
    return [
        measured(
            FAMILY,
            NAME,
            TITLE,
            "spikes",
            float(len(steps)),
            try_flag=flag,
            reason=" | ".join(parts) + more,
            details={"steps": steps, "top_token_in_lowest_bin": low},
        )  # fmt: skip
    ]
