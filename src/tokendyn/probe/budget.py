"""What the probe's two costly measurements may spend: a share of the training step's arithmetic, so that the cost
stays the same fraction of a step on a 1M-parameter model with a 875-token vocabulary and on a 7B model with 152k.

Counted in multiply-adds x 2 (flops), from shapes alone, so every rank of a run makes the same decision from the same
numbers and a resumed run the same as an uninterrupted one. With N = tokens of the micro-batch (rows x sequence) and
P = parameters that do arithmetic per token (every parameter but the input embedding's lookup table; the LM head
counts), one training forward + backward is

    step = 6 P N.

The exact checks at the LM head stream the head (V x H) in float64 three times for K tokens (`head.py`: z and the
softmax-weighted rows in `head_partial`, z again in `logits_identity_error`), 2 K H V each; float64 costs about two
float32 flops on a CPU's vector units (more against a GPU's 16-bit units: a budget there is met with room), and a
pass costs at least what K_MEM = 64 tokens' products cost, however few tokens it carries (reading and widening the
V x H weights is memory-bound: measured on a 2-core CPU at V = 32,000, H = 256, 32 tokens cost as much as 96 would
at the large-K rate); a refresh of sigma_max adds the H x H Gram matrix, 2 V H^2 float64 multiply-adds:

    checks(K) = 12 (K + K_MEM) H V  [+ 4 V H^2 on a refresh].

The check sample is cut to what the budget affords on every micro-batch, K <= budget P N / (2 H V) - K_MEM, never below
CHECK_FLOOR tokens; where even that costs more than the budget (a head that is most of the model), the checks run on
the micro-batches the credit allows (below), and the others check no tokens exactly (the bound at the LM-head input
is still checked on every token, against the last sigma_max).

The direct gradients replay the decoder layers (P_L = P - H V parameters) of the R rows that hold sampled tokens:
one forward, then one backward (two forwards' work) per seed slot, m slots = the most sampled tokens in one row:

    direct = 2 P_L S R (1 + 2 m)        (S = the sequence length).

That is one to several training steps' worth, so it cannot run on every micro-batch.

Both run when their credit allows (`Credit`, a token bucket with debt): each probed micro-batch earns budget x step,
a measurement spends its cost, and one runs when the credit is >= 0, so the first micro-batch always gets both and
later ones once the debt is repaid: on average each costs at most its budget of the probed steps.

No one replay may cost more than `REPLAY_STEPS` training steps of its micro-batch by this estimate (a budgeted run):
it replays the longest prefix of its sampled tokens that fits (`direct_tokens_within`; one token always fits,
6 P_L S <= 6 P N), so no probed step, the first included, costs much more than twice a plain one. (SmolLM2-135M, 2
rows of 32 + 128 tokens: 16 tokens' replay was 2.4 steps, 8 slots each over 30 layers; two tokens fit.) The estimate
is low where the replay does more than R rows and one forward per group: with dropout active every row of the
micro-batch is replayed (its masks must repeat), and a chunk or memory cap below m slots repeats the group's forward
(at most 1.5x the estimate, at one slot per backward). A packed layout (one row) fits one token per replay wherever
the layers hold more than 60 % of the parameters (a second token in the row needs 10 P_L S <= 6 P S).
"""

from __future__ import annotations

import math

from torch import nn

CHECK_FLOOR = 32  # tokens checked at the LM head whatever the budget (all of them when fewer)
K_MEM = 64  # a float64 pass over the head costs at least what this many tokens' products cost (memory-bound)


def flop_parameters(model: nn.Module) -> tuple[int, int]:
    """(P, P_emb): every parameter's element count (shared tensors once; FSDP2 DTensors at their global size) and
    that of the input embedding's table, which is read, not multiplied (0 when the LM head shares it: then the
    head's V x H is arithmetic and stays in P)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = id(p)
        if key not in seen:
            seen.add(key)
            total += p.numel()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    out_w = getattr(out, "weight", None)
    tied = emb_w is not None and out_w is not None and emb_w is out_w
    return total, 0 if emb_w is None or tied else emb_w.numel()


def step_flops(params: int, tokens: int) -> float:
    """6 P N: one training forward and backward of N tokens through P arithmetic parameters."""
    return 6.0 * params * tokens


def check_tokens_within(
    requested: int, available: int, params: int, tokens: int, hidden: int, vocab: int, budget: float | None
) -> int:
    """K = min(requested, available, max(CHECK_FLOOR, floor(budget P N / (2 H V) - K_MEM))), the K whose
    `check_flops` fit budget x `step_flops`; `budget` None: min(requested, available)."""
    k = min(requested, available)
    if budget is None:
        return k
    afford = math.floor(budget * params * tokens / (2.0 * hidden * vocab)) - K_MEM
    return min(k, max(CHECK_FLOOR, afford))


def check_flops(k: int, hidden: int, vocab: int, refresh: bool) -> float:
    """12 (K + K_MEM) H V, plus 4 V H^2 when sigma_max is refreshed (the module docstring)."""
    return 12.0 * (k + K_MEM) * hidden * vocab + (4.0 * vocab * hidden * hidden if refresh else 0.0)


def direct_flops(layer_params: int, seq: int, rows: int, slots: int) -> float:
    """2 P_L S R (1 + 2 m): the replay's forward of R rows of length S and m seed slots' backwards."""
    return 2.0 * layer_params * seq * rows * (1 + 2 * slots)


def replay_flops(rows: list[int], layer_params: int, seq: int) -> float:
    """`direct_flops` of replaying the sampled tokens of ``rows`` (their forward rows): R = the distinct rows, m = the
    most tokens in one of them; 0 for no token."""
    if not rows:
        return 0.0
    return direct_flops(layer_params, seq, len(set(rows)), max(rows.count(r) for r in set(rows)))


REPLAY_STEPS = 1.0  # the most one replay may cost, in training steps (`step_flops`) of its micro-batch


def direct_tokens_within(rows: list[int], layer_params: int, seq: int, cap: float) -> int:
    """The longest prefix k >= 1 of the sampled tokens (their ``rows``, in sample order) whose replay fits ``cap``
    flops: direct_flops(P_L, S, R_k, m_k) <= cap, with R_k the distinct rows of rows[:k] and m_k the most tokens in
    one of them (the first token always counts: one row, one slot); 0 when there are no tokens."""
    per_row: dict[int, int] = {}
    k = 0
    for r in rows:
        per_row[r] = per_row.get(r, 0) + 1
        if k and direct_flops(layer_params, seq, len(per_row), max(per_row.values())) > cap:
            break
        k += 1
    return k


class Credit:
    """A measurement's credit in flops: `earn` budget x the flops of every probed micro-batch, run it when
    `affordable` (credit >= 0; always without a budget) and `spend` its cost then. The probe's `sigma_state`
    carries `credit` across a resume."""

    def __init__(self, budget: float | None) -> None:
        self.budget = budget
        self.credit = 0.0

    def earn(self, flops: float) -> None:
        if self.budget is not None:
            self.credit += self.budget * flops

    def affordable(self) -> bool:
        return self.budget is None or self.credit >= 0.0

    def spend(self, flops: float) -> None:
        if self.budget is not None:
            self.credit -= flops
