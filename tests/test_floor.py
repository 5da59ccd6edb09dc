"""The noise floor (`floor` records): at a probed step's first micro-batch the trainer's log-probs of its first
`FLOOR_ROWS` rows' tokens recomputed in two halves, each cut after its own longest completion, beside the forward the
loss used. Both columns against a plain full-logits forward of the starting model on the first micro-batch (no update
yet), log rho their difference, weight 1 (with 5 of the micro-batch's 8 rows: halves of 3 and 2); off with
``probe_floor=False``."""

from __future__ import annotations

import polars as pl
import torch
from test_trainer import _completion_logps, _config, _trainer
from transformers import AutoModelForCausalLM

from tokendyn import TokendynGRPOTrainer

torch.set_num_threads(1)


class FirstInputs(TokendynGRPOTrainer):
    """Keeps the first training micro-batch's loss inputs (``first_inputs``), as the loss received them."""

    def _compute_loss(self, model, inputs):
        if model.training and "first_inputs" not in self.__dict__:
            self.first_inputs = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()
            }
        return super()._compute_loss(model, inputs)


def test_floor_records_are_the_trainers_logprobs_in_two_splits(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("tokendyn.hooks.sampler.FLOOR_ROWS", 5)
    args = _config(tmp_path, max_steps=1, probe_every=1, probe_analyses="none")
    trainer = _trainer(tiny_model_dir, args, cls=FirstInputs)
    trainer.train()
    inputs = trainer.first_inputs
    records = pl.read_parquet(sorted((tmp_path / "run" / "records").glob("floor-*.parquet")))
    assert set(records["micro"].unique()) == {0}  # a probed step's first micro-batch (of 2)
    first = records.filter((pl.col("step") == 0) & (pl.col("micro") == 0)).sort("row", "pos")
    assert inputs["completion_mask"].size(0) == 8
    inputs = {k: v[:5] if torch.is_tensor(v) and v.dim() == 2 else v for k, v in inputs.items()}
    mask = inputs["completion_mask"].bool()
    assert first.height == int(mask.sum())
    rows, pos = mask.nonzero(as_tuple=True)
    assert first["row"].to_list() == rows.tolist() and first["pos"].to_list() == pos.tolist()
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        plain = _completion_logps(start, inputs)[mask].double()
    for column in ("logp_old", "logp_sampler"):
        assert (torch.tensor(first[column].to_list()) - plain).abs().max() < 1e-5, column
    assert first["log_rho"].to_list() == (first["logp_old"] - first["logp_sampler"]).to_list()
    assert first["is_weight"].to_list() == [1.0] * first.height and not first["seq_masked"].any()


def test_probe_floor_false_records_none(tiny_model_dir, tmp_path):
    args = _config(tmp_path, max_steps=1, probe_every=1, probe_analyses="none", probe_floor=False)
    _trainer(tiny_model_dir, args).train()
    records = tmp_path / "run" / "records"
    assert list(records.glob("binstats-*.parquet")) and not list(records.glob("floor-*.parquet"))
