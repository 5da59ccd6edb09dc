"""The hooks of `tokendyn.probe.probe.GradientProbe`: the root module's forward, each probed point's forward and
output gradient, and the gradients of log pi, the entropy and the logits. They only read (they return None)."""

from __future__ import annotations

from functools import partial

import torch

from tokendyn.probe.capture import (
    Pass,
    at_tokens,
    in_backward,
)
from tokendyn.probe.head import logits_identity_error
from tokendyn.probe.points import (
    FINAL_NORM,
)
from tokendyn.probe.replay import LayerCall
from tokendyn.probe.rounding import rounded_head_gradient


class ProbeHooks:
    """`GradientProbe`'s hooks (a mixin: every attribute is the probe's own, set in its `__init__`)."""

    # ---- hooks -----------------------------------------------------------------------------------------------
    def _on_root_pre(self, module, args) -> None:
        if (
            not self.enabled
            or not torch.is_grad_enabled()
            or torch.is_inference_mode_enabled()
            or in_backward()
        ):
            return
        if self._pending is None and not self.auto:
            return
        cur = self._pass
        if cur is not None:
            if cur.inputs is not None and cur.backward_seen:
                self.end_step()
            elif cur.inputs is not None:
                raise RuntimeError(
                    f"probe: a second forward with gradients inside step {cur.inputs.step} before its backward; "
                    "one probe step is one forward + one backward (call end_step() between micro-batches)"
                )
            else:
                cur.release()
        p = Pass()
        p.inputs, self._pending = self._pending, None
        self._pass, self._forwarding = p, True

    def _on_module_input(self, name: str, module, args, kwargs) -> None:
        p = self._pass
        if p is None or not self._forwarding or not args or not torch.is_tensor(args[0]):
            return
        p.calls[name] = LayerCall.record(name, module, args, kwargs)

    def _on_point_forward(self, name: str, module, args, output) -> None:
        p = self._pass
        if p is None:
            return
        t = output if torch.is_tensor(output) else output[0]
        if not torch.is_tensor(t):
            return
        if not self._forwarding:
            # a checkpointed module recomputed in the backward: hook the recomputed output of a point whose forward
            # output carried no gradient (its forward ran inside a reentrant checkpoint, under no_grad)
            if name in p.unhooked and t.requires_grad and in_backward():
                p.unhooked.discard(name)
                p.handles.append(t.register_hook(partial(self._on_point_grad, p, name)))
            return
        p.shape = (int(t.shape[0]), int(t.shape[1]))
        if not t.requires_grad:
            p.unhooked.add(name)
            return
        if name == FINAL_NORM:
            p.hidden[name] = t
            p.autocast = (torch.is_autocast_enabled(t.device.type), torch.get_autocast_dtype(t.device.type))
        p.handles.append(t.register_hook(partial(self._on_point_grad, p, name)))

    def _on_root_post(self, module, args, output) -> None:
        if not self._forwarding:
            return
        self._forwarding = False
        p = self._pass
        p.forward_done = True
        lp = getattr(output, "log_probs", None)
        if torch.is_tensor(lp) and lp.requires_grad:
            p.logp_seq = lp
            p.handles.append(lp.register_hook(partial(self._on_logp_grad, p, "seq")))
        ent = getattr(output, "entropy", None)
        if torch.is_tensor(ent) and ent.requires_grad:
            p.entropy_seq = ent
            p.handles.append(ent.register_hook(partial(self._on_entropy_grad, p, "seq")))
        logits = getattr(output, "logits", None)
        if torch.is_tensor(logits) and logits.requires_grad:
            p.logits = logits
        if p.inputs is not None:
            self._prepare(p)

    def _on_point_grad(self, p: Pass, name: str, grad: torch.Tensor | None) -> None:
        if self._guard or grad is None:
            return
        p.backward_seen = True
        p.norms[name] = torch.linalg.vector_norm(
            grad.detach(), dim=-1, dtype=torch.promote_types(grad.dtype, torch.float32)
        )
        if name == FINAL_NORM:
            p.grad_dtype = grad.dtype
            if p.check_at is not None:
                p.delta_check = grad.detach()[p.check_at].float()
            if p.check is not None and p.e_grad is not None:
                p.check.entropy_weight = self._at_checks(p, p.e_grad, p.e_kind).to(torch.float64)
            if p.rounded is not None and p.check is not None and p.w_grad is not None:
                # a 16-bit head: its rounding predicted here, in the training backward (W is still the forward's)
                h, targets, shard, temperature = p.rounded
                p.check.rounded = rounded_head_gradient(
                    h, shard, targets, self._at_checks(p, p.w_grad, p.w_kind), temperature, p.head_dtype,
                    e=p.check.entropy_weight,
                )  # fmt: skip

    # A tensor hook gets None for an output of a multi-output node that received no gradient while another did
    # (seen under DDP with LoRA and bf16: the fused head's entropy when the loss has no entropy term): no gradient.
    def _on_logp_grad(self, p: Pass, kind: str, grad: torch.Tensor | None) -> None:
        if grad is not None and not self._guard and kind == p.w_kind:
            p.w_grad = grad.detach().clone()

    def _on_entropy_grad(self, p: Pass, kind: str, grad: torch.Tensor | None) -> None:
        if grad is not None and not self._guard and kind == p.e_kind:
            p.e_grad = grad.detach().clone()

    @staticmethod
    def _at_checks(p: Pass, grad: torch.Tensor, kind: str) -> torch.Tensor:
        """A per-token gradient (w or e, [B, C] "completion" or [b, S-1] "seq") at the check tokens, flat [Kc]."""
        if kind != "completion":
            grad = at_tokens(grad, p.positions, p.rows)
        return grad.reshape(-1)[p.sample[0][: p.check.direction.shape[0]]]

    def _on_logits_grad(self, p: Pass, idx: torch.Tensor, at: tuple, head: tuple, grad: torch.Tensor) -> None:
        """The logits-level identity error of the check tokens, computed here, in the training backward (W is still
        the forward's): the gradient rows are streamed against pi chunk by chunk, nothing tokens x V is kept."""
        if self._guard:
            return
        if p.w_grad is None:
            p.logits_grad_check = None
            return
        w = p.w_grad
        if p.w_kind != "completion":
            w = at_tokens(w, p.positions, p.rows)
        h, lse, targets, shard, temperature = head
        g = grad.detach()
        p.logits_grad_check = logits_identity_error(
            lambda a, b: g[at[0], at[1], a:b], w.reshape(-1)[idx], h, lse, shard, targets, temperature
        )  # per-token relative errors [Kc], not the gradient rows
