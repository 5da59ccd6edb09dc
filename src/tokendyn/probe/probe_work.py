"""The work of `tokendyn.probe.probe.GradientProbe` once a micro-batch's forward is done: the positions, the token
sample, the direct gradients, the head checks and sigma_max, and the step's data for
`tokendyn.probe.reduce.reduce_step`."""

from __future__ import annotations

from functools import partial

import torch

from tokendyn.probe import budget, parallel
from tokendyn.probe.capture import (
    Pass,
    all_reduce_sum,
    at_tokens,
    completion_positions,
    gather_completion,
)
from tokendyn.probe.direct import DirectMemoryError
from tokendyn.probe.head import HeadShard, sigma_max_gram
from tokendyn.probe.head_entropy import entropy_direction
from tokendyn.probe.points import (
    FINAL_NORM,
    output_head,
)
from tokendyn.probe.reduce import HeadCheckData, StepData
from tokendyn.probe.replay import replay_direct_norms
from tokendyn.probe.rounding import LOW_PRECISION, head_compute_dtype
from tokendyn.probe.stats import bottom_k_sample


class ProbeWork:
    """`GradientProbe`'s work (a mixin: every attribute is the probe's own, set in its `__init__`)."""

    # ---- work ------------------------------------------------------------------------------------------------
    def _prepare(self, p: Pass) -> None:
        """Forward done and inputs known: align positions, pick the token sample, keep what the checks need, run
        the direct gradients; then release the live activations."""
        inp = p.inputs
        if p.shape is None:
            return
        b, seq = p.shape
        n_rows, c_len = inp.completion_mask.shape
        pos = completion_positions(b, seq, inp.completion_mask, inp.token_positions, inp.token_rows)
        device = next(iter(p.hidden.values())).device if p.hidden else inp.completion_mask.device
        pos = pos.to(device)
        fwd_rows = None if inp.token_rows is None else inp.token_rows.to(device)
        if inp.logps is not None:
            p.w_kind = "completion"
            p.logp_value = inp.logps.detach()
            p.handles.append(inp.logps.register_hook(partial(self._on_logp_grad, p, "completion")))
        elif p.logp_seq is not None:
            p.w_kind = "seq"
            p.logp_value = at_tokens(p.logp_seq.detach(), pos, fwd_rows)
        else:
            return  # wait for watch_logps
        if inp.entropy is not None:
            p.e_kind = "completion"
            p.handles.append(inp.entropy.register_hook(partial(self._on_entropy_grad, p, "completion")))
        elif p.entropy_seq is not None:
            p.e_kind = "seq"
        p.positions, p.rows, p.prepared = pos, fwd_rows, True
        n_check = c_len * n_rows if self.check_tokens is None else self.check_tokens
        k = max(self.sample_tokens, self.direct_tokens, n_check)
        idx, ok = bottom_k_sample(inp.completion_mask, k, self.generator)
        idx, ok = idx.to(device), ok.to(device)
        p.sample = (idx, ok)
        rows, cols = idx // c_len, idx % c_len
        spos = pos[rows, cols]
        if fwd_rows is not None:
            rows = fwd_rows[rows, cols]  # from here on: the forward's rows
        h_final = p.hidden.get(FINAL_NORM)
        if self.head_ok and h_final is not None and inp.completion_ids is not None:
            shard = parallel.head_shard(output_head(self.model))  # FSDP2: this rank's vocabulary rows only
            shard.softcap = self.softcap
            kc = budget.check_tokens_within(
                n_check,
                idx.shape[0],
                self._flop_params,
                b * seq,
                shard.hidden,
                shard.vocab,
                self.check_budget,
            )
            kd = self._direct_due(min(self.direct_tokens, idx.shape[0]), rows, b, seq, shard)
            kc = self._checks_due(kc, b, seq, shard)
            kh = max(kc, kd or 0)
            targets = inp.completion_ids.to(device).reshape(-1)[idx[:kh]]
            h = h_final.detach()[rows[:kh], spos[:kh]]
            q, sigma_lower = parallel.head_sample_quantities(h, shard, targets, inp.temperature)
            p.check_at = (rows[:kc], spos[:kc])
            sigma, sigma_step = self._sigma_max(shard, inp.step, sigma_lower, checking=kc > 0)
            p.head_dtype = head_compute_dtype(shard.weight.dtype, h_final.dtype, p.autocast)
            p.check = HeadCheckData(
                vocab_size=shard.vocab,
                sigma_max=sigma,
                sigma_step=sigma_step,
                direction=q.direction[:kc],
                logits_ratio=q.logits_ratio[:kc],
                head_dtype=p.head_dtype,
            )
            # the head's rounding is modelled for a plain affine head (a soft cap's 16-bit tanh is not: 8 eps)
            if p.head_dtype in LOW_PRECISION and shard.group is None and shard.softcap is None and kc > 0:
                p.rounded = (h[:kc], targets[:kc], shard, inp.temperature)
            if p.e_kind is not None and kc > 0:
                if shard.group is None:
                    p.check.entropy_direction = entropy_direction(h[:kc], shard, inp.temperature)
                else:
                    self.note(
                        "entropy_sharded",
                        "an entropy bonus with a vocabulary-sharded LM head: its gradient is not in the identity "
                        "check's prediction (identity errors include it)",
                        inp.step,
                    )
            if p.logits is not None and kc > 0 and shard.group is None:
                off = seq - p.logits.shape[1]
                at = (rows[:kc], (spos[:kc] - off).clamp(min=0))
                head = (h[:kc], q.lse[:kc], targets[:kc], shard, inp.temperature)
                p.handles.append(p.logits.register_hook(partial(self._on_logits_grad, p, idx[:kc], at, head)))
            if kd is not None:
                p.direct = self._direct(p, rows[:kd], spos[:kd], q.direction[:kd])
        p.hidden, p.logp_seq, p.logits, p.calls = {}, None, None, {}

    def _direct_due(self, kd: int, rows: torch.Tensor, b: int, seq: int, shard: HeadShard) -> int | None:
        """How many of the first ``kd`` sampled tokens (forward ``rows``) get direct gradients on this micro-batch,
        None for no replay: one on every `direct_every`-th probed micro-batch with a credit >= 0 (`budget.Credit`:
        each micro-batch earns direct_budget x its training flops, a replay spends its estimated flops,
        `budget.direct_flops`); with a budget, on the longest prefix whose replay costs at most `budget.REPLAY_STEPS`
        of this micro-batch's training flops (`budget.direct_tokens_within`: at least one). Under FSDP2 the ranks
        agree (one replays: all do, a rank without a token with none, its replay's collectives matched)."""
        self._n_prepared += 1
        step = budget.step_flops(self._flop_params, b * seq)
        self._direct_credit.earn(step)
        if self.direct_tokens <= 0:  # (off on every rank)
            return None
        due = kd > 0 and (self._n_prepared - 1) % self.direct_every == 0 and self._direct_credit.affordable()
        if not parallel.agree_max(int(due), self.model, rows.device):
            return None
        if kd <= 0:
            return 0
        layer_params = max(self._flop_params - shard.vocab * shard.hidden, 0)
        sampled = rows[:kd].tolist()
        if self._direct_credit.budget is not None:
            kd = budget.direct_tokens_within(sampled, layer_params, seq, budget.REPLAY_STEPS * step)
        self._direct_credit.spend(budget.replay_flops(sampled[:kd], layer_params, seq))
        return kd

    def _checks_due(self, kc: int, b: int, seq: int, shard: HeadShard) -> int:
        """The tokens checked exactly at the LM head on this micro-batch: kc when the checks' credit allows
        (`budget.Credit`, `budget.check_flops`), else 0; under FSDP2 the ranks agree (one checks: all do)."""
        self._check_credit.earn(budget.step_flops(self._flop_params, b * seq))
        due = kc > 0 and self._check_credit.affordable()
        if not bool(parallel.agree_max(int(due), self.model, shard.weight.device)):
            return 0
        refresh = self._sigma is None or self._n_checks % self.sigma_every == 0
        self._check_credit.spend(budget.check_flops(kc, shard.hidden, shard.vocab, refresh))
        return kc

    def _direct(self, p: Pass, rows, spos, direction) -> torch.Tensor | None:
        """[P, Kd] ||d log pi_t / d h_l[p(t)]|| on the first Kd sampled tokens (NaN for points not captured), from
        u = d log pi_t / dh at the LM-head input (`direction` [Kd, H]).

        By replaying the layers from their recorded inputs (`replay_direct_norms`), only the rows that hold sampled
        tokens, in groups under the `direct_memory_mb` cap: its memory does not grow with the micro-batch's rows, and
        it works under FSDP2 and every kind of activation checkpointing. A micro-batch over the cap gets None (and a
        warning); a forward that did not call every layer switches the direct gradients off (and warns)."""
        cap = None if self.direct_memory_mb is None else self.direct_memory_mb * 2**20
        full = torch.full(
            (len(self.point_names), rows.shape[0]), float("nan"), dtype=torch.float32, device=rows.device
        )
        calls = [p.calls.get(q.name) for q in self._chain]
        self._guard = True  # the probe's own tensor hooks must ignore these backwards
        try:
            if any(c is None for c in calls):
                missing = [q.name for q, c in zip(self._chain, calls, strict=True) if c is None]
                raise RuntimeError(f"the forward never called {', '.join(missing)}")
            agree = partial(parallel.agree_max, model=self.model, device=rows.device)
            d = replay_direct_norms(
                calls, self.point_names, rows, spos, direction, self.direct_chunk, cap, agree
            )
            for i, n in enumerate(self.point_names):
                full[i] = d[n]
            return full
        except (DirectMemoryError, torch.OutOfMemoryError) as exc:
            self.note(
                "direct_memory",
                f"no direct gradients on micro-batches over the memory they may use (first at step "
                f"{p.inputs.step}): {exc} (direct_memory_mb={self.direct_memory_mb}; raise it, or None for no cap)",
                step=p.inputs.step,
            )
            return None
        except RuntimeError as exc:
            self.note(
                "direct_disabled",
                f"direct gradients disabled for {type(self.model).__name__} "
                f"({'FSDP2 fully_shard, ' if parallel.is_fully_sharded(self.model) else ''}layer replay): {exc}",
                step=p.inputs.step,
            )
            self.direct_tokens = 0
            return None
        finally:
            self._guard = False

    def sigma_state(self) -> dict:
        """What the probe's schedules carry from step to step, for a checkpoint: the checks and probed micro-batches
        counted, the two budgets' credits and, once computed, sigma_max, its right singular vector (CPU) and the
        step it was computed at. A resumed probe given
        it back (`load_sigma_state`) refreshes on the same schedule and records what an uninterrupted run does."""
        base = {
            "n_checks": self._n_checks,
            "n_prepared": self._n_prepared,
            "direct_credit": self._direct_credit.credit,
            "check_credit": self._check_credit.credit,
        }
        if self._sigma is None:
            return base
        sigma, v, step = self._sigma
        return base | {"sigma": sigma, "vector": v.detach().cpu(), "step": step}

    def load_sigma_state(self, state: dict) -> None:
        self._n_checks = int(state["n_checks"])
        self._n_prepared = int(state.get("n_prepared", self._n_prepared))
        self._direct_credit.credit = float(state.get("direct_credit", self._direct_credit.credit))
        self._check_credit.credit = float(state.get("check_credit", self._check_credit.credit))
        if "sigma" in state:
            self._sigma = (float(state["sigma"]), state["vector"].to(torch.float64), int(state["step"]))

    def _sigma_max(self, shard: HeadShard, step: int, lower: float, checking: bool) -> tuple[float, int]:
        """(sigma, the step it was computed at): sigma_max(W) = sqrt(lambda_max(W^T W)) from the H x H Gram matrix
        (`head.sigma_max_gram`: one float64 pass over the head, exact to float64 rounding), recomputed on the first
        call and then on every `sigma_every`-th call that checks tokens (`checking`; a collective under a sharded
        head: every rank calls it as often, `_checks_due` agrees on `checking`). In
        between, the W of the last refresh stands in for the current one, and the value is raised to `lower` (a
        lower bound of the current sigma_max from this micro-batch's tokens), so that a head grown since the
        refresh cannot make the bound check count tokens above a bound the current W allows them to reach."""
        due = checking and self._n_checks % self.sigma_every == 0
        self._n_checks += int(checking)
        fresh = self._sigma is None or self._sigma[1].shape[0] != shard.hidden
        if fresh or due:
            sigma, v = sigma_max_gram(shard, parallel.all_reduce_in(shard.group))
            self._sigma = (sigma, v, step)
        sigma, _, at = self._sigma
        return max(sigma, lower), at

    def _step_data(self, p: Pass, micro: int) -> StepData:
        """The step's tensors; the gradients divided by the data-parallel size n (see `data_parallel_size`)."""
        inp = p.inputs
        device = p.positions.device
        n = self.data_parallel_size
        scale = (lambda t: t) if n == 1 else (lambda t: None if t is None else t / n)  # noqa: E731
        norms, w = gather_completion(p, self.point_names)
        norms, w = scale(norms), scale(w)
        check = p.check
        if check is not None:
            check.delta, check.logits_identity_err, check.grad_dtype = (
                scale(p.delta_check),
                p.logits_grad_check,  # relative errors: the same at any scale
                p.grad_dtype,
            )
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return StepData(
            step=inp.step,
            stage=inp.stage,
            rank=self.rank,
            micro=micro,
            points=self.point_names,
            norms=norms,
            valid=to(inp.completion_mask),
            w=w,
            logp=p.logp_value.to(device),
            pi_old=to(inp.pi_old),
            advantages=to(inp.advantages),
            completion_ids=to(inp.completion_ids),
            temperature=inp.temperature,
            bins=self.bins,
            sample_idx=p.sample[0],
            sample_valid=p.sample[1],
            n_record=self.sample_tokens,
            direct=p.direct,
            check=check,
            final_index=self.point_names.index(FINAL_NORM) if self.has_final else None,
            reached=[n in p.norms for n in self.point_names],
            reduce_fn=all_reduce_sum,
            hist=self.hist,
        )
