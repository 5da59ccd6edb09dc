"""The kept mass of a truncated sampler, per token: log S, and the part of log rho that is not precision.

vLLM (0.31, ``vllm/v1/sample/sampler.py``) turns a position's raw logits z into the distribution it samples from,
in this order, and TRL asks it for the log-softmax of the result (``logprobs_mode="processed_logprobs"``):

    1. penalties, on the raw logits: the repetition penalty r on every token seen in the prompt or in the
       completion so far (z / r where z > 0, z * r elsewhere), then z -= f * count_out + p * [count_out > 0] (the
       frequency and presence penalties, counted over the completion so far)
    2. temperature: z / T;                                  q = softmax(z / T) over the full vocabulary
    3. min_p: drop v where q_v < min_p * max_u q_u
    4. top_k: drop v whose logit is below the k-th largest of what is left (ties at the k-th all kept)
    5. top_p: over the survivors renormalised, sorted ascending with cumulative sum c, drop v where c_v <= 1 - top_p;
       the most probable token is always kept
    6. log mu_proc(v) = log q_v - log S,    S = sum_{v kept} q_v              (renormalised over the kept set K)

With the trainer's logits in place of the engine's, S is the kept mass under the trainer's distribution at the same
temperature: log S <= 0, 0 when nothing is dropped. The recorded log rho = log pi(o) - log mu_proc(o) then holds,
besides the precision mismatch log pi(o) - log mu(o) (mu the engine's raw softmax at T), the processing's own shift

    delta(o) = log pi_proc(o) - log pi(o) = log q(o) - log S - log pi(o)      (q = pi without a penalty: -log S)

taken on the trainer's side (the engine's delta is the same up to its precision). So

    log rho_precision = log rho + delta(o) = log rho - log S + (log q(o) - log pi(o))

subtracting log S (adding |log S|: the renormalisation raised log mu by it) and, with a penalty, the penalty's own
change of the token's log-prob. A token the engine kept but the trainer's K excludes (a boundary token: the two
sides' sets differ by precision) gets the same formula, the renormalisation over the trainer's K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

# generation_kwargs that change vLLM's logits in ways this module does not model: log S is then unknown (null)
UNMODELLED = (
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "min_tokens",
    "structured_outputs",
    "logits_processors",
)


@dataclass(frozen=True)
class Processing:
    """The sampler's logit processing (vLLM's semantics: top_k <= 0 and top_p = 1 and min_p = 0 and penalties of
    1 / 0 are off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @property
    def truncates(self) -> bool:
        """Whether a token can be dropped (top_p < 1, top_k > 0 or min_p > 0)."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def active(self) -> bool:
        """The processed log-prob differs from the plain log-softmax at T."""
        return self.truncates or self.penalises


def processing_from_args(args) -> tuple[Processing, str | None]:
    """The processing TRL asks vLLM for: the trainer's ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty``, each overridden by ``generation_kwargs`` (TRL merges them in last), which may add
    ``frequency_penalty`` / ``presence_penalty``. The second item names the ``generation_kwargs`` this module does
    not model (None when there are none): log S is then unknown."""
    extra = dict(getattr(args, "generation_kwargs", None) or {})

    def get(name, default):
        value = extra.get(name, getattr(args, name, default))
        return default if value is None else value

    top_k = int(get("top_k", 0))
    proc = Processing(
        temperature=float(get("temperature", 1.0)),
        top_p=float(get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0,
        min_p=float(get("min_p", 0.0)),
        repetition_penalty=float(get("repetition_penalty", 1.0)),
        frequency_penalty=float(get("frequency_penalty", 0.0)),
        presence_penalty=float(get("presence_penalty", 0.0)),
    )
    unknown = sorted(k for k in UNMODELLED if extra.get(k) not in (None, {}, []))
    return proc, (", ".join(unknown) if unknown else None)


def history(prompt: torch.Tensor, completion: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a penalty sees at each completion index j: ``seen`` [C, V], v in the prompt or in completion[:j];
    ``counts`` [C, V], the number of times v occurs in completion[:j]. ``prompt`` [P] holds the prompt's real ids
    (no padding), ``completion`` [C] the completion's."""
    c = completion.numel()
    onehot = torch.zeros(c, vocab, dtype=torch.long, device=completion.device)
    onehot[torch.arange(c, device=completion.device), completion.long()] = 1
    counts = torch.cumsum(onehot, 0) - onehot  # tokens strictly before j
    in_prompt = torch.zeros(vocab, dtype=torch.bool, device=completion.device)
    in_prompt[prompt.long()] = True
    return in_prompt.unsqueeze(0) | (counts > 0), counts


class Kept(NamedTuple):
    log_kept: torch.Tensor  # [N] log S
    shift: torch.Tensor  # [N] delta(o) = log q(o) - log S - log pi(o)


def kept_mass(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    proc: Processing,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> Kept:
    """log S and delta(o) (module docstring) of N positions, in float64: ``logits`` [N, V] the trainer's raw logits
    (before the temperature), ``tokens`` [N] the sampled ids; ``seen`` / ``counts`` [N, V] (`history`) needed with
    a penalty."""
    z = logits.double()
    log_pi = torch.log_softmax(z / proc.temperature, dim=-1) if proc.penalises else None
    if proc.penalises:
        if seen is None or counts is None:
            raise ValueError("kept_mass: a penalty needs seen and counts (tokendyn.hooks.kept_mass.history)")
        r = torch.ones_like(z).masked_fill(seen, proc.repetition_penalty)  # float64: not a float32 scalar
        z = torch.where(z > 0, z / r, z * r)
        z = z - proc.frequency_penalty * counts.to(z) - proc.presence_penalty * (counts > 0).to(z)
    z = z / proc.temperature
    log_q = torch.log_softmax(z, dim=-1)
    keep = torch.ones_like(z, dtype=torch.bool)
    if proc.min_p > 0.0:
        keep &= log_q >= math.log(proc.min_p) + log_q.max(dim=-1, keepdim=True).values
    if proc.top_k > 0 and proc.top_k < z.size(-1):
        masked = z.masked_fill(~keep, -math.inf)
        kth = masked.topk(proc.top_k, dim=-1).values[:, -1:]
        keep &= masked >= kth
    if proc.top_p < 1.0:
        masked = z.masked_fill(~keep, -math.inf)
        probs, order = torch.softmax(masked, dim=-1).sort(dim=-1)  # ascending, as vLLM sorts
        drop = torch.cumsum(probs, dim=-1) <= 1.0 - proc.top_p
        drop[:, -1] = False  # the most probable token stays
        keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
    log_s = torch.logsumexp(log_q.masked_fill(~keep, -math.inf), dim=-1)
    if not proc.penalises:  # q = pi: delta = -log S exactly
        return Kept(log_s, -log_s)
    t = tokens.long().unsqueeze(-1)
    return Kept(log_s, log_q.gather(-1, t).squeeze(-1) - log_s - log_pi.gather(-1, t).squeeze(-1))
