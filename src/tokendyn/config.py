"""`ProbeConfig`: every option of the probe and its analyses, defined once (a leaf module: no torch, no polars).

`GradientProbe`, `instrument`, `probe_rollouts` and the trainer take it; the trainer's fields are ``probe_<field>``,
made from these fields (`tokendyn.trainers.config`), and the CLI flags are ``--probe_<field>`` (train) or
``--<field>`` (probe). Bad values fail at construction with a `ProbeConfigError` naming the field and what is allowed.

Bin specs are parsed by `tokendyn.binspec` (re-exported here; torch-free, so that the configuration checks run before
torch is imported):
``"0,0.25,0.5,0.75,1"`` / ``"edges:0,0.1,1"`` (edges), ``"intervals:K"`` (K equal intervals), ``"quantiles:K"``
(K bins at the step's quantiles of pi_old), an int K (K intervals) or a sequence of edges.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from tokendyn.binspec import DEFAULT_EDGES, describe_bins, interval_edges, parse_bins, validate_edges
from tokendyn.vocab import ALL_POINTS, ANALYSES, COMPARE_MODES, COMPARE_RULES, PROBE_STEP_PRECISIONS

# the bin specs (`tokendyn.binspec`), re-exported
__all__ = ["DEFAULT_EDGES", "describe_bins", "interval_edges", "parse_bins", "validate_edges"]

SHARE_METHODS = ("stream", "loop", "batched")
VIEW_SEQUENCES = 4  # sequences of the analysis sample recorded token by token (the token view)
C_RANGE = (-1.0, 10.0)  # the c-sweep's axis (tokendyn.effects.axis.C_MIN, C_MAX: -1 is Reweight's alpha = 1)
TOKEN_SHARES_PER_BIN = 32  # token-share rows kept per bin (trainer, offline probe and RebalanceOptions alike)


class ProbeConfigError(ValueError):
    """A probe option out of range; ``field`` names it (the trainer reports it as ``probe_<field>``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


# ---- the configuration -------------------------------------------------------------------------------------------
def _opt(default, help_text: str, **meta):
    return field(default=default, metadata={"help": help_text, **meta})


@dataclass(frozen=True)
class ProbeConfig:
    """The probe's options (help text in each field's metadata; `ProbeConfig.help()` lists them)."""

    # -- where and how the training backward is read (GradientProbe)
    points: tuple[str, ...] | None = _opt(
        None,
        "Probed places by name or glob (`layers.3.out`, `layers.*.out`, `final_norm.out`; comma-separated or a "
        "list); None or 'all': every decoder layer's output and the final norm's output (the LM head's input).",
    )
    bins: str = _opt(
        "0,0.25,0.5,0.75,1",
        "Probability bins of pi_old: comma-separated edges (default the paper's 0,.25,.5,.75,1), `intervals:K` "
        "(K equal intervals) or `quantiles:K` (K quantile bins of the step's tokens); an int K or a list of edges "
        "is accepted too.",
    )
    sample_tokens: int = _opt(128, "Raw token rows kept per probed micro-batch (a bounded sample); >= 0.")
    direct_tokens: int = _opt(
        16,
        "Tokens per probed micro-batch (at most: direct_budget) whose 'direct' gradient (own loss term) is "
        "computed by replaying their rows' layers; 0 = off.",
    )
    direct_every: int = _opt(
        10,
        "Compute the direct gradients on every n-th probed micro-batch only (1: every one); >= 1. They cost a "
        "forward of the rows holding sampled tokens plus a backward per token in a row, so the default samples them "
        "to keep the probe cheap enough to leave on.",
    )
    direct_chunk: int = _opt(
        8,
        "Direct-gradient backward passes batched at once (memory: chunk x one layer's activations of the rows "
        "replayed); >= 1.",
    )
    direct_memory_mb: float | None = _opt(
        512,
        "Memory cap of the direct gradients' layer replay, in MiB (2**20 bytes): rows and batched slots are replayed "
        "in groups whose estimated one-layer activations and cotangents (replay.replay_bytes) fit it; a micro-batch "
        "where one row with one token does not fit gets no direct gradients (a note says so; a 4k-token row of a 7B "
        "layer needs about 1.1 GB); None = no cap; > 0.",
    )
    check_tokens: int | None = _opt(
        256,
        "Tokens per probed micro-batch checked exactly at the LM head; None = every token (then three float64 "
        "[tokens, hidden] buffers grow with the micro-batch); >= 0.",
    )
    check_budget: float | None = _opt(
        0.02,
        "Share of a micro-batch's training flops (6 x parameters x tokens) the exact LM-head checks may use: fewer "
        "than check_tokens are checked where their float64 passes over the head would cost more (never fewer "
        "than 32), and where even those cost more, only the micro-batches a credit allows are checked (the "
        "first always; probe/budget.py); None = check_tokens on every micro-batch; > 0.",
    )
    direct_budget: float | None = _opt(
        0.02,
        "Share of the probed micro-batches' training flops the direct gradients' layer replays may use, on "
        "average: a replay runs when its credit allows (the first always), on what one step's flops can replay "
        "(probe/budget.py); None = every direct_every-th micro-batch, every token, whatever it costs; > 0.",
    )
    sigma_every: int = _opt(
        16,
        "Checked micro-batches between refreshes of the LM head's sigma_max (a float64 Gram matrix); >= 1.",
    )
    flush_seconds: float = _opt(
        30.0,
        "Records are written at least every this many seconds (0 = at every micro-batch): a kill loses at most "
        "the records of the last this many seconds; >= 0.",
    )
    # -- the rebalancing analyses on a sample of the batch
    sample_sequences: int = _opt(
        8,
        "Sequences of the rollout batch the rebalancing analyses run on: the first ones with a non-zero advantage (in "
        "training of all processes, in rank order, run and written by rank 0; tokendyn probe: of the file; verl: of "
        "the update's batch), fewer when there are fewer, a sample without any noted and skipped; 0 = no analyses.",
    )
    analyses: tuple[str, ...] = _opt(
        ANALYSES,
        "Which rebalancing analyses run, from: shares (per-bin gradients and update shares), token_shares "
        "(per-token JVP shares), prob_change (the counterfactual probability change), influence (the influence "
        "matrix), real_change (the change after the real update; training only); comma-separated or a list; "
        "'none' = off.",
        choices=list(ANALYSES),
    )
    token_shares: int = _opt(TOKEN_SHARES_PER_BIN, "Token-share rows kept per bin (token_shares); >= 0.")
    lr: float = _opt(
        1e-3, "Learning rate of the counterfactual SGD updates (the paper's diagnostic: 1e-3); > 0."
    )
    lr_sweep: tuple[float, ...] = _opt(
        (),
        "Step sizes of an extra counterfactual SGD sweep (with prob_change), e.g. 1e-3 1e-2 1e-1 1: the correct "
        "ratio per bin as a curve of the step size (update 'sweep'); each > 0. The sweep's first point is always "
        "the lr -> 0 limit (d pi / d lr by one JVP, weights untouched; rows with lr 0 and limit true; not on an "
        "FSDP2-sharded model), before the finite steps listed here.",
    )
    compare_rules: tuple[str, ...] = _opt(
        (),
        "Paired comparison: the update rules compared on the analysis sample from the same state (the base rule, "
        "the run's loss, always first), from: "
        + ", ".join(COMPARE_RULES)
        + "; comma-separated or a list; empty "
        "or 'none' = off. Record kind `paired`, `tokendyn analyze` table `paired`.",
        choices=list(COMPARE_RULES),
    )
    compare_modes: tuple[str, ...] = _opt(
        COMPARE_MODES,
        "Step sizes of the paired comparison: equal_norm (plain SGD, every rule's step at the norm of the base "
        "rule's SGD step at lr) and optimizer (one step of a copy of the run's optimizer, its state and lr).",
        choices=list(COMPARE_MODES),
    )
    compare_inner_steps: int = _opt(
        1,
        "Updates per stage of every compared rule on the same batch (pi_old fixed at the state compared from, as "
        "TRL's num_iterations); >= 1. At 1 every ratio r = pi / pi_old is 1, so DPPO-TV, DPPO-KL, ASPO, CE-GPPO and "
        "every clip are exactly the base rule: they act only at k > 1. Recorded in `paired` (column inner_steps).",
    )
    compare_lr: float | None = _opt(
        None,
        "SGD lr of the paired comparison (None = lr; smaller if its k > 1 updates diverge); > 0.",
    )
    compare_c_sweep: tuple[float, ...] = _opt(
        (),
        "One axis through both camps: the paired comparison also makes, from the same state, the update with "
        "A_t <- (1 + c (1 - pi_old,t)) A_t at each c given (c < 0: Advantage Reweighting with alpha = -c, tames "
        "low-pi tokens; c > 0: the Delta-log-p reweight, protects them; 0: the base rule), recording per c and bin "
        "dpi, correct ratios, update share, entropy change and KL to the base update (`paired` rows with sweep 'c'; "
        "`tokendyn analyze` tables sweep and guidance); each in [-1, 10]; turns the comparison on.",
    )
    compare_eta_sweep: tuple[float, ...] = _opt(
        (),
        "The same sweep for Lopti's eta (two stages, low first, at each eta): `paired` rows with sweep 'eta'; each "
        "in (0, 1); turns the comparison on.",
    )
    view_sequences: int = _opt(
        VIEW_SEQUENCES,
        "Sequences of the analysis sample whose every token is recorded for the token view (record kind "
        "`token_view`: text, pi_old, A, Lopti group, update share, counterfactual and real dpi, own-gradient ratio; "
        "`tokendyn view`); at most sample_sequences are; 0 = off; >= 0.",
    )
    step_precision: str = _opt(
        "measured",
        "Counterfactual steps: float64, float64_step (model-dtype gradient), model or measured (checked).",
        choices=list(PROBE_STEP_PRECISIONS),
    )
    precision_check_every: int = _opt(8, "Analysed steps per measured check; >= 1.")
    spike_k: float | None = _opt(
        3.0,
        "Spike trigger: a probed rollout whose gradient norm, max |log rho| or max weight exceeds k x the "
        "running median of the earlier ones records its top tokens (kind `spikes`) and probes the next; None = off.",
    )
    share_method: str = _opt(
        "stream",
        "How the per-bin gradients are taken: 'stream' (g, then one g_b at a time: two parameter-sized buffers), "
        "'loop' (one backward per bin, every g_b held) or 'batched' (one batched backward, every g_b held).",
        choices=list(SHARE_METHODS),
    )

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "points", _points(self.points))
        try:
            kind, n, edges = parse_bins(self.bins)
        except ValueError as exc:
            raise ProbeConfigError("bins", str(exc).removeprefix("bins: ")) from None
        set_(self, "bins", f"intervals:{n}" if kind == "intervals" else describe_bins(kind, n, edges))
        for name in ("sample_tokens", "direct_tokens", "sample_sequences", "token_shares", "view_sequences"):
            _int(name, getattr(self, name), 0)
        for name in ("direct_every", "direct_chunk", "sigma_every", "precision_check_every"):
            _int(name, getattr(self, name), 1)
        if self.check_tokens is not None:
            _int("check_tokens", self.check_tokens, 0, "None (every token) or ")
        for name in ("check_budget", "direct_budget"):
            value = getattr(self, name)
            if value is not None:
                _number(name, value, "None (no budget) or a number > 0", lo=0.0)
                set_(self, name, float(value))
        if self.direct_memory_mb is not None:
            _number("direct_memory_mb", self.direct_memory_mb, "None (no cap) or a number > 0", lo=0.0)
            set_(self, "direct_memory_mb", float(self.direct_memory_mb))
        _number("flush_seconds", self.flush_seconds, "a number >= 0", lo=0.0, closed=True)
        set_(self, "flush_seconds", float(self.flush_seconds))
        _number("lr", self.lr, "a number > 0", lo=0.0)
        set_(self, "lr", float(self.lr))
        set_(self, "analyses", _analyses(self.analyses))
        rules = _choices("compare_rules", self.compare_rules, COMPARE_RULES)
        set_(self, "compare_rules", ("base", *[r for r in rules if r != "base"]) if rules else ())
        set_(self, "compare_modes", _choices("compare_modes", self.compare_modes, COMPARE_MODES))
        _int("compare_inner_steps", self.compare_inner_steps, 1)
        if self.compare_lr is not None:
            _number("compare_lr", self.compare_lr, "None (the analyses' lr) or a number > 0", lo=0.0)
            set_(self, "compare_lr", float(self.compare_lr))
        set_(self, "compare_c_sweep", _sweep("compare_c_sweep", self.compare_c_sweep, C_RANGE, closed=True))
        set_(self, "compare_eta_sweep", _sweep("compare_eta_sweep", self.compare_eta_sweep, (0.0, 1.0)))
        if (self.compare_c_sweep or self.compare_eta_sweep) and not self.compare_rules:
            set_(self, "compare_rules", ("base",))
        if self.compare_rules and not self.compare_modes:
            raise ProbeConfigError("compare_modes", f"give at least one of {', '.join(COMPARE_MODES)}")
        sweep = self.lr_sweep
        if sweep is None:
            sweep = ()
        if isinstance(sweep, str | bytes) or not isinstance(sweep, Sequence):
            raise ProbeConfigError("lr_sweep", f"must be a list of numbers > 0, got {sweep!r}")
        for x in sweep:
            _number("lr_sweep", x, "a list of numbers > 0", lo=0.0, value=sweep)
        set_(self, "lr_sweep", tuple(sorted({float(x) for x in sweep})))
        if self.step_precision not in PROBE_STEP_PRECISIONS:
            raise ProbeConfigError(
                "step_precision",
                f"must be one of {', '.join(PROBE_STEP_PRECISIONS)}, got {self.step_precision!r}",
            )
        if self.spike_k is not None:
            _number("spike_k", self.spike_k, "None (off) or a number > 1", lo=1.0)
            set_(self, "spike_k", float(self.spike_k))
        if self.share_method not in SHARE_METHODS:
            raise ProbeConfigError(
                "share_method", f"must be one of {', '.join(SHARE_METHODS)}, got {self.share_method!r}"
            )

    @property
    def comparison_lr(self) -> float:
        """The paired comparison's SGD lr: `compare_lr`, else the analyses' `lr`."""
        return self.lr if self.compare_lr is None else self.compare_lr

    @property
    def active_analyses(self) -> tuple[str, ...]:
        """The analyses that run: `analyses`, or none when `sample_sequences` is 0."""
        return self.analyses if self.sample_sequences else ()

    def replace(self, **changes) -> ProbeConfig:
        """A copy with some fields changed (validated again)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(f"ProbeConfig has no option {', '.join(map(repr, unknown))}; options: {names()}")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The options as plain JSON values (run.json)."""
        return {
            f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)
        }

    @classmethod
    def help(cls) -> dict[str, str]:
        """field -> its help text."""
        return {f.name: f.metadata["help"] for f in fields(cls)}


def names() -> str:
    return ", ".join(f.name for f in fields(ProbeConfig))


def resolve(config: ProbeConfig | None, options: dict) -> ProbeConfig:
    """``config`` (default `ProbeConfig()`) with the keyword ``options`` applied: the one way every entry point
    (`GradientProbe`, `instrument`, `probe_rollouts`) turns its arguments into a checked configuration."""
    if config is not None and not isinstance(config, ProbeConfig):
        raise TypeError(f"config must be a ProbeConfig (or None), got {type(config).__name__}")
    base = config or ProbeConfig()
    return base.replace(**options) if options else base


def _points(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise ProbeConfigError(
            "points", f"must be None, 'all', or point names / glob patterns, got {value!r}"
        )
    items = tuple(s.strip() for s in items if s.strip())
    if not items:
        raise ProbeConfigError("points", "empty selection; use None or 'all', names or glob patterns")
    return None if items == (ALL_POINTS,) else items


def _analyses(value) -> tuple[str, ...]:
    return _choices("analyses", value, ANALYSES)


def _choices(name: str, value, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A list of names from ``allowed`` (a list, or one comma-separated string; None, [] or 'none': empty), in
    ``allowed``'s order."""
    if value is None:
        return ()
    raw = [value] if isinstance(value, str) else list(value)
    items = [a.strip() for part in raw for a in str(part).split(",") if a.strip()]
    if items in (["none"], []):
        return ()
    unknown = sorted(set(items) - set(allowed))
    if unknown:
        raise ProbeConfigError(
            name, f"unknown {unknown}; allowed: {', '.join(allowed)} (comma-separated) or 'none'"
        )
    return tuple(a for a in allowed if a in items)


def _sweep(name: str, value, bounds: tuple[float, float], closed: bool = False) -> tuple[float, ...]:
    """Distinct finite numbers in ``bounds`` ([lo, hi] if closed, else (lo, hi)), sorted; None or 'none': ()."""
    lo, hi = bounds
    allowed = f"a list of numbers in {'[' if closed else '('}{lo:g}, {hi:g}{']' if closed else ')'}"
    if value is None or value == "none":
        return ()
    if isinstance(value, str):
        try:
            value = [float(x) for x in value.split(",") if x.strip()]
        except ValueError:
            raise ProbeConfigError(name, f"must be {allowed}, got {value!r}") from None
    if isinstance(value, bytes) or not isinstance(value, Sequence):
        raise ProbeConfigError(name, f"must be {allowed}, got {value!r}")
    for x in value:
        ok = not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)
        if not ok or not (lo <= x <= hi if closed else lo < x < hi):
            raise ProbeConfigError(name, f"must be {allowed}, got {list(value)!r}")
    return tuple(sorted({float(x) for x in value}))


def _int(name: str, value, lo: int, prefix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ProbeConfigError(name, f"must be {prefix}an integer >= {lo}, got {value!r}")


def _number(name: str, x, allowed: str, *, lo: float, closed: bool = False, value=None) -> None:
    ok = not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x)
    if not ok or not (x >= lo if closed else x > lo):
        raise ProbeConfigError(name, f"must be {allowed}, got {value if value is not None else x!r}")
