"""The LM-head checks' cost at real vocabulary sizes (docs/results.md, "The probe's cost at a real vocabulary"):
sigma_max from the H x H Gram matrix against torch.linalg.matrix_norm (also where power iteration crawls: a random
head's top singular values lie close together), and the number of passes over the head a probed step makes (one
per check, whatever the spectrum), counted on the real `HeadShard.chunks`."""

from __future__ import annotations

import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, tiny_qwen2

from tokendyn.probe import GradientProbe
from tokendyn.probe.head import HeadShard, gram, logits_identity_error, sigma_max_gram, sigma_max_power

torch.set_num_threads(1)
T = 0.7


def _true_sigma(weight: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(weight.detach().double(), ord=2))


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(500, 64, generator=torch.Generator().manual_seed(0)) + 0.5,  # a clear top singular value
        (torch.randn(500, 64, generator=torch.Generator().manual_seed(1)) + 0.5).to(torch.bfloat16),
        torch.randn(3000, 48, generator=torch.Generator().manual_seed(2))
        * 0.02,  # a random init: a small gap
        torch.zeros(7, 5),
    ],
    ids=["lm_like", "lm_like_bf16", "random_init", "zero"],
)
@pytest.mark.parametrize("rows", [None, 1, 37])
def test_gram_sigma_max_equals_the_matrix_norm_in_one_pass(weight, rows):
    shard = HeadShard(weight, None, 0, weight.shape[0])
    sigma, v = sigma_max_gram(shard, rows=rows)
    true = _true_sigma(weight)
    assert abs(sigma - true) <= 1e-12 * max(true, 1e-300)
    if true > 0:  # v is the top right singular vector: ||W v|| = sigma_max
        assert abs(float(torch.linalg.vector_norm(weight.double() @ v)) / true - 1) < 1e-12
        assert abs(float(torch.linalg.vector_norm(v)) - 1) < 1e-12


def test_power_iteration_needs_hundreds_of_passes_where_the_gram_needs_one():
    """The cost the Gram route removes: on a random head, power iteration from a cold start makes hundreds of
    passes over the head (each as costly as one Gram pass in memory traffic)."""
    weight = torch.randn(3000, 48, generator=torch.Generator().manual_seed(2)) * 0.02
    shard = HeadShard(weight, None, 0, weight.shape[0])
    _, _, iterations = sigma_max_power(shard)
    assert iterations > 100


def test_the_gram_of_row_shards_sums_to_the_whole_gram():
    """A vocabulary-sharded head: each rank's Gram over its rows, summed (the all-reduce `reduce` makes), is the
    whole head's Gram, and the eigensolver on the sum gives the whole head's sigma_max."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(61, 16, generator=g)
    parts = [gram(HeadShard(weight[a:b], None, a, 61), rows=5) for a, b in ((0, 20), (20, 45), (45, 61))]
    whole = gram(HeadShard(weight, None, 0, 61))
    torch.testing.assert_close(sum(parts), whole, rtol=1e-13, atol=1e-13)
    total = sum(parts)
    sigma, _ = sigma_max_gram(HeadShard(weight[:20], None, 0, 61), reduce=lambda t: total)
    assert abs(sigma / _true_sigma(weight) - 1) < 1e-12


def test_logits_identity_error_leaves_the_measured_gradient_alone():
    """The streamed identity works in place on its own buffers: a float64 gradient handed over as views of the
    caller's tensor comes back unchanged."""
    g = torch.Generator().manual_seed(5)
    vocab, hidden, k = 29, 8, 4
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    h = torch.randn(k, hidden, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (k,), generator=g)
    z = h @ weight.T / T
    lse = torch.logsumexp(z, -1)
    w = torch.randn(k, generator=g, dtype=torch.float64)
    grad = w[:, None] * (torch.nn.functional.one_hot(targets, vocab).double() - torch.softmax(z, -1)) / T
    kept = grad.clone()
    err = logits_identity_error(
        lambda a, b: grad[:, a:b], w, h, lse, HeadShard(weight, None, 0, vocab), targets, T, rows=6
    )
    assert torch.equal(grad, kept)
    assert float(err.max()) < 1e-12


def _count_passes(monkeypatch) -> dict[str, int]:
    """Chunks of the head streamed, by whoever streams them (the real `HeadShard.chunks`, counted)."""
    counts = {"chunks": 0}
    real = HeadShard.chunks

    def counted(self, rows):
        for item in real(self, rows):
            counts["chunks"] += 1
            yield item

    monkeypatch.setattr(HeadShard, "chunks", counted)
    return counts


def test_a_probed_step_streams_the_head_once_per_check_even_on_a_random_head(monkeypatch):
    """The first probed step of a fresh probe on a random (small-gap) head: head quantities, logits identity and
    the sigma_max refresh stream the head once each; the next step (no refresh) twice. Before the Gram route the
    first step streamed it hundreds of times (power iteration from a cold start)."""
    model = tiny_qwen2(vocab=3000, hidden=48)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(2))
    batch = make_batch(model, n=2, sample=False)
    counts = _count_passes(monkeypatch)
    rows = 300  # the chunk rows every pass uses: 3000 / 300 = 10 chunks per pass
    monkeypatch.setattr("tokendyn.probe.head.vocab_chunk_rows", lambda k, hidden, budget=0: rows)
    monkeypatch.setattr("tokendyn.probe.head.HEAD_CHUNK_BYTES", rows * 8 * 48)
    records = []
    # check_budget None: every micro-batch is checked (the budget would skip some of this head-heavy model's)
    with GradientProbe(
        model, direct_tokens=0, check_budget=None, temperature=T, auto=True, sink=records.append
    ) as probe:
        per_step = []
        for step in range(2):
            before = counts["chunks"]
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            logps = completion_logps(logits, batch, T)
            probe.begin_step(
                step=step,
                completion_mask=batch.completion_mask,
                advantages=batch.advantages,
                completion_ids=batch.completion_ids,
                logps=logps,
                temperature=T,
            )
            grpo_loss(logps, logps.detach(), batch.advantages, batch.completion_mask).backward()
            probe.end_step()
            per_step.append(counts["chunks"] - before)
    assert per_step == [30, 20], per_step
    checks = [r["checks"] for r in records]
    true = _true_sigma(model.lm_head.weight)
    assert abs(checks[0]["head_sigma_max"][0] / true - 1) < 1e-12
    assert checks[0]["identity_logits_max_rel_err"][0] < 1e-5
    assert all(c["head_violations"] == [0] and c["logits_violations"] == [0] for c in checks)


# ---- a vocabulary-sharded head (FSDP2), two processes -----------------------------------------------------------
def sharded_worker(out_dir: str) -> None:
    """torchrun worker (2 ranks, gloo): sigma_max of an FSDP2-sharded head (uneven rows) from the all-reduced Gram
    of each rank's rows, written per rank with the whole head's matrix norm for the parent to compare."""
    import json
    from pathlib import Path

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tokendyn.probe import parallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    head = nn.Linear(48, 301)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02)  # a random init: a small gap between the top singular values
    true = _true_sigma(head.weight)
    fully_shard(head, mesh=mesh)
    shard = parallel.head_shard(head)
    assert shard.group is not None and shard.weight.shape[0] < 301
    sigma, v = sigma_max_gram(shard, parallel.all_reduce_in(shard.group), rows=40)
    out = {"sigma": sigma, "true": true, "rows": int(shard.weight.shape[0]), "v": v.tolist()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow_tier  # the slow tier: `make test-slow` (several processes)
def test_sigma_max_of_a_sharded_head_is_the_whole_heads_on_every_rank(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, *"-m torch.distributed.run --standalone --nproc_per_node 2".split(), __file__]
    proc = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    got = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(p.is_file() for p in got), proc.stdout[-3000:] + proc.stderr[-3000:]
    a, b = (json.loads(p.read_text()) for p in got)
    assert a["rows"] + b["rows"] == 301
    assert a["sigma"] == b["sigma"] and a["v"] == b["v"]  # the same Gram on every rank, the same eigensolve
    assert abs(a["sigma"] / a["true"] - 1) < 1e-12


if __name__ == "__main__":
    sharded_worker(__import__("sys").argv[1])
