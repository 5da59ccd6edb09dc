"""Bad input to every command is rejected before any work: exit code 2, one stderr line ``tokendyn CMD: error: ...``
that names the file, row or field and what is allowed, no traceback, and nothing created (no output file, no run
directory, no analysis table).

Each case is (command line, fragment the message must hold, paths that must not exist afterwards)."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
import torch
from _models import make_batch, tiny_qwen2

from tokendyn.cli import main
from tokendyn.hooks import instrument

torch.set_num_threads(1)


def _probe_steps(run, layers=None, steps: int = 3):
    """Records of steps 0..steps-1 (stage "train"), written by `instrument` in a plain loop."""
    model = tiny_qwen2(sharpen=4.0)
    batch = make_batch(model, n=4, sample=False)
    with instrument(model, run, points=layers, temperature=1.0, check_tokens=None, rank=0) as probe:
        for step in range(steps):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            z = out.logits[:, -batch.c - 1 : -1].float()
            logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
            probe.begin_step(step=step, completion_mask=batch.completion_mask, advantages=batch.advantages,
                         completion_ids=batch.completion_ids, logps=logps, temperature=1.0)  # fmt: skip
            (-(logps * batch.advantages.unsqueeze(1) * batch.completion_mask).sum()).backward()
            probe.end_step()
            model.zero_grad()
    return run


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    return _probe_steps(tmp_path_factory.mktemp("probed") / "run")


class Ctx:
    """Paths a case may use: ``tmp`` (fresh per case), the tiny model, the probed run."""

    def __init__(self, tmp, model_dir, run):
        self.tmp, self.model, self.run = tmp, model_dir, run

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def jsonl(self, name: str, rows) -> str:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def gpt2_model(self) -> str:
        """A tiny GPT-2 (64 learned positions) with the tiny model's tokenizer: K&K prompts do not fit."""
        from transformers import GPT2Config, GPT2LMHeadModel

        out = self.tmp / "gpt2"
        shutil.copytree(self.model, out)
        for f in out.glob("*.safetensors"):
            f.unlink()
        cfg = GPT2Config(vocab_size=384, n_positions=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=None,
                         eos_token_id=None)  # fmt: skip
        GPT2LMHeadModel(cfg).save_pretrained(out)
        return str(out)

    def weightless_model(self) -> str:
        """The tiny model's config and tokenizer without its weights: a check that passes here ran before any load."""
        out = self.tmp / "no_weights"
        shutil.copytree(self.model, out)
        for f in out.glob("*.safetensors"):
            f.unlink()
        return str(out)


ROW = {"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "advantage": 1.0}


def _train(c: Ctx, *extra):
    return ["train", "--model_name_or_path", str(c.model), "--output_dir", str(c.tmp / "run"), *extra], [
        c.tmp / "run"
    ]


def _probe(c: Ctx, rollouts, *extra, model=None):
    out = c.tmp / "out"
    return ["probe", "--model", model or str(c.model), "--rollouts", rollouts, "--out", str(out), *extra], [
        out
    ]


def _eval(c: Ctx, *extra):
    out = c.tmp / "e.parquet"
    return ["eval", "--model", str(c.model), "--out", str(out), *extra], [out]


def _analyze(c: Ctx, *extra, run=None):
    out = c.tmp / "analysis"
    return ["analyze", str(run or c.run), "--out", str(out), *extra], [out]


def _score(c: Ctx, path):
    out = c.tmp / "s.scores.jsonl"
    return ["kk", "score", "--input", path, "--out", str(out)], [out]


def _generate(c: Ctx, *extra):
    out = c.tmp / "g.parquet"
    return ["kk", "generate", *extra, "--out", str(out)], [out]


def _yaml(c: Ctx, text: str | bytes):
    return _train(c, "--config", c.file("run.yaml", text))


GOOD_SCORE = {"prompt": "p", "ground_truth": "(1) A is a knight", "response": "r"}

CASES = {
    # ---- train: flags and config values
    "train temperature 0": (lambda c: _train(c, "--temperature", "0"), "temperature must be a number > 0"),
    "train temperature negative": (lambda c: _train(c, "--temperature", "-1"), "temperature must be"),
    "train temperature nan": (lambda c: _train(c, "--temperature", "nan"), "temperature must be"),
    "train temperature text": (
        lambda c: _train(c, "--temperature", "hot"),
        "--temperature: invalid float value",
    ),
    "train unknown flag": (lambda c: _train(c, "--temprature", "1"), "['--temprature', '1']"),
    "train people 9": (lambda c: _train(c, "--people", "9"), "people: every size must be in 2..8"),
    "train lopti_eta 1.5": (lambda c: _train(c, "--lopti_eta", "1.5"), "lopti_eta must be None"),
    "train eta and quantile": (
        lambda c: _train(c, "--lopti_eta", "0.5", "--lopti_quantile", "0.5"),
        "mutually exclusive",
    ),  # fmt: skip
    "train alpha 2": (lambda c: _train(c, "--advantage_reweight_alpha", "2"), "advantage_reweight_alpha"),
    "train flush seconds -1": (lambda c: _train(c, "--probe_flush_seconds", "-1"), "probe_flush_seconds"),
    "train eval_n 500": (lambda c: _train(c, "--eval_n", "500"), "eval_n: must be in 0..100"),
    "train bad bins": (lambda c: _train(c, "--probe_every", "1", "--probe_bins", "0,2"), "probe_bins:"),
    "train bool text": (lambda c: _train(c, "--bf16", "maybe"), "--bf16"),
    "train save_steps 0": (
        lambda c: _train(c, "--save_steps", "0"),
        "save_steps: must be a whole number of rollouts",
    ),
    "train save_steps fraction": (
        lambda c: _train(c, "--save_steps", "0.5"),
        "save_steps: must be a whole number",
    ),
    "train lr text": (lambda c: _train(c, "--learning_rate", "fast"), "--learning_rate"),
    # ---- train: paths
    "train model missing": (
        lambda c: _train(c, "--model_name_or_path", str(c.tmp / "nope")),
        "does not exist",
    ),
    "train prompts past learned positions": (
        lambda c: _train(c, "--model_name_or_path", c.gpt2_model(), "--people", "3"),
        "exceeds the model's 64 positions (max_position_embeddings); its positions are a learned table",
    ),
    "train model not a model": (
        lambda c: _train(c, "--model_name_or_path", str(c.tmp)),
        "holds no config.json",
    ),
    "train output under a file": (
        lambda c: (["train", "--output_dir", c.file("f", "x") + "/run"], []),
        "output_dir: cannot write",
    ),  # fmt: skip
    "train resume missing": (
        lambda c: _train(c, "--resume_from_checkpoint", str(c.tmp / "checkpoint-3")),
        "resume_from_checkpoint: ",
    ),  # fmt: skip
    "train resume true, none": (
        lambda c: _train(c, "--resume_from_checkpoint", "true"),
        "holds no checkpoint-N",
    ),
    "train resume not a checkpoint": (
        lambda c: _train(c, "--resume_from_checkpoint", str(c.model)),
        "trainer_state.json",
    ),  # fmt: skip
    "train onto an earlier run": (
        lambda c: _train(c, "--output_dir", str(c.run)),
        "holds an earlier run (records/)",
    ),
    "train resume a file": (
        lambda c: _train(c, "--resume_from_checkpoint", c.file("ck", "x")),
        "not a directory",
    ),
    # ---- train: the YAML of --config
    "yaml missing": (lambda c: _train(c, "--config", str(c.tmp / "no.yaml")), "does not exist"),
    "yaml syntax": (lambda c: _yaml(c, "people: [3, 4\nlopti_eta: 0.5\n"), "YAML syntax error at line"),
    "yaml tab indent": (lambda c: _yaml(c, "people:\n\t- 3\n"), "YAML syntax error"),
    "yaml not a mapping": (lambda c: _yaml(c, "- 3\n- 4\n"), "must hold a YAML mapping"),
    "yaml unknown field": (lambda c: _yaml(c, "lopti_etaa: 0.5\n"), "unknown field 'lopti_etaa'"),
    "yaml not utf-8": (lambda c: _yaml(c, b"lopti_eta: 0.5 \xff\xfe\n"), "is not UTF-8"),
    "yaml wrong type": (lambda c: _yaml(c, "temperature: hot\n"), "--temperature: invalid float value"),
    "yaml bad value": (lambda c: _yaml(c, "lopti_eta: 2\n"), "lopti_eta must be None"),
    "yaml nested list": (lambda c: _yaml(c, "people: [[3], [4]]\n"), "field 'people' must be a value"),
    "yaml env not a mapping": (lambda c: _yaml(c, "env: 3\n"), "'env' must be a mapping"),
    # ---- probe
    "probe jsonl not utf-8": (
        lambda c: _probe(c, c.file("r.jsonl", b'{"prompt_ids": [5]}\n\xff\xfe\n')),
        "line 2 is not UTF-8",
    ),  # fmt: skip
    "probe ids over vocab (no weights read)": (
        lambda c: _probe(
            c, c.jsonl("r.jsonl", [ROW, ROW | {"completion_ids": [7, 5000]}]), model=c.weightless_model()
        ),
        "row 1: completion_ids holds ids outside the model's vocabulary",
    ),  # fmt: skip
    "probe negative ids": (
        lambda c: _probe(c, c.jsonl("r.jsonl", [ROW | {"prompt_ids": [-3, 4]}]), model=c.weightless_model()),
        "outside the model's vocabulary",
    ),  # fmt: skip
    "probe row longer than positions": (
        lambda c: _probe(
            c, c.jsonl("r.jsonl", [ROW, ROW | {"prompt_ids": [5] * 300}]), model=c.weightless_model()
        ),
        "row 1: prompt + completion is 303 tokens (300 + 3) but the model has 256 positions",
    ),  # fmt: skip
    "probe model missing": (
        lambda c: _probe(c, c.jsonl("r.jsonl", [ROW]), model=str(c.tmp / "nope")),
        "--model: ",
    ),  # fmt: skip
    "probe temperature 0": (
        lambda c: _probe(c, c.jsonl("r.jsonl", [ROW]), "--temperature", "0"),
        "--temperature",
    ),
    "probe file missing": (lambda c: _probe(c, str(c.tmp / "none.jsonl")), "no such file"),
    "probe empty file": (lambda c: _probe(c, c.file("r.jsonl", "\n")), "holds no rows"),
    "probe line not an object": (
        lambda c: _probe(c, c.file("r.jsonl", "[1, 2]\n")),
        "line 1 must be a JSON object",
    ),
    "probe invalid json": (
        lambda c: _probe(c, c.file("r.jsonl", '{"prompt_ids": [1,\n')),
        "line 1 is not valid JSON",
    ),
    "probe garbage parquet": (
        lambda c: _probe(c, c.file("r.parquet", b"PAR1 not really")),
        "cannot be read as parquet",
    ),  # fmt: skip
    "probe positions choice": (
        lambda c: _probe(c, c.jsonl("r.jsonl", [ROW]), "--positions", "left"),
        "argument --positions: invalid choice",
    ),  # fmt: skip
    "probe batch size text": (
        lambda c: _probe(c, c.jsonl("r.jsonl", [ROW]), "--batch_size", "x"),
        "argument --batch_size: invalid int value",
    ),  # fmt: skip
    "probe nan advantage": (
        lambda c: _probe(
            c, c.file("r.jsonl", '{"prompt_ids": [5], "completion_ids": [6], "advantage": NaN}\n')
        ),
        "column 'advantage' must be finite",
    ),
    # ---- analyze
    "analyze missing run": (lambda c: _analyze(c, run=c.tmp / "nope"), "does not exist"),
    "analyze no records": (lambda c: _analyze(c, run=c.tmp), "no binstats records"),
    "analyze stage foo": (lambda c: _analyze(c, "--stage", "foo"), "--stage: 'foo' matches no records"),
    "analyze point layers.9.out": (
        lambda c: _analyze(c, "--points", "layers.9.out"),
        "available: layers.0.out, layers.1.out, final_norm.out",
    ),  # fmt: skip
    "analyze steps 50:60": (lambda c: _analyze(c, "--steps", "50:60"), "its steps: 0..2 (3 recorded)"),
    "analyze steps 7": (lambda c: _analyze(c, "--steps", "7"), "--steps: 7 matches no records"),
    "analyze steps text": (lambda c: _analyze(c, "--steps", "a:b"), "--steps takes N, A:B"),
    "analyze stage and steps": (
        lambda c: _analyze(c, "--stage", "train", "--steps", "9:"),
        "of stage 'train'",
    ),  # fmt: skip
    # ---- eval
    "eval model missing": (lambda c: _eval(c, "--model", str(c.tmp / "nope")), "model: "),
    "eval model not a model": (lambda c: _eval(c, "--model", str(c.tmp)), "holds no config.json"),
    "eval n 0": (lambda c: _eval(c, "--n", "0"), "n: must be in 1..100"),
    "eval temperature 0": (lambda c: _eval(c, "--temperature", "0"), "temperature: must be > 0"),
    "eval people 1": (lambda c: _eval(c, "--people", "1"), "people: every size"),
    "eval modes": (lambda c: _eval(c, "--modes", "beam"), "modes: must be greedy and/or sampled"),
    "eval out csv": (
        lambda c: (["eval", "--out", str(c.tmp / "e.csv")], [c.tmp / "e.csv"]),
        "out: must be a .parquet",
    ),
    "eval batch size 0": (lambda c: _eval(c, "--batch_size", "0"), "batch_size: must be > 0"),
    # ---- kk score / generate
    "kk score parquet": (
        lambda c: _score(c, c.file("r.parquet", b"PAR1\x00\x00")),
        "kk score reads JSON lines",
    ),
    "kk score missing": (lambda c: _score(c, str(c.tmp / "none.jsonl")), "no such file"),
    "kk score not utf-8": (
        lambda c: _score(c, c.file("r.jsonl", b"\xff\xfe{}\n")),
        "input line 1: not UTF-8",
    ),
    "kk score invalid json": (
        lambda c: _score(c, c.file("r.jsonl", "{oops\n")),
        "input line 1: not valid JSON",
    ),
    "kk score missing field": (
        lambda c: _score(c, c.jsonl("r.jsonl", [GOOD_SCORE, {"prompt": "p"}])),
        "input line 2: field 'ground_truth'",
    ),  # fmt: skip
    "kk score empty": (lambda c: _score(c, c.file("r.jsonl", "\n\n")), "holds no rows"),
    "kk score list line": (lambda c: _score(c, c.file("r.jsonl", "[1]\n")), "expected a JSON object"),
    "kk generate people 9": (lambda c: _generate(c, "--people", "9", "--count", "1"), "people: must be"),
    "kk generate count 0": (lambda c: _generate(c, "--people", "3", "--count", "0"), "count: must be > 0"),
    # ---- warmstart
    "warmstart device tpu": (
        lambda c: (
            ["warmstart", "--preset", "tiny", "--out", str(c.tmp / "w"), "--device", "tpu"],
            [c.tmp / "w"],
        ),
        "device: must be auto, cpu, cuda or cuda:N, got 'tpu'",
    ),
    "warmstart device cudafoo": (
        lambda c: (
            ["warmstart", "--preset", "tiny", "--out", str(c.tmp / "w"), "--device", "cudafoo"],
            [c.tmp / "w"],
        ),
        "device: must be auto, cpu, cuda or cuda:N, got 'cudafoo'",
    ),
    "warmstart preset big": (
        lambda c: (["warmstart", "--preset", "big", "--out", str(c.tmp / "w")], [c.tmp / "w"]),
        "preset: must be one of",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clean_line_and_leaves_nothing(case, tiny_model_dir, probed_run, tmp_path, capsys):
    build, fragment = CASES[case]
    argv, created = build(Ctx(tmp_path, tiny_model_dir, probed_run))
    before = sorted(p.name for p in (probed_run / "records").iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    # (transformers' own progress bars, when a case has to load a model to find the fault, are not messages)
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"tokendyn {argv[0]}"), lines[0]
    assert fragment in lines[0], lines[0]
    for path in created:
        assert not path.exists(), path
    assert sorted(p.name for p in (probed_run / "records").iterdir()) == before
    assert not (probed_run / "analysis").exists()


def test_analyze_writes_only_tables_with_rows(probed_run, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["analyze", str(probed_run), "--out", str(out), "--steps", "1:2", "--stage", "train"]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert "bins.parquet" in written
    assert all(pl.read_parquet(out / name).height for name in written)
    assert sorted(pl.read_parquet(out / "bins.parquet")["tokens"].unique().to_list())  # a real table


def test_analyze_leaves_out_an_empty_table(tmp_path, capsys):
    """Layers only (no LM-head input probed): no exact checks, so no checks.parquet, and it says so."""
    run = _probe_steps(tmp_path / "run", layers="layers.*.out", steps=1)
    (run / "analysis").mkdir()
    (run / "analysis" / "checks.parquet").write_bytes(b"an earlier analysis")
    assert main(["analyze", str(run)]) == 0
    assert "nothing to write for: checks" in " ".join(capsys.readouterr().out.split())  # (rich wraps lines)
    assert (
        run / "analysis" / "checks.parquet"
    ).read_bytes() == b"an earlier analysis"  # not overwritten by nothing
    assert pl.read_parquet(run / "analysis" / "bins.parquet").height
