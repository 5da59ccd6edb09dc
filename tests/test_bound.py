"""Pure functions of the probe: bins, bound math, rank correlation, on-device statistics, token sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tokendyn.probe import bound as B
from tokendyn.probe.bins import BinSpec, assign_bins, interval_edges, quantile_edges, validate_edges
from tokendyn.probe.direct import row_slots
from tokendyn.probe.head import HeadShard, head_partial, head_quantities
from tokendyn.probe.stats import BinStats, LogHistogram, bottom_k_sample

torch.set_num_threads(1)


# ---- bins ---------------------------------------------------------------------------------------------------
def test_interval_bins_half_open_and_pi_one_in_last_bin():
    edges = torch.tensor(interval_edges(4), dtype=torch.float64)
    pi = torch.tensor([0.0, 0.1, 0.25, 0.4999, 0.5, 0.74, 0.75, 0.99, 1.0])
    assert assign_bins(pi, edges).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 3]


def test_custom_edges_and_parse():
    spec = BinSpec.parse("0,0.1,0.5,1")
    assert spec.kind == "edges" and spec.edges == (0.0, 0.1, 0.5, 1.0)
    assert BinSpec.parse(None).edges == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert BinSpec.parse("intervals:5").edges == interval_edges(5)
    assert BinSpec.parse(2).edges == (0.0, 0.5, 1.0)
    assert BinSpec.parse("quantiles:3").kind == "quantiles"
    assert assign_bins(torch.tensor([0.05, 0.1, 0.7, 1.0]), torch.tensor(spec.edges)).tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0.0, 0.5, 0.5, 1.0], "strictly increasing"),
        ([0.1, 0.5, 1.0], "start at 0"),
        ([0.0], "two edges"),
        ("quantiles:0", ">= 1"),
        ("0,a,1", "cannot parse"),
        ([0.0, 0.5, 1.2], "end at 1"),
    ],
)
def test_bad_bins_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        BinSpec.parse(bad) if isinstance(bad, str) else validate_edges(bad)


def test_quantile_edges_give_balanced_bins_and_ignore_masked_tokens():
    g = torch.Generator().manual_seed(0)
    pi = torch.rand(4000, generator=g) ** 3  # skewed towards 0
    valid = torch.ones_like(pi, dtype=torch.bool)
    pi_masked = torch.cat([pi, torch.ones(1000)])  # masked-out tokens must not move the edges
    valid_masked = torch.cat([valid, torch.zeros(1000, dtype=torch.bool)])
    edges = quantile_edges(pi_masked, valid_masked, 4)
    assert edges[0] == 0 and edges[-1] == 1 and len(edges) == 5
    counts = torch.bincount(assign_bins(pi, edges), minlength=4)
    assert counts.min() > 900 and counts.max() < 1100, counts
    # heavy ties: most tokens at pi = 1 merge the upper edges instead of producing empty bins
    tied = quantile_edges(
        torch.cat([torch.ones(900), torch.rand(100, generator=g)]), torch.ones(1000, dtype=torch.bool), 4
    )
    assert len(tied) < 5 and tied[-1] == 1


# ---- bound math ---------------------------------------------------------------------------------------------
def test_logits_bound_constants():
    lo, hi = B.logits_bound_constants(5)
    assert lo == pytest.approx(math.sqrt(5 / 4)) and hi == pytest.approx(math.sqrt(2))
    with pytest.raises(ValueError):
        B.logits_bound_constants(1)


def test_one_minus_pi_is_accurate_near_one():
    logp = torch.tensor([-1e-12, -0.5, 0.0], dtype=torch.float64)
    omp = B.one_minus_pi(logp)
    assert omp[0] == pytest.approx(1e-12, rel=1e-9)
    assert omp[1] == pytest.approx(1 - math.exp(-0.5))
    assert omp[2] == 0.0


def test_softmax_grad_norm_matches_autograd_and_respects_the_bound():
    g = torch.Generator().manual_seed(1)
    vocab = 50
    z = (
        torch.randn(200, vocab, generator=g, dtype=torch.float64)
        * torch.logspace(-1, 1.5, 200, dtype=torch.float64)[:, None]
    )
    target = torch.randint(0, vocab, (200,), generator=g)
    z.requires_grad_(True)
    logp = torch.log_softmax(z, -1).gather(-1, target[:, None]).squeeze(-1)
    (grad,) = torch.autograd.grad(logp.sum(), z)  # row t: e_o - pi
    pi = torch.softmax(z.detach(), -1)
    num, omp = B.softmax_grad_norm(pi, target)
    torch.testing.assert_close(num, grad.norm(dim=-1), rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(omp, 1 - pi.gather(-1, target[:, None]).squeeze(-1), rtol=1e-6, atol=1e-15)
    ratio = B.logits_ratio(pi, target)
    lo, hi = B.logits_bound_constants(vocab)
    assert bool(((ratio >= lo * (1 - 1e-12)) & (ratio <= hi * (1 + 1e-12))).all())
    torch.testing.assert_close(B.logits_ratio_from_logits(z.detach(), target), ratio, rtol=1e-12, atol=0)
    # pi_o = 1 exactly: from pi the ratio is undefined (NaN, not an error); from the logits it stays defined
    one = torch.zeros(1, vocab, dtype=torch.float64)
    one[0, 3] = 1.0
    assert math.isnan(float(B.logits_ratio(one, torch.tensor([3]))[0]))
    z_one = torch.zeros(1, vocab, dtype=torch.float64)
    z_one[0, 3] = 1e5  # softmax(z)[3] == 1.0 in float64
    r = float(B.logits_ratio_from_logits(z_one, torch.tensor([3]))[0])
    assert torch.softmax(z_one, -1)[0, 3] == 1.0 and r == pytest.approx(math.sqrt(1 + 1 / (vocab - 1)))


def test_head_direction_is_the_autograd_gradient_at_the_lm_head_input():
    g = torch.Generator().manual_seed(2)
    n, h, vocab, temp = 9, 6, 13, 0.7
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64)
    x = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (n,), generator=g)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(x @ weight.T / temp, -1).gather(-1, target[:, None]).squeeze(-1)
    (grad,) = torch.autograd.grad((w * logp).sum(), x)  # dL/dlog pi_t = w_t
    shard = HeadShard(weight, None, 0, vocab)
    q = head_quantities(head_partial(x.detach(), shard, target, temp, rows=4), temp)
    pred = q.direction * w.unsqueeze(-1)  # dL/dh = w W^T (e_o - pi) / T
    assert float(B.relative_error(grad, pred).max()) < 1e-12
    pi = torch.softmax(x.detach() @ weight.T / temp, -1)
    ratio = grad.norm(dim=-1) / (w.abs() * (1 - pi.gather(-1, target[:, None]).squeeze(-1)))
    sigma = float(torch.linalg.matrix_norm(weight, ord=2))
    assert bool((ratio <= B.head_upper_bound(sigma, temp) * (1 + 1e-12)).all())


def test_bound_ratio_undefined_where_denominator_is_zero():
    r = B.bound_ratio(
        torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.0])
    )
    assert r[0] == 1.0 and math.isnan(r[1]) and math.isnan(r[2])


def test_rankdata_and_spearman():
    assert B.rankdata(torch.tensor([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert B.spearman(x, x**3) == pytest.approx(1.0)
    assert B.spearman(x, -x) == pytest.approx(-1.0)
    assert B.spearman(x, torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])) == pytest.approx(0.8)  # 1 - 6*4/(5*24)
    assert math.isnan(B.spearman(x[:2], x[:2]))
    assert math.isnan(B.spearman(x, torch.ones(5)))


# ---- statistics ---------------------------------------------------------------------------------------------
def test_binstats_match_direct_computation_with_empty_bins_and_nonfinite():
    g = torch.Generator().manual_seed(4)
    values = torch.rand(2, 50, generator=g, dtype=torch.float32) * 3
    values[1, 7] = float("inf")
    bins = torch.randint(0, 2, (50,), generator=g)  # bin 2 of 3 stays empty
    valid = torch.rand(50, generator=g) > 0.2
    stats = BinStats(2, 3)
    stats.update("norm", values, bins, valid)
    s = stats.summary("norm")
    for p in range(2):
        for b in range(2):
            sel = valid & (bins == b) & torch.isfinite(values[p])
            v = values[p][sel].double()
            assert s["count"][p, b] == sel.sum()
            assert float(s["sum"][p, b]) == pytest.approx(float(v.sum()), rel=1e-12)
            assert float(s["sumsq"][p, b]) == pytest.approx(float((v * v).sum()), rel=1e-12)
            assert float(s["min"][p, b]) == float(v.min()) and float(s["max"][p, b]) == float(v.max())
            assert float(s["hist"][p, b].sum()) == float(sel.sum())
        assert s["count"][p, 2] == 0 and math.isnan(s["min"][p, 2]) and math.isnan(s["max"][p, 2])
    assert s["nonfinite"].sum() == int(bool(valid[7]))
    assert s["sum"].dtype == torch.float64


def test_log_histogram_cells():
    h = LogHistogram(lo=-2, hi=2, per_decade=1)
    cells = h.cell(torch.tensor([0.0, 1e-3, 0.01, 0.5, 1.0, 99.0, 100.0, 1e9]))
    assert cells.tolist() == [0, 0, 1, 2, 3, 4, 5, 5]
    assert h.bounds(0) == (0.0, 0.01) and h.bounds(3) == (1.0, 10.0) and h.bounds(5)[1] == math.inf


def test_bottom_k_sample_draws_only_valid_positions_without_repeats():
    valid = torch.zeros(6, 5, dtype=torch.bool)
    valid[:, :3] = True
    idx, ok = bottom_k_sample(valid, 10, torch.Generator().manual_seed(0))
    assert idx.shape == (10,) and bool(ok.all())
    assert bool(valid.reshape(-1)[idx].all()) and len(set(idx.tolist())) == 10
    idx, ok = bottom_k_sample(valid, 25, torch.Generator().manual_seed(0))  # more than the 18 valid
    assert int(ok.sum()) == 18 and bool(valid.reshape(-1)[idx[ok]].all()) and not bool(ok[18:].any())


def test_row_slots_put_tokens_of_one_row_in_distinct_backward_slots():
    assert row_slots(torch.tensor([3, 1, 3, 3, 0, 1])).tolist() == [0, 0, 1, 2, 0, 1]
