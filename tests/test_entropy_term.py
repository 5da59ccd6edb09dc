"""An entropy bonus in a custom loop: the probe told of the entropies (``begin_step(entropy=...)``) predicts their
gradient in the LM-head identity; a probe not told of them sees an identity that fails, so the check can fail."""

from __future__ import annotations

import pytest
import torch
from _matrix import Cell, autocast, build, sample_batch, surrogate

from tokendyn import instrument, load_run

torch.set_num_threads(1)


def _run(tmp_path, coef: float, tell: bool, dtype: str = "float32"):
    model = build("llama")
    batch = sample_batch(model)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    n = int(batch.completion_mask.sum())
    with instrument(model, tmp_path, rank=0, temperature=0.7, check_tokens=None, direct_tokens=0) as probe:
        with autocast(Cell("llama", dtype, "full", "one", "probe")):
            logits = model(input_ids=batch.input_ids).logits[:, 4:-1].float() / 0.7
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        probe.begin_step(step=0, completion_mask=batch.completion_mask, advantages=batch.advantages,
                         old_logp=batch.old_logp, completion_ids=batch.completion_ids, logps=logp,
                         temperature=0.7, **({"entropy": entropy} if tell else {}))  # fmt: skip
        bonus = (entropy * batch.completion_mask).sum() / n
        (surrogate(logp, batch, n) - coef * bonus).backward()
    return load_run(tmp_path)["checks"].collect()


@pytest.mark.parametrize("dtype", ["float32", "bf16_autocast", "bf16"])
@pytest.mark.parametrize("coef", [0.01, 0.1, 1.0])
def test_the_identity_holds_with_an_entropy_bonus(tmp_path, coef, dtype):
    checks = _run(tmp_path, coef, tell=True, dtype=dtype)
    scaled = float(checks["identity_max_scaled_err"].max())
    print(
        f"coef {coef} {dtype}: scaled identity error {scaled:.2g}, rel {float(checks['identity_max_rel_err'].max()):.2g}"
    )
    assert checks["entropy_term"].all() and int(checks["identity_violations"].sum()) == 0
    assert int(checks["head_violations"].sum()) == 0 and int(checks["logits_violations"].sum()) == 0
    if dtype == "float32":
        assert scaled < 1e-6


def test_an_entropy_bonus_the_probe_is_not_told_of_fails_the_identity(tmp_path):
    checks = _run(tmp_path, 1.0, tell=False)
    assert not checks["entropy_term"].any() and int(checks["identity_violations"].sum()) > 0
    assert float(checks["identity_max_scaled_err"].max()) > 1e-3
