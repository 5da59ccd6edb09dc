"""The paired comparison (`tokendyn.effects.compare`) against a plain-torch computation written here, on a float64
model: each rule's update applied to a copy of the model (its own loss, gradient, step size), pi read before and
after. The undo leaves the parameters and the run's optimizer state bitwise as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokendyn.effects.compare import compare_rules, make_rule, paired_frame
from tokendyn.effects.shares import as_edges
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import Objective, ProbeBatch

torch.set_num_threads(1)
T, LR, ALPHA, ETA = 0.7, 1e-2, 0.3, 0.5
BASE = Objective(eps_low=0.2, eps_high=0.24, loss_type="dapo")


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    b, p, c = 6, 5, 9
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (b, p + c), generator=g)
    lengths = torch.tensor([9, 7, 5, 9, 3, 8])
    cmask = torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)
    attn = torch.cat([torch.ones(b, p, dtype=torch.long), cmask.long()], 1)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    batch = ProbeBatch(ids, attn, cmask, adv, temperature=T)
    return model, batch


def logp_of(model, batch):
    c = batch.n_completion
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, -c - 1 : -1] / T
    return torch.log_softmax(logits.double(), -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def plain_loss(model, batch, adv, old, keep):
    """The run's loss written out: -min(r A, clip(r, 0.8, 1.24) A) over the batch's token count (dapo)."""
    m = batch.completion_mask.double() * keep
    r = torch.exp(logp_of(model, batch) - old)
    pg = -torch.minimum(r * adv, torch.clamp(r, 0.8, 1.24) * adv)
    return (pg * m).sum() / batch.completion_mask.sum()


def grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


def norm(gs):
    return sum(float((x.double() ** 2).sum()) for x in gs) ** 0.5


def sgd_step(model, gs, lr):
    with torch.no_grad():
        for p, x in zip(model.parameters(), gs, strict=True):
            p.sub_(lr * x)


def plain_rule(model, batch, rule: str, eta: float = ETA) -> torch.Tensor:
    """dpi of every token after the rule's equal-norm SGD update, on a copy of the model (Lopti at ``eta``)."""
    model.eval()
    with torch.no_grad():
        old = logp_of(model, batch)
    pi0 = torch.exp(old)
    ones = torch.ones_like(old)
    adv = batch.advantages.double()
    target = LR * norm(grads(model, plain_loss(model, batch, adv, old, ones)))
    if rule in ("reweight", "reweight_lopti"):
        adv = adv * (ALPHA * pi0 + 1 - ALPHA)
    work = copy.deepcopy(model)
    g_all = grads(work, plain_loss(work, batch, adv, old, ones))
    lr = target / norm(g_all)  # one stage: exactly the target norm; Lopti: its first pass is at LR
    if rule in ("base", "reweight"):
        sgd_step(work, g_all, lr)
    else:
        low = ((pi0 < eta) & batch.completion_mask).double()
        theta0 = [p.detach().clone() for p in work.parameters()]

        def two_stages(lr):
            for keep in (low, batch.completion_mask.double() - low):
                sgd_step(work, grads(work, plain_loss(work, batch, adv, old, keep)), lr)
            return (
                sum(float(((p - q) ** 2).sum()) for p, q in zip(work.parameters(), theta0, strict=True))
                ** 0.5
            )

        achieved = two_stages(LR)
        with torch.no_grad():
            for p, q in zip(work.parameters(), theta0, strict=True):
                p.copy_(q)
        two_stages(LR * target / achieved)
    with torch.no_grad():
        return (torch.exp(logp_of(work, batch)) - pi0) * batch.completion_mask


def plain_lopti(model, batch, eta: float, lr: float) -> torch.Tensor:
    """dpi of every token after Lopti's two SGD stages at ``lr`` (pi_old < eta first), on a copy of the model."""
    model.eval()
    with torch.no_grad():
        old = logp_of(model, batch)
    work = copy.deepcopy(model)
    low = ((torch.exp(old) < eta) & batch.completion_mask).double()
    for keep in (low, batch.completion_mask.double() - low):
        sgd_step(work, grads(work, plain_loss(work, batch, batch.advantages.double(), old, keep)), lr)
    with torch.no_grad():
        return (torch.exp(logp_of(work, batch)) - torch.exp(old)) * batch.completion_mask


def plain_rule64(model, batch, rule: str) -> torch.Tensor:
    """`plain_rule` on a float64 copy, float64 at every op: the reference of the comparison's float64 steps."""
    work = copy.deepcopy(model).double()
    with exact_float64():
        return plain_rule(work, batch, rule)


@pytest.mark.parametrize("precision", ["float64", "model"])
def test_paired_dpi_equal_a_plain_torch_update_of_a_copy(setup, precision):
    """float64 steps (the default) against the plain-torch update of a float64 copy; the model's own float32 steps
    against that update of a float32 copy."""
    model, batch = setup
    names = ("base", "reweight", "lopti")
    rules = [make_rule(n, BASE, alpha=ALPHA, eta=ETA) for n in names]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = compare_rules(model, batch, rules, modes=("equal_norm",), lr=LR, precision=precision)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for name in names:
        want = plain_rule64(model, batch, name) if precision == "float64" else plain_rule(model, batch, name)
        got = results[(name, "equal_norm")].delta
        scale = float(want.abs().max())
        assert scale > 1e-6
        err = float((got - want).abs().max()) / scale
        print(f"{name}: max |dpi - plain| / max |dpi| = {err:.1e}")
        assert err < 1e-8, (name, err)
    # equal norm: every rule's step has the base rule's norm (one-stage exactly, Lopti after one correction)
    steps = {n: results[(n, "equal_norm")].param_step for n in names}
    assert (
        abs(steps["reweight"] / steps["base"] - 1) < 1e-9 and abs(steps["lopti"] / steps["base"] - 1) < 1e-3
    )
    # the paired record sums the same numbers
    with torch.no_grad():
        pi_old = torch.exp(logp_of(model, batch))
    frame = paired_frame(results, batch, pi_old, as_edges(None), step=0)
    for name in names:
        rows = frame.filter(frame["rule"] == name)
        assert int(rows["count"].sum()) == int(batch.completion_mask.sum())
        assert abs(float(rows["sum_dpi"].sum()) - float(results[(name, "equal_norm")].delta.sum())) < 1e-12
        diff = results[(name, "equal_norm")].delta - results[("base", "equal_norm")].delta
        assert abs(float(rows["sum_diff"].sum()) - float(diff.sum())) < 1e-12
    shares = frame.filter(frame["rule"] == "base")["sum_share"].sum()
    assert abs(shares - 1.0) < 1e-9  # s_t along the rule's own update sums to 1


class Forwards:
    """Counts the forward passes of the model's decoder (the LM head runs in chunks apart)."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.model.register_forward_hook(lambda *_: setattr(self, "n", self.n + 1))

    def close(self):
        self.handle.remove()


@pytest.mark.parametrize("with_influence", [True, False])
def test_the_analyses_full_step_is_the_base_rule_and_is_reused(setup, with_influence):
    """The analyses' full step (`analyze_update`) handed to `compare_rules` as its base rule: every rule's dpi still
    equals the plain-torch update of a copy, and with four forward passes fewer (pi at theta_0, the base step's
    forward, its pi, its JVP); the base shares are the analyses' s_t along g. A Reweight run's step (other
    advantages) or another lr is not reused."""
    from dataclasses import replace

    from tokendyn.effects.compare import reuses
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update

    model, batch = setup
    opts = RebalanceOptions(lr=LR, influence=with_influence, token_shares=2)
    frames, full = analyze_update(model, batch, step=0, options=opts, objective=BASE)
    assert full is not None
    names = ("base", "reweight", "lopti")
    rules = [make_rule(n, BASE, alpha=ALPHA, eta=ETA) for n in names]
    assert reuses(full, rules[0], batch, LR)
    assert not reuses(full, rules[0], batch, LR * 2)
    assert not reuses(full, rules[1], batch, LR)
    assert not reuses(full, rules[0], replace(batch, advantages=batch.advantages * 1.5), LR)
    counter = Forwards(model)
    try:
        fresh = compare_rules(model, batch, rules, modes=("equal_norm",), lr=LR)
        n_fresh, counter.n = counter.n, 0
        reused = compare_rules(model, batch, rules, modes=("equal_norm",), lr=LR, full=full)
        n_reused = counter.n
    finally:
        counter.close()
    print(f"forwards: {n_fresh} fresh, {n_reused} reusing the analyses' step")
    assert n_fresh - n_reused == 4
    for name in names:
        want = plain_rule64(model, batch, name)
        got = reused[(name, "equal_norm")].delta
        err = float((got - want).abs().max()) / float(want.abs().max())
        assert err < 1e-8, (name, err)
        a, b = reused[(name, "equal_norm")], fresh[(name, "equal_norm")]
        assert abs(a.param_step / b.param_step - 1) < 1e-9, name
        # a fresh base rule's shares are a JVP of the float64 model along its displacement; the reused ones the
        # analyses' JVP along g, in the model's float32 (with the influence matrix, g from the float64 steps;
        # without, from the float32 shares' gradient): equal to float32 rounding of the JVP (1.3e-6 seen)
        share_err = float((a.shares - b.shares).abs().max()) / float(b.shares.abs().max())
        assert share_err < 1e-5, (name, share_err)
    total = full.shares.sum()
    assert torch.equal(reused[("base", "equal_norm")].shares, full.shares / total)


def test_lopti_takes_its_first_stage_from_the_influence_sources(setup):
    """With steps in the model's dtype, the analyses keep the sum of the influence sources below eta (Lopti's first
    stage at theta_0) and the comparison's Lopti makes no forward and backward of its own for it: one forward fewer,
    every rule's dpi still the plain-torch update's. Not kept where the stage is no union of source bins (eta inside
    a bin holding tokens on both sides) or under float64 steps."""
    from tokendyn.effects.rebalance import RebalanceOptions, analyze_update

    model, batch = setup
    with (
        torch.no_grad()
    ):  # (this model's pi are all below 0.25: bins at its quartiles, eta the median, between tokens)
        pi = torch.exp(logp_of(model, batch))[batch.completion_mask].sort().values
    q = [float(pi[i - 1] + pi[i]) / 2 for i in (len(pi) // 4, len(pi) // 2, 3 * len(pi) // 4)]
    edges, eta = [0.0, *q, 1.0], q[1]
    opts = RebalanceOptions(lr=LR, token_shares=2, step_precision="model")
    _, full = analyze_update(model, batch, step=0, edges=edges, options=opts, objective=BASE,
                             first_stage=(eta, "low_first"))  # fmt: skip
    assert full.first_stage is not None and full.first_stage.signal
    low = torch.exp(full.batch.old_logp) < eta
    assert torch.equal(full.first_stage.mask, low & batch.completion_mask)
    assert 10 < int(full.first_stage.mask.sum()) < int(batch.completion_mask.sum()) - 10  # (two source bins)
    # the kept sum against the stage's gradient by autograd, written out here
    model.eval()
    want = grads(
        model, plain_loss(model, batch, batch.advantages.double(), full.batch.old_logp, low.double())
    )
    model.train()
    for (name, got), w in zip(full.first_stage.gradient.items(), want, strict=True):
        # (to 4e-8 of the largest entry: two backwards through the float32 attention softmax against one)
        assert float((got - w).abs().max()) <= 1e-6 * float(w.abs().max()), name
    names = ("base", "reweight", "lopti")
    rules = [make_rule(n, BASE, alpha=ALPHA, eta=eta) for n in names]
    _, plain = analyze_update(model, batch, step=0, edges=edges, options=opts, objective=BASE)
    assert plain.first_stage is None
    counter = Forwards(model)
    try:
        base_only = compare_rules(model, batch, rules, lr=LR, full=plain, precision="model")
        n_base, counter.n = counter.n, 0
        reused = compare_rules(model, batch, rules, lr=LR, full=full, precision="model")
        n_reused = counter.n
    finally:
        counter.close()
    assert n_base - n_reused == 1, (n_base, n_reused)
    for (
        name
    ) in names:  # (model-dtype steps: against the plain update of a copy in the model's dtype, float64 here)
        got = reused[(name, "equal_norm")]
        # (Lopti at LR 1e-2 with a real split is far from linear: its first pass lands at 5.8x the equal norm, one
        # correction at 489x; the comparison's search ends at 0.957x, and the plain update is made at its lr)
        want = plain_rule(model, batch, name) if name != "lopti" else plain_lopti(model, batch, eta, got.lr)
        err = float((got.delta - want).abs().max()) / float(want.abs().max())
        # (Lopti's first stage is a sum of two backwards through the model's attention softmax, which HF's eager
        # attention takes in float32: it differs from one backward by float32 rounding, 3.5e-8 seen)
        assert err < (1e-6 if name == "lopti" else 1e-8), (name, err)
        assert abs(got.norm_ratio / base_only[(name, "equal_norm")].norm_ratio - 1) < 1e-7, name

    # an optimizer that writes .grad (here: halves it) never reaches the kept gradient: it steps a copy of it
    class Halving(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)
            return super().step(closure)

    kept = {n: t.clone() for n, t in full.first_stage.gradient.items()}
    run_opt = Halving(model.parameters(), lr=LR)
    compare_rules(model, batch, rules, modes=("optimizer", "equal_norm"), lr=LR, full=full, precision="model",
                  optimizer=run_opt)  # fmt: skip
    assert all(torch.equal(kept[n], t) for n, t in full.first_stage.gradient.items())
    inside = (q[0] + eta) / 2, "low_first"  # (inside bin 1, which holds tokens on both sides of it)
    assert analyze_update(model, batch, step=0, edges=edges, options=opts, objective=BASE,
                          first_stage=inside)[1].first_stage is None  # fmt: skip
    f64 = RebalanceOptions(lr=LR, token_shares=2, step_precision="float64")
    assert analyze_update(model, batch, step=0, edges=edges, options=f64, objective=BASE,
                          first_stage=(eta, "low_first"))[1].first_stage is None  # fmt: skip


def test_the_run_optimizer_is_copied_and_the_undo_is_bitwise(setup):
    model, batch = setup
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(2):  # a state with moments, as mid-run
        opt.zero_grad()
        (model(input_ids=batch.input_ids).logits.double() ** 2).mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    rules = [make_rule(n, BASE) for n in ("base", "reweight", "lopti", "clip_cov", "80_20")]
    results = compare_rules(model, batch, rules, modes=("equal_norm", "optimizer"), lr=LR, optimizer=opt)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    now = opt.state_dict()
    for k, v in state["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(now["state"][k][name]), torch.as_tensor(t)), (k, name)
    assert now["param_groups"] == state["param_groups"]
    # the optimizer mode is the run's step: its delta equals one AdamW step of a copy on the base loss
    # (on a float64 copy, float64 at every op, as the comparison's steps are; the state cast to float64 on loading)
    work = copy.deepcopy(model).double()
    wopt = torch.optim.AdamW(work.parameters(), lr=1e-3, weight_decay=0.01)
    wopt.load_state_dict(copy.deepcopy(state))
    work.eval()
    with exact_float64():
        with torch.no_grad():
            old = logp_of(work, batch)
        loss = plain_loss(work, batch, batch.advantages.double(), old, torch.ones_like(old))
        loss.backward()
        wopt.step()
        with torch.no_grad():
            want = (torch.exp(logp_of(work, batch)) - torch.exp(old)) * batch.completion_mask
    got = results[("base", "optimizer")].delta
    assert float((got - want).abs().max()) / float(want.abs().max()) < 1e-8
    assert not torch.allclose(results[("base", "equal_norm")].delta, got)


def test_the_trainer_records_the_comparison_and_analyze_tables_it(tiny_model_dir, tmp_path):
    """A Reweight run with `probe_compare_rules`: `paired` records per rule and mode, the base rule trained on the
    advantages before Reweight, and `tokendyn analyze`'s table with intervals; training is unchanged."""
    from test_trainer import _config, _trainer

    from tokendyn.analysis import analyze_run

    options = dict(max_steps=2, advantage_reweight_alpha=0.3, probe_every=1, probe_sample_sequences=4)
    cfg = _config(tmp_path, probe_compare_rules=["lopti", "reweight", "clip_cov"], **options)
    assert cfg.probe_config().compare_rules == ("base", "reweight", "lopti", "clip_cov")
    trainer = _trainer(tiny_model_dir, cfg)
    trainer.train()
    plain = _trainer(tiny_model_dir, _config(tmp_path / "plain", **options))
    plain.train()
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), plain.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n  # the comparison is undone exactly: training is bitwise the same
    table = analyze_run(tmp_path / "run", write=True)["paired"]
    assert set(table["rule"]) == {"base", "reweight", "lopti", "clip_cov"}
    assert set(table["mode"]) == {"equal_norm", "optimizer"}
    every = table.filter(table["bin"] == -1)
    base = every.filter(every["rule"] == "base")
    assert (base["diff"].abs() == 0).all() and (base["correct_diff"] == 0).all()
    assert (every["dpi_lo"] <= every["dpi"]).all() and (every["dpi"] <= every["dpi_hi"]).all()
    assert ((every["share"] - 1).abs() < 1e-6).all()  # the bins' shares of each rule's update add up to 1
    assert (tmp_path / "run" / "analysis" / "paired.parquet").is_file()
    from tokendyn.figures.report import build_report

    report = build_report([tmp_path / "run"], tmp_path / "figures", strict=True)
    assert "h_paired" in report.figures and "Paired comparison" in report.path.read_text()
