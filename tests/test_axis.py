"""The axis through both camps (`tokendyn.effects.axis`): A_t <- (1 + c (1 - pi_old,t)) A_t swept in the paired
comparison. Its points are the named rules where they coincide (c = -alpha: Reweight, c = 0: the base rule, c > 0: the
Delta-log-p reweight, eta: Lopti), bitwise; and a point of each sign equals a plain-torch float64 computation written
here from the formula: the reweighted advantages, the SGD step at the base rule's norm, then dpi, the entropy change
and KL(pi_base || pi_c) from full softmaxes over the vocabulary."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import float64_probe_setup

from tokendyn.config import ProbeConfig, ProbeConfigError
from tokendyn.effects.axis import axis_rules
from tokendyn.effects.compare import compare_rules, make_rule, paired_frame
from tokendyn.effects.shares import as_edges
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import Objective

torch.set_num_threads(1)
TEMP, LR = 0.7, 0.02
BASE = Objective(eps_low=0.2, eps_high=0.24, loss_type="dapo")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    return float64_probe_setup(tiny_model_dir, 11, TEMP)


def test_sweep_points_are_the_named_rules_bitwise(setup):
    model, batch = setup
    named = [
        make_rule("base", BASE),
        make_rule("reweight", BASE, alpha=0.3),
        make_rule("logp_reweight", BASE, c=0.2),
        make_rule("lopti", BASE, eta=0.5),
    ]
    rules = named + axis_rules(BASE, (-0.3, 0.0, 0.2), (0.5,))
    out = compare_rules(model, batch, rules, lr=LR)
    pairs = {"c=-0.3": "reweight", "c=0": "base", "c=0.2": "logp_reweight", "eta=0.5": "lopti"}
    for point, rule in pairs.items():
        a, b = out[(point, "equal_norm")], out[(rule, "equal_norm")]
        for name in ("delta", "shares", "entropy", "kl"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (point, rule, name)
        assert a.param_step == b.param_step and a.sweep is not None and b.sweep is None
    assert float(out[("c=0.2", "equal_norm")].delta.abs().max()) > 0


def test_sweep_records_name_their_point_and_equal_the_rule_rows(setup):
    from tokendyn.probe.tokenloss import pi_old

    model, batch = setup
    rules = [make_rule("base", BASE), make_rule("reweight", BASE, alpha=0.5)] + axis_rules(BASE, (-0.5,))
    out = compare_rules(model, batch, rules, lr=LR, inner_steps=2)
    frame = paired_frame(out, batch, pi_old(model, batch), as_edges(None), step=3)
    point, rule = frame.filter(frame["rule"] == "c=-0.5"), frame.filter(frame["rule"] == "reweight")
    assert set(point["sweep"]) == {"c"} and set(point["sweep_value"]) == {-0.5}
    assert rule["sweep"].null_count() == rule.height and set(frame["inner_steps"]) == {2}
    keep = [c for c in frame.columns if c not in ("rule", "sweep", "sweep_value", "sum_share")]
    assert point.select(keep).equals(rule.select(keep))
    # (the shares' JVP of the named rule is batched with the base rule's, the point's made alone: to rounding)
    assert ((point["sum_share"] - rule["sum_share"]).abs() <= 1e-12 * rule["sum_share"].abs().max()).all()
    base = frame.filter(frame["rule"] == "base")
    assert (base["sum_kl_ref"] == 0).all() and (point["sum_kl_ref"] > 0).any()


def _dist(model, batch):
    """log softmax (B, C, V) float64 at the completion positions, and log pi_t(o_t)."""
    c = batch.n_completion
    z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, -c - 1 : -1] / TEMP
    lsm = torch.log_softmax(z.double(), -1)
    return lsm, lsm.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def _plain(model, batch, c_values):
    """dpi, dH and KL(pi_base || pi_c) of each c, the equal-norm SGD step written out on a float64 copy."""
    model = copy.deepcopy(model).double().eval()
    mask = batch.completion_mask
    with exact_float64():
        with torch.no_grad():
            lsm0, old = _dist(model, batch)
        pi0 = torch.exp(old)

        def step(c, target):
            work = copy.deepcopy(model)
            adv = batch.advantages.double() * (1 + c * (1 - pi0))  # (B, C): ProbeBatch broadcasts A
            _, logp = _dist(work, batch)
            r = torch.exp(logp - old)
            pg = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.24) * adv)
            loss = (pg * mask).sum() / mask.sum()
            grads = torch.autograd.grad(loss, list(work.parameters()))
            norm = sum(float((x**2).sum()) for x in grads) ** 0.5
            target = LR * norm if target is None else target
            with torch.no_grad():
                for p, x in zip(work.parameters(), grads, strict=True):
                    p.sub_(target / norm * x)
                lsm, logp = _dist(work, batch)
            return lsm, torch.exp(logp), target

        lsm_b, _, target = step(0.0, None)
        out = {}
        for c in c_values:
            lsm, pi, _ = step(c, target)
            ent = -(lsm.exp() * lsm).sum(-1) + (lsm0.exp() * lsm0).sum(-1)
            kl = (lsm_b.exp() * (lsm_b - lsm)).sum(-1)
            out[c] = {k: v * mask for k, v in (("delta", pi - pi0), ("entropy", ent), ("kl", kl))}
    return out


def test_a_point_of_each_sign_equals_a_plain_float64_computation(setup):
    model, batch = setup
    cs = (-0.8, 0.0, 0.6)
    out = compare_rules(model, batch, [make_rule("base", BASE), *axis_rules(BASE, cs)], lr=LR, shares=False)
    want = _plain(model, batch, cs)
    for c in cs:
        got = out[(f"c={c:g}", "equal_norm")]
        for name in ("delta", "entropy", "kl"):
            ref, mine = want[c][name], getattr(got, name)
            scale = float(ref.abs().max())
            err = float((mine - ref).abs().max()) / (scale if scale > 0 else 1.0)
            print(f"c = {c:g}, {name}: max |ours - plain| / max |plain| = {err:.1e} (scale {scale:.2e})")
            assert err < (1e-9 if scale > 0 else 1e-20), (c, name, err)
    # the two camps move the batch apart: the c = -0.8 and c = 0.6 updates differ from the base's and each other's
    assert (
        float(want[0.6]["kl"].max()) > 0 and float((want[-0.8]["delta"] - want[0.6]["delta"]).abs().max()) > 0
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("compare_inner_steps", 0, "compare_inner_steps: must be an integer >= 1, got 0"),
        ("compare_c_sweep", [-1.5], "compare_c_sweep: must be a list of numbers in [-1, 10]"),
        ("compare_eta_sweep", [0.0, 0.5], "compare_eta_sweep: must be a list of numbers in (0, 1)"),
    ],
)
def test_sweep_options_are_checked_naming_the_field(field, value, message):
    with pytest.raises(ProbeConfigError) as exc:
        ProbeConfig(**{field: value})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_sweep_turns_the_comparison_on():
    cfg = ProbeConfig(compare_c_sweep=[0.2, -0.3, 0.2])
    assert cfg.compare_rules == ("base",) and cfg.compare_c_sweep == (-0.3, 0.2)
