"""Loud, not silent: every condition that switches a check off warns once and is written to the run's records (kind
``notes``), and `tokendyn analyze` names it. Conditions: a scaled LM head, a backbone with no final norm before
the head that the probe recognises, ``final_norm.out`` left out of the probed points, a step without completion ids."""

from __future__ import annotations

import warnings

import polars as pl
import pytest
import torch
from _models import make_batch, tiny_qwen2
from transformers import OPTConfig, OPTForCausalLM

from tokendyn import GradientProbe, instrument, load_run
from tokendyn.cli import main


def _loop(model, run_dir, steps: int = 2, ids: bool = True, **options) -> list[warnings.WarningMessage]:
    """``steps`` probed steps of a plain loop; returns the probe's warnings."""
    batch = make_batch(model, n=2, sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with instrument(model, run_dir, rank=0, check_tokens=None, **options) as probe:
            for step in range(steps):
                out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
                z = out.logits[:, -batch.c - 1 : -1].float()
                logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
                probe.begin_step(
                    step=step,
                    completion_mask=batch.completion_mask,
                    advantages=batch.advantages,
                    completion_ids=batch.completion_ids if ids else None,
                    logps=logps,
                )
                (-(logps * batch.advantages.unsqueeze(1) * batch.completion_mask).sum()).backward()
                probe.end_step()
    return [w for w in caught if str(w.message).startswith("probe: ")]


def _notes(run_dir) -> pl.DataFrame:
    return load_run(run_dir)["notes"].collect()


def _analyze(run_dir, capsys) -> str:
    assert main(["analyze", str(run_dir)]) == 0
    return capsys.readouterr().out


def test_a_scaled_head_warns_once_and_is_recorded(tmp_path, capsys):
    model = tiny_qwen2()
    model.config.logit_scale = 0.5  # a config that says the logits are scaled (Cohere-style)
    caught = _loop(model, tmp_path, steps=3)
    assert len(caught) == 1 and "scaled LM head" in str(caught[0].message)
    notes = _notes(tmp_path)
    assert notes["code"].to_list() == ["head_transform"] and notes["step"].to_list() == [None]
    assert load_run(tmp_path)["checks"].collect().height == 0  # the checks are indeed off
    assert "note: head_transform" in _analyze(tmp_path, capsys)


def _post_ln_opt() -> OPTForCausalLM:
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, do_layer_norm_before=False, dropout=0.0, pad_token_id=0)  # fmt: skip
    return OPTForCausalLM(cfg)


def test_a_post_ln_backbone_is_checked_at_its_last_layer(tmp_path):
    """Post-LN OPT has no final norm: its last layer's output is the LM head's input, and the checks run there."""
    assert _loop(_post_ln_opt(), tmp_path) == []
    checks = load_run(tmp_path)["checks"].collect()
    assert checks.height == 2 and checks["identity_violations"].sum() == 0
    assert float(checks["identity_max_rel_err"].max()) < 1e-5


def test_a_backbone_without_a_known_head_input_warns_and_is_recorded(tmp_path, capsys):
    model = _post_ln_opt()
    # the config no longer says that the last layer's output feeds the head (bypassing the config's own validation)
    object.__setattr__(model.config, "do_layer_norm_before", None)
    caught = _loop(model, tmp_path)
    assert [str(w.message).split(":")[1].strip()[:3] for w in caught] == ["OPT"]
    assert _notes(tmp_path)["code"].to_list() == ["no_final_norm"]
    assert "note: no_final_norm" in _analyze(tmp_path, capsys)


def test_leaving_out_the_final_norm_is_noted(tmp_path):
    caught = _loop(tiny_qwen2(), tmp_path, points="layers.*.out")
    assert len(caught) == 1
    assert _notes(tmp_path)["code"].to_list() == ["final_norm_not_probed"]


def test_a_step_without_completion_ids_is_noted_once_with_its_step(tmp_path, capsys):
    caught = _loop(tiny_qwen2(), tmp_path, steps=3, ids=False)
    assert len(caught) == 1 and "without completion_ids" in str(caught[0].message)
    notes = _notes(tmp_path)
    assert notes.select("code", "step").rows() == [("no_completion_ids", 0)]
    assert "note: no_completion_ids (from step 0)" in _analyze(tmp_path, capsys)


def test_a_clean_run_has_no_notes(tmp_path):
    assert _loop(tiny_qwen2(), tmp_path) == []
    assert "notes" not in load_run(tmp_path).kinds


def test_a_soft_cap_the_forward_does_not_apply_is_not_modelled(tmp_path):
    """A Qwen2 config carrying `final_logit_softcapping` (Qwen2's forward ignores it): logits stay affine, the
    checks run without the cap and hold."""
    model = tiny_qwen2()
    model.config.final_logit_softcapping = 30.0
    assert _loop(model, tmp_path) == []
    assert load_run(tmp_path)["checks"].collect()["identity_violations"].sum() == 0


def test_notes_without_a_sink_stay_on_the_probe():
    model = tiny_qwen2()
    model.config.logit_scale = 0.5
    with pytest.warns(UserWarning, match="scaled LM head"):
        probe = GradientProbe(model)
    assert probe.notes == ["head_transform"]
