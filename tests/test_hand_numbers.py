"""Numbers worked out by hand on a one-layer model with a three-token vocabulary (as captum's layer-attribution tests
check constants): the per-token gradient norms at both probe points, the bound ratios, the per-bin update shares,
and the same norms under DistributedDataParallel on two processes (each process's gradient / 2).

The model, position-wise (no attention, so a position's output depends on its own input token only):

    h0 = E[x]            (embedding, d = 2)
    h1 = h0 + A h0       (the one layer; A = 0, so h1 = h0; probe point layers.0.out)
    hf = 2 h1            (the "final norm", a fixed scale; probe point final_norm.out)
    z  = hf W^T,  W = [[1, 0], [0, 1], [0, 0]]  (V = 3, T = 1)

with E[0] = (ln 2 / 2, 0), E[1] = (0, 0), E[2] = (ln 3 / 2, ln 2 / 2), so that z = (ln 2, 0, 0), (0, 0, 0) and
(ln 3, ln 2, 0): pi = (1/2, 1/4, 1/4), (1/3, 1/3, 1/3) and (1/2, 1/3, 1/6). The sequence is [0, 1, 2, 0]: prompt
token 0, completion o = (1, 2, 0) predicted from positions 0, 1, 2, so pi_t(o_t) = 1/4, 1/3, 1/2.

Loss L = -sum_t A_t log pi_t with A = (1, -2, 1/2): w_t = dL/dlog pi_t = -A_t, |w| = (1, 2, 1/2).
At the LM head input dL/dhf = w_t W^T (e_o - pi) (d log softmax(z)_o / dz = e_o - pi), and W^T keeps the first two
components: e_o - pi = (-1/2, 3/4, -1/4), (-1/3, -1/3, 2/3), (1/2, -1/3, -1/6), so

    ||dL/dhf|| = 1 * sqrt(1/4 + 9/16) = sqrt(13)/4,   2 * sqrt(1/9 + 1/9) = 2 sqrt(2)/3,   1/2 * sqrt(1/4 + 1/9) = sqrt(13)/12
    ||dL/dh1|| = 2 ||dL/dhf||                       (hf = 2 h1)
    ratio      = ||dL/dhf|| / (|w| (1 - pi))         = sqrt(13)/3,  sqrt(2)/2,  sqrt(13)/3
"""

from __future__ import annotations

import math
import os
import tempfile
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from torch import nn

from tokendyn import GradientProbe, ProbeBatch, instrument, load_run
from tokendyn.effects.shares import gradient_shares
from tokendyn.probe.tokenloss import Objective

LN2, LN3 = math.log(2.0), math.log(3.0)
SEQ = [0, 1, 2, 0]
COMPLETION = [1, 2, 0]
ADV = [1.0, -2.0, 0.5]
PI = [1 / 4, 1 / 3, 1 / 2]
W_ABS = [1.0, 2.0, 0.5]
FINAL = [
    math.sqrt(13) / 4,
    2 * math.sqrt(2) / 3,
    math.sqrt(13) / 12,
]  # ||dL/dhf||, by hand (module docstring)
LAYER = [2 * x for x in FINAL]  # ||dL/dh1||
RATIO = [math.sqrt(13) / 3, math.sqrt(2) / 2, math.sqrt(13) / 3]


class Scale(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, h):
        return self.s * h


class Block(nn.Module):
    """h + A h with A = 0 (a real linear map in the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2, bias=False)
        nn.init.zeros_(self.a.weight)

    def forward(self, h):
        return h + self.a(h)


class HandModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(3, 2)
        self.layers = nn.ModuleList([Block()])
        self.norm = Scale(2.0)
        self.lm_head = nn.Linear(2, 3, bias=False)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.tensor([[LN2 / 2, 0.0], [0.0, 0.0], [LN3 / 2, LN2 / 2]]))
            self.lm_head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        return SimpleNamespace(logits=self.lm_head(self.norm(h)))


def _step(model, probe, seq=SEQ) -> None:
    ids = torch.tensor([seq])
    logits = model(ids).logits[:, :-1]  # positions 0..2 predict the completion
    completion = ids[:, 1:]
    logps = torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0]
    probe.begin_step(
        step=0,
        completion_mask=torch.ones_like(completion, dtype=torch.bool),
        advantages=torch.tensor([ADV]),
        completion_ids=completion,
        logps=logps,
    )
    (-(torch.tensor([ADV]) * logps).sum()).backward()
    probe.end_step()


def _tokens(run_dir) -> pl.DataFrame:
    return load_run(run_dir)["tokens"].sort("point", "pos").collect()


def test_the_model_gives_the_hand_probabilities():
    model = HandModel()
    probs = torch.softmax(model(torch.tensor([SEQ])).logits[0, :-1], -1)
    want = [1 / 2, 1 / 4, 1 / 4, 1 / 3, 1 / 3, 1 / 3, 1 / 2, 1 / 3, 1 / 6]
    assert probs.flatten().tolist() == pytest.approx(want, rel=1e-6)


def test_norms_ratios_and_bins_by_hand(tmp_path):
    model = HandModel()
    with instrument(model, tmp_path, check_tokens=None, direct_budget=None, rank=0) as probe:
        _step(model, probe)
    tokens = _tokens(tmp_path)
    final = tokens.filter(pl.col("point") == "final_norm.out")
    layer = tokens.filter(pl.col("point") == "layers.0.out")
    assert final["pos"].to_list() == [0, 1, 2]
    assert final["pi"].to_list() == pytest.approx(PI, rel=1e-6)
    assert final["w"].abs().to_list() == pytest.approx(W_ABS, rel=1e-6)
    assert final["norm"].to_list() == pytest.approx(FINAL, rel=1e-6)
    assert layer["norm"].to_list() == pytest.approx(LAYER, rel=1e-6)
    assert final["ratio"].to_list() == pytest.approx(RATIO, rel=1e-6)
    # position-wise model: a token's own ("direct") gradient is the whole gradient
    assert final["direct_norm"].to_list() == pytest.approx(FINAL, rel=1e-6)

    # binstats with bins [0, .3), [.3, .4), [.4, 1] (no pi on an edge): one token per bin, pi_old = pi (on-policy)
    bins = tmp_path / "bins"
    model = HandModel()
    with instrument(
        model, bins, bins=[0.0, 0.3, 0.4, 1.0], check_tokens=None, direct_budget=None, rank=0
    ) as probe:
        _step(model, probe)
    bs = load_run(bins)["binstats"].filter(pl.col("quantity") == "norm").collect()
    for point, want in (("final_norm.out", FINAL), ("layers.0.out", LAYER)):
        rows = bs.filter(pl.col("point") == point).sort("bin")
        assert rows["count"].to_list() == [1, 1, 1]
        assert rows["sum"].to_list() == pytest.approx(want, rel=1e-6)
        assert rows["sumsq"].to_list() == pytest.approx([x * x for x in want], rel=1e-6)


def test_update_shares_by_hand():
    """Only the LM head trains: g_t = dl_t/dW = -A_t (e_o - pi) hf^T / N, hf = (ln 2, 0), (0, 0), (ln 3, ln 2).
    Token 2 (hf = 0) sends no gradient to W. Bins [0, .3), [.3, .4), [.4, 1]: one token each, g_b = G_t; the
    normaliser N = 3 cancels in the shares."""
    model = HandModel()
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    # G_t[v][k] = -A_t (e_o - pi)_v hf_k
    g1 = [[-ADV[0] * e * h for h in (LN2, 0.0)] for e in (-1 / 2, 3 / 4, -1 / 4)]
    g3 = [[-ADV[2] * e * h for h in (LN3, LN2)] for e in (1 / 2, -1 / 3, -1 / 6)]
    g = [[a + b for a, b in zip(r1, r3, strict=True)] for r1, r3 in zip(g1, g3, strict=True)]

    def dot(x, y):
        return sum(a * b for rx, ry in zip(x, y, strict=True) for a, b in zip(rx, ry, strict=True))

    want = [dot(g1, g) / dot(g, g), 0.0, dot(g3, g) / dot(g, g)]
    ids = torch.tensor([SEQ])
    batch = ProbeBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        completion_mask=torch.ones(1, 3, dtype=torch.bool),
        advantages=torch.tensor([ADV]),
        temperature=1.0,
    )
    res = gradient_shares(model, batch, [0.0, 0.3, 0.4, 1.0], objective=Objective(eps_low=0.2, eps_high=0.2))
    assert res.bins.share[:, 0].tolist() == pytest.approx(
        want, rel=1e-6, abs=1e-12
    )  # group "all": the LM head
    assert want[0] + want[2] == pytest.approx(1.0)
    assert res.bins.grad_norm[0, 0].item() == pytest.approx(
        math.sqrt(dot(g1, g1)) / 3, rel=1e-6
    )  # / N, N = 3
    assert res.bins.grad_norm[2, 0].item() == pytest.approx(math.sqrt(dot(g3, g3)) / 3, rel=1e-6)


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = HandModel()
        ddp = DistributedDataParallel(model)
        # every rank runs the same batch: DDP averages the two (equal) gradients, so the update is the gradient of
        # L = (L_0 + L_1) / 2, and each token's share of it is its own gradient / 2
        with instrument(ddp, out, check_tokens=None, direct_budget=None, rank=rank) as probe:
            _step(ddp, probe)
    finally:
        dist.destroy_process_group()


def test_ddp_records_each_process_gradient_divided_by_two(tmp_path):
    fd, init_file = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    os.unlink(init_file)
    torch.multiprocessing.spawn(_ddp_worker, args=(init_file, str(tmp_path / "run")), nprocs=2, join=True)
    tokens = _tokens(tmp_path / "run")
    for rank in (0, 1):
        mine = tokens.filter(pl.col("rank") == rank)
        final = mine.filter(pl.col("point") == "final_norm.out")
        assert final["norm"].to_list() == pytest.approx([x / 2 for x in FINAL], rel=1e-6)
        assert mine.filter(pl.col("point") == "layers.0.out")["norm"].to_list() == pytest.approx(
            [x / 2 for x in LAYER], rel=1e-6
        )
        assert final["w"].abs().to_list() == pytest.approx([x / 2 for x in W_ABS], rel=1e-6)
        # the ratio divides by |w|: the halving cancels
        assert final["ratio"].to_list() == pytest.approx(RATIO, rel=1e-6)


def test_the_probe_is_built_by_gradient_probe_too():
    probe = GradientProbe(HandModel(), points="final_norm.out", sigma_every=3, direct_memory_mb=None)
    assert probe.point_names == ["final_norm.out"]
    assert probe.sigma_every == 3 and probe.direct_memory_mb is None
