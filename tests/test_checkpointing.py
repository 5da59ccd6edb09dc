"""Activation checkpointing of every kind gives the statistics of the same step without checkpointing.

Kinds: Hugging Face gradient checkpointing (reentrant and not), torch's `checkpoint_wrapper` (reentrant and not),
the probe attached after the wrapping and before it (then its hooks sit inside the checkpoint: with reentrant
checkpointing the forward runs under no_grad and the gradient is read from the recomputation in the backward).
The direct gradients come from the layer replay (`tokendyn.probe.replay`) with and without checkpointing; the plain
step's are checked against one plain backward per token (`_models.single_token_direct`), the others against it.
A point that still receives no gradient is an error in the records and in `tokendyn analyze`, never a zero."""

from __future__ import annotations

import functools
import warnings

import polars as pl
import pytest
import torch
from _models import completion_logps, grpo_loss, make_batch, single_token_direct, tiny_gpt2, tiny_qwen2

from tokendyn.probe import GradientProbe

T = 0.7
KINDS = [
    "hf_reentrant",
    "hf",
    "wrapper_reentrant",
    "wrapper",
    "wrapper_reentrant_probe_first",
    "wrapper_probe_first",
]


def _checkpoint(model, kind: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if kind.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": kind == "hf_reentrant"}
        )
        return
    impl = CheckpointImpl.REENTRANT if "reentrant" in kind else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: type(m).__name__ in ("Qwen2DecoderLayer", "GPT2Block"),
    )


def _dropout_gpt2():
    """GPT-2 with dropout 0.1 everywhere (training mode): the replay must repeat the forward's masks."""
    model = tiny_gpt2()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    return model


def _step(kind: str | None, sink=None, autocast: bool = False, make_model=None, direct_tokens: int = 32):
    """One probed GRPO micro-step of the same model and batch, checkpointed as `kind` (None: not at all), under
    bfloat16 autocast if asked; returns (records, batch, the RNG state the forward started from)."""
    model = make_model() if make_model else tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=4)
    probe_first = kind is not None and kind.endswith("probe_first")
    make = functools.partial(
        GradientProbe,
        direct_tokens=direct_tokens,
        direct_budget=None,
        check_tokens=None,
        temperature=T,
        auto=True,
        sink=sink,
    )
    probe = make(model) if probe_first else None
    if kind is not None:
        _checkpoint(model, kind)
    probe = probe or make(model)
    with probe, warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the probe must not warn (nor switch anything off)
        warnings.filterwarnings("ignore", message=".*use_cache.*")
        rng = torch.get_rng_state()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logps = completion_logps(out.logits, batch, T)
        old = (logps.detach() - 0.05 * (batch.completion_ids % 3)).clamp(max=0)
        probe.begin_step(
            step=0,
            completion_mask=batch.completion_mask,
            advantages=batch.advantages,
            old_logp=old,
            completion_ids=batch.completion_ids,
            logps=logps,
            temperature=T,
        )
        grpo_loss(logps, old, batch.advantages, batch.completion_mask).backward()
        result = probe.end_step()
    return {k: pl.DataFrame(v) for k, v in result.records.items()}, batch, rng


@pytest.fixture(scope="module")
def reference():
    return _step(None)[0]


def test_the_plain_step_s_direct_gradients_are_single_token_backwards(reference):
    tok = reference["tokens"].to_dict(as_series=False)
    _, batch, _ = _step(None)
    expected = single_token_direct(tiny_qwen2(sharpen=30.0), batch, tok, T)
    got = tok["direct_norm"]
    n_tokens = len(set(zip(tok["row"], tok["pos"], strict=True)))  # every completion token (fewer than 32)
    assert sum(v is not None for v in got) == 3 * n_tokens > 0
    assert [v is None for v in got] == [v is None for v in expected]
    assert [v for v in got if v is not None] == pytest.approx(
        [v for v in expected if v is not None], rel=1e-5
    )


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointed_step_records_the_plain_step(reference, kind):
    got = _step(kind)[0]
    ref_bins, bins = (
        r["binstats"].sort("point", "quantity", "bin").select("count", "sum", "min", "max")
        for r in (reference, got)
    )
    assert bins["count"].to_list() == ref_bins["count"].to_list() and ref_bins["count"].sum() > 0
    for col in ("sum", "min", "max"):
        assert bins[col].to_list() == pytest.approx(ref_bins[col].to_list(), rel=1e-5, nan_ok=True), col
    cols = [
        "point",
        "n",
        "ratio_min",
        "ratio_max",
        "direct_n",
        "direct_ratio_min",
        "direct_ratio_max",
        "unreached",
    ]
    ref_bound, bound = (r["bound"].sort("point").select(cols) for r in (reference, got))
    assert bound["direct_n"].to_list() == ref_bound["direct_n"].to_list() and min(bound["direct_n"]) > 0
    assert bound["unreached"].to_list() == [0, 0, 0]
    for col in cols[1:]:
        assert bound[col].to_list() == pytest.approx(ref_bound[col].to_list(), rel=1e-5), col
    # every sampled token's direct gradient at every point, replayed or live, equals the plain model's
    key = ["row", "pos", "point"]
    joined = reference["tokens"].join(got["tokens"], on=key, suffix="_ckpt")
    assert joined.height == reference["tokens"].height and joined["direct_norm"].null_count() < joined.height
    assert joined["direct_norm_ckpt"].to_list() == pytest.approx(
        joined["direct_norm"].to_list(), rel=1e-5, nan_ok=True
    )


def _against_single_token_backwards(records, batch, model, rng=None, autocast=False, rel=1e-5) -> float:
    """Max relative difference of the records' direct norms from one plain backward per token on `model` (its
    forward from RNG state `rng`, so dropout draws the probed forward's masks; under bfloat16 autocast if asked)."""
    tok = records["tokens"].to_dict(as_series=False)
    if rng is not None:
        torch.set_rng_state(rng)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = single_token_direct(model, batch, tok, T)
    pairs = [(g, e) for g, e in zip(tok["direct_norm"], expected, strict=True) if g is not None]
    assert pairs and all(e is not None for _, e in pairs)
    return max(abs(g - e) / max(abs(e), 1e-30) for g, e in pairs)


def test_the_layer_replay_runs_under_the_forward_s_autocast():
    """bfloat16 autocast, plain and reentrant-checkpointed: the replayed direct gradients equal one bfloat16 plain
    backward per token, which they would not if the replay ran in float32."""
    for kind in (None, "wrapper_reentrant"):
        rec, batch, _ = _step(kind, autocast=True)
        err = _against_single_token_backwards(rec, batch, tiny_qwen2(sharpen=30.0), autocast=True)
        assert err < 1e-2, (kind, err)


def test_a_replayed_module_runs_under_the_autocast_it_was_recorded_under():
    from tokendyn.probe.replay import LayerCall, _run

    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = LayerCall.record("layers.0.out", layer, (x,), {})
    outside = LayerCall.record("layers.0.out", layer, (x,), {})
    assert _run(under, x).dtype == torch.bfloat16 and _run(outside, x).dtype == torch.float32


def test_the_layer_replay_repeats_the_forward_s_dropout_masks():
    """GPT-2, dropout 0.1, 3 direct tokens over 4 rows (a row without tokens: the replay must still run every row,
    or the rows would draw other rows' masks): replayed direct gradients equal one plain backward per token with
    the forward's masks, plain and reentrant-checkpointed."""
    for kind in (None, "wrapper_reentrant"):
        rec, batch, rng = _step(kind, make_model=_dropout_gpt2, direct_tokens=3)
        rows = set(rec["tokens"].drop_nulls("direct_norm")["row"].to_list())
        assert 0 < len(rows) < 4
        err = _against_single_token_backwards(rec, batch, _dropout_gpt2(), rng=rng)
        assert err < 1e-5, (kind, err)


def test_a_point_without_gradient_is_an_error_in_the_records_and_in_analyze(tmp_path, capsys):
    """A layer frozen by a forward hook that detaches its output (nothing reaches it in the backward)."""
    from tokendyn.cli import main
    from tokendyn.records import RecordWriter

    model = tiny_qwen2(sharpen=30.0)
    batch = make_batch(model, n=4)
    model.model.layers[0].register_forward_hook(lambda m, a, out: out.detach())
    writer = RecordWriter(tmp_path)
    probe = GradientProbe(model, direct_tokens=0, temperature=T, auto=True, sink=writer.add)
    with probe, pytest.warns(UserWarning, match="no gradient reached layers.0.out"):
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logps = completion_logps(out.logits, batch, T)
        probe.begin_step(step=0, completion_mask=batch.completion_mask, advantages=batch.advantages,
                     completion_ids=batch.completion_ids, logps=logps, temperature=T)  # fmt: skip
        grpo_loss(logps, logps.detach(), batch.advantages, batch.completion_mask).backward()
        probe.end_step()
    writer.flush()
    bound = pl.DataFrame(probe.last.records["bound"]).sort("point")
    assert bound["unreached"].to_list() == [
        0,
        int(batch.completion_mask.sum()),
        0,
    ]  # final, layers.0, layers.1
    assert main(["analyze", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "layers.0.out recorded nothing" in captured.out and "recorded nothing" in captured.err


def test_trl_trainer_with_reentrant_gradient_checkpointing_records_the_plain_run(tiny_model_dir, tmp_path):
    """The TRL loop (fused LM head, HF gradient checkpointing use_reentrant=True): every point recorded, direct
    gradients by replay, the bound report equal to the same run without checkpointing."""
    from test_trainer import _config, _trainer

    from tokendyn.analysis import analyze_run

    reports = {}
    for name, kw in (
        ("plain", {"gradient_checkpointing": False}),
        ("reentrant", {"gradient_checkpointing_kwargs": {"use_reentrant": True}}),
    ):
        args = _config(tmp_path / name, max_steps=1, probe_every=1, probe_analyses="none", **kw)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="probe:.*")
            _trainer(tiny_model_dir, args).train()
        reports[name] = analyze_run(tmp_path / name / "run", write=False)["bound"]
    plain, ckpt = reports["plain"], reports["reentrant"]
    assert ckpt["unreached"].sum() == 0 and min(ckpt["direct_n"]) > 0
    assert ckpt["direct_n"].to_list() == plain["direct_n"].to_list()
    for col in ("n", "C", "D", "ratio_mean", "C_direct", "D_direct"):
        assert ckpt[col].to_list() == pytest.approx(plain[col].to_list(), rel=1e-6), col


def test_analyses_under_checkpointing_run_no_dropout_and_draw_nothing_from_the_rng():
    """OPT applies its decoder layers' dropout in their own ``forward`` and draws its layer drop from torch's RNG
    whenever its decoder is flagged training; Hugging Face's checkpointing flags both. The analyses under
    checkpointing keep every module in eval mode (the layers checkpointed by their wrapped ``forward``): their numbers
    equal the unchecked analyses' bit for bit, torch's RNG is left as it was, and the layers are left as they were."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _matrix import build

    from tokendyn.effects.rebalance import RebalanceOptions, analyze_batch
    from tokendyn.probe.forward import checkpointed_layers
    from tokendyn.probe.tokenloss import ProbeBatch

    model = build("opt_pre", dropout=0.1).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (3, 12), generator=g)
    batch = ProbeBatch(
        ids, torch.ones_like(ids), torch.ones(3, 6), torch.tensor([1.0, -0.5, 0.3]), temperature=T
    )
    options = RebalanceOptions(token_shares=0, view_sequences=0, lr=1e-2)
    plain = analyze_batch(model, batch, step=0, options=options)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = checkpointed_layers(model)
    assert [type(m).__name__ for m in layers] == [
        "OPTDecoderLayer"
    ] * 2  # (the decoder is flagged too: not a layer)
    state = torch.get_rng_state()
    checked = analyze_batch(model, batch, step=0, options=options)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(m.training and "forward" not in m.__dict__ for m in layers)
    for kind, frame in plain.items():
        assert frame.equals(checked[kind]), kind


def test_the_analyses_keep_checkpointing_each_layer_and_a_nested_jvp_pass_is_left_unwrapped(monkeypatch):
    """Under `eval_mode` every checkpointed layer's forward goes through torch's checkpoint (counted: 2 layers, one
    call each per forward); a nested ``eval_mode(checkpoint=False)`` (the JVP passes) takes the wrappers off for its
    duration and puts them back; both exits restore the model."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _matrix import build

    from tokendyn.probe.forward import eval_mode

    model = build("opt_pre", dropout=0.1).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with eval_mode(model):
        model(input_ids=ids)
        assert len(calls) == 2
        with eval_mode(model, checkpoint=False):
            model(input_ids=ids)
            assert len(calls) == 2  # nothing checkpointed inside
        model(input_ids=ids)
        assert len(calls) == 4  # the wrappers back
    layers = model.model.decoder.layers
    assert all(m.training and "forward" not in m.__dict__ for m in layers)


def test_a_model_that_checkpoints_inside_its_own_loop_has_its_blocks_checkpointed():
    """Older models and remote code flag only the parent and checkpoint inside its loop over the blocks: the analyses
    checkpoint those blocks one by one (wrapping the parent whole would hold every block's activations at once)."""
    from tokendyn.probe.forward import checkpointed_layers

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x))

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gradient_checkpointing = True
            self.layers = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    model = torch.nn.Sequential(Parent())
    assert checkpointed_layers(model) == list(model[0].layers)
