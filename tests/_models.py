"""Small, locally built models and batches for the probe tests (real transformers models, no downloads)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

VOCAB = 61


def tiny_qwen2(
    seed: int = 0,
    vocab: int = VOCAB,
    hidden: int = 32,
    layers: int = 2,
    attn: str = "sdpa",
    sharpen: float = 1.0,
) -> Qwen2ForCausalLM:
    """A random Qwen2ForCausalLM; `sharpen` scales the LM head so that pi spans (0, 1) instead of ~1/V."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    model = Qwen2ForCausalLM(cfg).float()
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model.train()


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=128,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg).train()


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, P + C]
    attention_mask: torch.Tensor  # [B, P + C]
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]

    @property
    def c(self) -> int:
        return self.completion_ids.shape[1]


def make_batch(
    model, n: int = 6, prompt: int = 5, completion: int = 7, seed: int = 1, sample: bool = True
) -> Batch:
    """Prompts of random ids; completions sampled from the model token by token (so pi spans its range; every
    forward has the full length, causal attention ignores the positions not sampled yet, and one shape keeps CPU
    kernels warm); ragged completion masks (1 up to a random length); one advantage per completion, with an exact
    zero (a group of equal rewards)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (n, prompt + completion), generator=g)
    if sample:
        with torch.no_grad():
            for j in range(completion):
                logits = model(input_ids=ids).logits[:, prompt - 1 + j].float()
                ids[:, prompt + j] = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).squeeze(1)
    lengths = torch.randint(2, completion + 1, (n,), generator=g)
    lengths[0] = completion
    cmask = (torch.arange(completion).unsqueeze(0) < lengths.unsqueeze(1)).long()
    adv = torch.randn(n, generator=g)
    adv[1] = 0.0
    amask = torch.cat([torch.ones(n, prompt, dtype=torch.long), cmask], 1)
    return Batch(ids, amask, ids[:, prompt:], cmask, adv)


def completion_logps(logits: torch.Tensor, batch: Batch, temperature: float) -> torch.Tensor:
    """log pi_t of the completion tokens from full logits [B, S, V]: position p(t) = S - C - 1 + j."""
    c = batch.c
    z = logits[:, -c - 1 : -1].float() / temperature
    return torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> torch.Tensor:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), masked mean over all completion tokens (DAPO style)."""
    ratio = torch.exp(logps - old_logps)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    m = mask.to(per_token.dtype)
    return (per_token * m).sum() / m.sum().clamp(min=1)


def probed_rows(
    model,
    batch: Batch,
    rows: slice,
    run_dir,
    rank: int,
    bins=None,
    temperature: float = 0.7,
    data_parallel_size: int | None = None,
) -> None:
    """One instrumented GRPO micro-batch over `rows` of `batch`, as one rank of a data-parallel run would do it:
    the loss of these rows is normalised by the token count of the whole batch, so every token's gradient is the
    one it has in a single process over the whole batch (nothing averages the gradients: pass data_parallel_size=1
    in a multi-process run). Records go to run_dir (shard `rank`)."""
    from tokendyn.hooks import instrument

    n_global = batch.completion_mask.sum()
    sub = Batch(
        batch.input_ids[rows],
        batch.attention_mask[rows],
        batch.completion_ids[rows],
        batch.completion_mask[rows],
        batch.advantages[rows],
    )
    with instrument(
        model,
        run_dir,
        bins=bins,
        check_tokens=None,
        temperature=temperature,
        rank=rank,
        data_parallel_size=data_parallel_size,
    ) as probe:
        out = model(input_ids=sub.input_ids, attention_mask=sub.attention_mask)
        logps = completion_logps(out.logits, sub, temperature)
        old = (logps.detach() - 0.05 * (sub.completion_ids % 3)).clamp(max=0)
        probe.begin_step(
            step=0,
            completion_mask=sub.completion_mask,
            advantages=sub.advantages,
            old_logp=old,
            completion_ids=sub.completion_ids,
            logps=logps,
            temperature=temperature,
        )
        loss = (
            grpo_loss(logps, old, sub.advantages, sub.completion_mask) * sub.completion_mask.sum() / n_global
        )
        loss.backward()
        probe.end_step()


def single_token_direct(model, batch: Batch, tokens: dict, temperature: float = 0.7) -> list[float | None]:
    """The reference for the probe's "direct" gradients, by one plain backward per token (no probe code):
    |w_t| x ||d log pi_t / d h_point[row, p(t)]|| for every row of a `tokens` record (None where it has none),
    h_point the output of decoder layer i (`layers.{i}.out`) or of the final norm, p(t) = S - C - 1 + j. The LM head
    runs in float32 on the final norm's output (under autocast too), as the probe's exact head does."""
    from tokendyn.probe import discover_points

    modules = {p.name: p.module for p in discover_points(model)}
    hidden = {}
    hooks = [
        m.register_forward_hook(
            lambda mod, i, o, k=k: hidden.__setitem__(k, o if torch.is_tensor(o) else o[0])
        )
        for k, m in modules.items()
    ]
    try:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    head = model.get_output_embeddings()
    with torch.autocast(
        batch.input_ids.device.type, enabled=False
    ):  # the LM head in float32, as the probe's u
        logits = torch.nn.functional.linear(
            hidden["final_norm.out"].float(),
            head.weight.float(),
            None if head.bias is None else head.bias.float(),
        )
    logps = completion_logps(logits, batch, temperature)
    s = batch.input_ids.shape[1]
    expected = []
    for r, j, point, w, got in zip(
        tokens["row"], tokens["pos"], tokens["point"], tokens["w"], tokens["direct_norm"], strict=True
    ):
        if got is None:
            expected.append(None)
            continue
        (g,) = torch.autograd.grad(logps[r, j], hidden[point], retain_graph=True)
        expected.append(g[r, s - batch.c - 1 + j].double().norm().item() * abs(w))
    return expected


def float64_probe_setup(model_dir, seed: int, temperature: float):
    """(the model at ``model_dir`` in float64, a ProbeBatch of 6 random rows of 5 prompt + up to 9 completion ids
    with mixed-sign advantages): the batch the rule comparisons' float64 references run on."""
    from transformers import AutoModelForCausalLM

    from tokendyn.probe.tokenloss import ProbeBatch

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    b, p, c = 6, 5, 9
    ids = torch.randint(3, model.config.vocab_size, (b, p + c), generator=g)
    lengths = torch.tensor([9, 7, 5, 9, 3, 8])
    cmask = torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)
    attn = torch.cat([torch.ones(b, p, dtype=torch.long), cmask.long()], 1)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    return model, ProbeBatch(ids, attn, cmask, adv, temperature=temperature)
