"""`tokendyn probe` reads a batch saved by verl itself: a `DataProto.save_to_disk` file (a pickle, read only with
--allow_pickle) or a tensordict directory (`DataProto.batch.memmap(DIR)`, read without unpickling anything).

The oracle is the token lists themselves: each test builds the rows first, then pads them into a real verl
DataProto (left-padded prompts, right-padded responses, junk values on the padding), so a converter that reads the
padding or misaligns a row disagrees with the lists it started from."""

from __future__ import annotations

import json
import os
import pickle
from contextlib import suppress
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from verl import DataProto

from tokendyn.cli import main
from tokendyn.hooks.rollouts import RolloutsError, read_rollouts
from tokendyn.hooks.rollouts_verl import SIDECAR, dataproto_table

torch.set_num_threads(1)

PAD = 63  # token ids < 64; the pad id is a real id, so only the masks tell padding apart
JUNK = 7.5  # the per-token values on padding: a converter that keeps padding gets a value no row has
T = 0.7
ROWS = [  # one dict per sequence, in the rollouts schema; uid groups of 2
    {"prompt_ids": [5, 6, 7], "completion_ids": [20, 21, 22, 23], "loss_mask": [1, 1, 0, 1], "group": "a"},
    {"prompt_ids": [8, 9], "completion_ids": [24, 25], "loss_mask": [1, 1], "group": "a"},
    {"prompt_ids": [10, 11, 12, 13], "completion_ids": [26], "loss_mask": [1], "group": "b"},
    {"prompt_ids": [14], "completion_ids": [27, 28, 29], "loss_mask": [1, 1, 1], "group": "b"},
]
for k, row in enumerate(ROWS):
    c = len(row["completion_ids"])
    row["advantage"] = [(-1.0) ** k * (0.5 + 0.25 * t) for t in range(c)]
    row["old_logp"] = [-0.1 * (k + 1) - 0.05 * t for t in range(c)]
    row["ref_logp"] = [-0.2 * (k + 1) - 0.03 * t for t in range(c)]
    row["temperature"] = T


def _left(values: list, width: int, fill) -> list:
    return [fill] * (width - len(values)) + list(values)


def _right(values: list, width: int, fill) -> list:
    return list(values) + [fill] * (width - len(values))


def verl_tensors(rows=ROWS) -> dict:
    """The tensors verl's PPO trainer holds for these rows (DataProto.batch), padded as verl pads them."""
    p = max(len(r["prompt_ids"]) for r in rows)
    c = max(len(r["completion_ids"]) for r in rows)
    prompts = torch.tensor([_left(r["prompt_ids"], p, PAD) for r in rows])
    responses = torch.tensor([_right(r["completion_ids"], c, PAD) for r in rows])
    attention = torch.tensor(
        [_left([1] * len(r["prompt_ids"]), p, 0) + _right([1] * len(r["completion_ids"]), c, 0) for r in rows]
    )

    def per_token(name):
        return torch.tensor([_right(r[name], c, JUNK) for r in rows], dtype=torch.float32)

    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "response_mask": torch.tensor([_right(r["loss_mask"], c, 0) for r in rows]),
        "advantages": per_token("advantage"),
        "old_log_probs": per_token("old_logp"),
        "ref_log_prob": per_token("ref_logp"),
    }


def dataproto(tensors=None, rows=ROWS) -> DataProto:
    return DataProto.from_dict(
        tensors=verl_tensors(rows) if tensors is None else tensors,
        non_tensors={"uid": np.array([r["group"] for r in rows], dtype=object)},
        meta_info={"temperature": T, "global_token_num": [4, 2, 4, 3]},
    )


@pytest.fixture
def saved(tmp_path):
    """A DataProto saved by verl's own save_to_disk."""
    path = tmp_path / "batch.dp"
    dataproto().save_to_disk(path)
    return path


def _memmap(data: DataProto, path):
    """The tensor-only form (docs/verl_dataproto.md): tensordict's own memmap, non-tensor fields in the sidecar."""
    data.batch.memmap(path)
    side = {
        "non_tensor_batch": {"uid": data.non_tensor_batch["uid"].tolist()},
        "meta_info": {"temperature": T},
    }
    (path / SIDECAR).write_text(json.dumps(side))
    return path


def _f32(values: list) -> list:
    """verl stores the per-token values in float32: the rows hold them rounded so."""
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()


def _assert_same_rollouts(got, want):
    assert got.n == want.n == len(ROWS) and got.mode == want.mode == "ids"
    assert got.temperature == want.temperature == T
    for name in ("prompt_ids", "completion_ids", "advantages", "old_logp", "ref_logp", "loss_mask"):
        g, w = getattr(got, name), getattr(want, name)
        assert [x.tolist() for x in g] == [x.tolist() for x in w], name


def _hand_rows() -> list[dict]:
    per_token = ("advantage", "old_logp", "ref_logp")
    return [{k: _f32(v) if k in per_token else v for k, v in r.items()} for r in ROWS]


# ---- (a) a pickle is never unpickled without the flag ---------------------------------------------------------------
class _Payload:
    """A pickle that makes a directory when unpickled: shows whether a reader unpickled it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_dataproto_file_is_refused_without_the_flag(saved, tmp_path, tiny_model_dir, capsys):
    with pytest.raises(RolloutsError) as info:
        read_rollouts(saved)
    msg = str(info.value)
    assert msg.startswith(f"rollouts {saved}: is a pickle") and "--allow_pickle" in msg
    assert "unpickling runs code" in msg and "\n" not in msg
    out = tmp_path / "out"
    rc = main(["probe", "--model", str(tiny_model_dir), "--rollouts", str(saved), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tokendyn probe: error: rollouts ") and "--allow_pickle" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()

    evil, marker = tmp_path / "evil.pkl", tmp_path / "unpickled"
    evil.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(RolloutsError, match="--allow_pickle"):
        read_rollouts(evil)
    assert not marker.exists()  # refused before any byte was unpickled
    with pytest.raises(RolloutsError, match="not a verl DataProto"):
        read_rollouts(evil, allow_pickle=True)
    assert marker.exists()  # the flag really unpickles: it is the user's trust that is asked for


# ---- (b) with the flag: the rows built by hand ----------------------------------------------------------------------
def test_a_dataproto_file_with_the_flag_gives_the_hand_built_rows(saved):
    got = read_rollouts(saved, allow_pickle=True)
    _assert_same_rollouts(got, read_rollouts(_hand_rows()))
    assert set(got.ignored) >= {"input_ids", "position_ids", "group"}  # group: the advantages are given

    # the converted table row by row, group = uid included
    data = DataProto.load_from_disk(saved)
    table = dataproto_table(dict(data.batch.items()), data.non_tensor_batch, data.meta_info, "x")
    cols = {k: v.to_list() if isinstance(v, pl.Series) else list(v) for k, v in table.columns.items()}
    rows = [{k: [bool(x) for x in v] if k == "loss_mask" else v for k, v in r.items()} for r in _hand_rows()]
    assert [{k: cols[k][i] for k in rows[i]} for i in range(len(rows))] == rows
    assert set(cols) == set(rows[0])  # nothing else: the rows are unpadded, no prompt_mask / completion_mask

    # an in-memory DataProto reads the same
    _assert_same_rollouts(read_rollouts(dataproto()), read_rollouts(_hand_rows()))


def test_rewards_and_uid_without_advantages_give_grpo_advantages(tmp_path):
    tensors = verl_tensors()
    del tensors["advantages"]
    scores = [1.0, 0.0, 0.25, 0.75]  # verl's outcome reward: on the last response token
    tensors["token_level_rewards"] = torch.zeros_like(tensors["old_log_probs"])
    for i, r in enumerate(ROWS):
        tensors["token_level_rewards"][i, len(r["completion_ids"]) - 1] = scores[i]
    got = read_rollouts(dataproto(tensors))
    want = read_rollouts(
        [
            {"reward": s, "group": r["group"], "prompt": "p", "completion": "c"}
            for s, r in zip(scores, ROWS, strict=True)
        ]
    )
    assert (
        got.advantage_source == "grpo(reward, group)" and got.advantages.tolist() == want.advantages.tolist()
    )


# ---- (c) the tensor-only directory: the same rows, no flag, nothing unpickled ---------------------------------------
def test_a_tensordict_directory_gives_the_same_rows_without_unpickling(tmp_path):
    data = dataproto()
    path = _memmap(data, tmp_path / "batch.td")
    _assert_same_rollouts(read_rollouts(path), read_rollouts(_hand_rows()))

    # an entry tensordict stores as a pickle is never opened: tensordict's own loader would unpickle it
    td = data.batch.clone()
    td["extra"] = NonTensorStack(
        *[Fraction(1, 3)] * len(ROWS)
    )  # not JSON: tensordict writes extra/pickle.pkl
    evil = _memmap(DataProto(batch=td, non_tensor_batch=data.non_tensor_batch), tmp_path / "evil.td")
    marker = tmp_path / "unpickled"
    (evil / "extra" / "pickle.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    got = read_rollouts(evil)
    _assert_same_rollouts(got, read_rollouts(_hand_rows()))
    assert "extra" in got.ignored and not marker.exists()
    with suppress(Exception):
        TensorDict.load_memmap(evil)
    assert marker.exists()  # why the reader here does not call TensorDict.load_memmap


# ---- (d) malformed batches: one line naming the field ---------------------------------------------------------------
def _broken(case: str) -> dict:
    t = verl_tensors()
    b, p = t["prompts"].shape
    if case == "missing responses":
        del t["responses"]
    elif case == "attention_mask too short":
        t["attention_mask"] = t["attention_mask"][:, :-1]
    elif case == "advantages of the wrong width":
        t["advantages"] = torch.zeros(b, t["responses"].shape[1] + 1)
    elif case == "prompt not left-padded":
        t["attention_mask"][1, :p] = torch.tensor([1, 0, 1, 1])
    elif case == "response not right-padded":
        t["attention_mask"][1, p:] = torch.tensor([1, 0, 1, 0])
    elif case == "response_mask on padding":
        t["response_mask"][2, 3] = 1
    elif case == "float token ids":
        t["responses"] = t["responses"].float()
    elif case == "no advantages":
        del t["advantages"]
    return t


MALFORMED = {
    "missing responses": "field 'responses' is missing",
    "attention_mask too short": "field 'attention_mask' must be a 2-D tensor [B, P + R] = [4, 8]",
    "advantages of the wrong width": "field 'advantages' must be a 2-D tensor [B, R] = [4, 4]",
    "prompt not left-padded": "field 'attention_mask': the prompt part (the first P = 4 columns) must be left-padded",
    "response not right-padded": "field 'attention_mask': the response part (the last R = 4 columns) must be right-pad",
    "response_mask on padding": "field 'response_mask' is 1 where attention_mask is 0 (padding) in row 2",
    "float token ids": "field 'responses' must hold integer token ids",
    "no advantages": "field 'advantages' is missing",
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_batch_fails_in_one_line_naming_the_field(case, tmp_path):
    path = tmp_path / "bad.dp"
    dataproto(_broken(case)).save_to_disk(path)
    with pytest.raises(RolloutsError) as info:
        read_rollouts(path, allow_pickle=True)
    msg = str(info.value)
    assert msg.startswith(f"rollouts {path}: ") and MALFORMED[case] in msg and "\n" not in msg


def test_a_malformed_directory_fails_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RolloutsError, match="is a directory without meta.json"):
        read_rollouts(empty)
    path = _memmap(dataproto(), tmp_path / "batch.td")
    (path / "responses.memmap").write_bytes(b"\0" * 8)
    with pytest.raises(RolloutsError, match=r"field 'responses': responses.memmap must hold 128 bytes"):
        read_rollouts(path)
    (path / "meta.json").write_text(json.dumps({"_type": "<class 'tensordict.tensorclass.NonTensorStack'>"}))
    with pytest.raises(RolloutsError, match="must describe a plain TensorDict"):
        read_rollouts(path)
    with pytest.raises(
        RolloutsError, match=r"unknown file type '\.csv'; use \.parquet or \.jsonl, a verl DataProto"
    ):
        read_rollouts(tmp_path / "r.csv")


# ---- (e) end to end: tokendyn probe on verl's own file --------------------------------------------------------------
def test_tokendyn_probe_runs_on_a_dataproto_file(saved, tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    argv = [
        "probe",
        "--model",
        str(tiny_model_dir),
        "--rollouts",
        str(saved),
        "--out",
        str(out),
        "--allow_pickle",
    ]
    rc = main(argv + ["--batch_size", "4", "--analyses", "none", "--device", "cpu"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    scored = sum(sum(r["loss_mask"]) for r in ROWS)
    assert f"probed {scored} tokens of {len(ROWS)} completions" in captured.err
    assert "T = 0.7" in captured.err and "ignored columns: group, input_ids, position_ids" in captured.err
    norms = pl.read_parquet(sorted((out / "records").glob("binstats-*.parquet"))).filter(
        pl.col("quantity") == "norm"
    )
    assert norms["count"].sum() == scored * 3  # 2 layers + the final norm, each scored token once
    meta = json.loads((out / "run.json").read_text())
    assert meta["rollouts"] == str(saved) and meta["options"]["temperature"] == T


def test_verls_rollout_log_probs_are_the_sampler_column_and_tokendyn_probe_records_them(
    tmp_path, tiny_model_dir, capsys
):
    """A batch with verl's ``rollout_log_probs`` (the rollout engine's own log mu): read as ``sampler_logp`` on the
    kept tokens, and `tokendyn probe` writes `sampler` records whose log mu is that column and whose log pi_old is
    the file's old_logp, per scored token."""
    tensors = verl_tensors()
    c = tensors["responses"].shape[1]
    mu = [[-0.15 * (k + 1) - 0.02 * t for t in range(len(r["completion_ids"]))] for k, r in enumerate(ROWS)]
    tensors["rollout_log_probs"] = torch.tensor([_right(m, c, JUNK) for m in mu], dtype=torch.float32)
    got = read_rollouts(dataproto(tensors))
    assert [x.tolist() for x in got.sampler_logp] == [_f32(m) for m in mu]
    path = tmp_path / "batch.dp"
    dataproto(tensors).save_to_disk(path)
    out = tmp_path / "run"
    argv = ["probe", "--model", str(tiny_model_dir), "--rollouts", str(path), "--out", str(out), "--allow_pickle",
            "--batch_size", "4", "--analyses", "none", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    records = pl.read_parquet(sorted((out / "records").glob("sampler-*.parquet")))
    scored = [(k, t) for k, r in enumerate(ROWS) for t, on in enumerate(r["loss_mask"]) if on]
    assert records.height == len(scored)
    want_mu = sorted(_f32(mu[k])[t] for k, t in scored)
    want_old = sorted(_f32(ROWS[k]["old_logp"])[t] for k, t in scored)
    assert sorted(records["logp_sampler"].to_list()) == want_mu
    assert sorted(records["logp_old"].to_list()) == want_old
    assert json.loads((out / "run.json").read_text())["sampler"] == "sampler_logp column"
