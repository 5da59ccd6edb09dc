"""The per-token records of the token view (`tokendyn.effects.token_view`): the own-gradient ratio against float64
autograd on every architecture of the configuration matrix (full and LoRA), the decoded text against the tokenizer's
own decode, and the trainer's `token_view` / `token_view_rules` records against the binned records of the same
step (the same tokens summed must give the same numbers)."""

from __future__ import annotations

import copy
from pathlib import Path

import polars as pl
import pytest
import torch
from _matrix import ADAPTERS, ARCHS, PROMPT, T, build, sample_batch, with_adapter

from tokendyn.effects.token_view import head_ratios, token_texts
from tokendyn.probe.float64 import exact_float64
from tokendyn.probe.tokenloss import ProbeBatch

torch.set_num_threads(1)


def reference_ratios(model64, b) -> torch.Tensor:
    """||d log pi_t / d h_t|| / (1 - pi_t) by float64 autograd through the model's own forward: h_t is read at the
    LM head's input by a hook (the head is per position, so d sum_t log pi_t / d h_t is token t's own gradient)."""
    head = model64.get_output_embeddings()
    seen = {}

    def keep(module, args):
        h = args[0].detach().requires_grad_()
        seen["h"] = h
        return (h, *args[1:])

    handle = head.register_forward_pre_hook(keep)
    try:
        with exact_float64():  # float64 at every op (a plain float64 copy's norms run in float32)
            logits = model64(input_ids=b.input_ids).logits[:, PROMPT - 1 : -1]
    finally:
        handle.remove()
    logp = torch.log_softmax(logits / T, -1).gather(-1, b.input_ids[:, PROMPT:, None]).squeeze(-1)
    m = b.completion_mask.bool()
    with exact_float64():
        (g,) = torch.autograd.grad(logp[m].sum(), seen["h"])
    g = g[:, PROMPT - 1 : -1]
    ratio = torch.linalg.vector_norm(g, dim=-1) / (1 - logp.detach().exp())
    return torch.where(m, ratio, torch.zeros_like(ratio))


def probe_batch(b) -> ProbeBatch:
    """The matrix's sampled batch (`_matrix.sample_batch`) as the analyses take it."""
    return ProbeBatch(
        input_ids=b.input_ids,
        attention_mask=torch.ones_like(b.input_ids),
        completion_mask=b.completion_mask.bool(),
        advantages=b.advantages,
        old_logp=b.old_logp,
        temperature=T,
    )


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_head_ratio_equals_float64_autograd(arch, adapter):
    model = with_adapter(build(arch), adapter)
    b = sample_batch(model)
    batch = probe_batch(b)
    got = head_ratios(model, batch)
    assert got is not None, f"{arch}: no head ratio"
    want = reference_ratios(copy.deepcopy(model).double(), b)
    m = b.completion_mask.bool()
    assert float(got[~m].abs().max()) == 0.0
    rel = ((got - want).abs() / want)[m]
    # the float32 model's forward against the float64 copy's (float64 at every op): the ratio is a norm of the head's
    # rows, well conditioned, within a few float32 roundings (1.2e-7 at most over the 24 cells; 1e-4 allowed before)
    assert float(rel.max()) < 1e-6, f"{arch} {adapter}: max rel err {float(rel.max()):.2e}"
    assert float(want[m].min()) > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_head_ratio_in_bf16_weights_within_its_rounding(arch):
    """bf16 weights (the GPU recipe's dtype): the ratio against float64 autograd through the same bf16 values in
    float64 is within the 16-bit tolerance of the matrix (`_matrix.tolerance`: 16 bf16 eps = 0.125, from log pi's
    rounding of the logits), and on most tokens far closer."""
    from _matrix import Cell, tolerance

    model = build(arch).to(torch.bfloat16)
    b = sample_batch(build(arch))
    batch = probe_batch(b)
    got = head_ratios(model, batch)
    assert got is not None and got.dtype == torch.float64
    want = reference_ratios(copy.deepcopy(model).double(), b)
    m = b.completion_mask.bool()
    rel = ((got - want).abs() / want)[m]
    cell = Cell(arch=arch, dtype="bf16", adapter="full", micro="one", analyses="analyses")
    assert float(rel.max()) < tolerance(cell), f"{arch}: max rel err {float(rel.max()):.2e}"
    assert float(rel.median()) < tolerance(cell) / 4


def test_token_texts_join_to_the_decoded_sequence(tiny_model_dir):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    text = "Zoey is a knight.\n  Tab\there, ünïcödé → 🙂 done.<|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    texts, special = token_texts(tok, ids)
    assert len(texts) == len(ids) == len(special)
    assert "".join(texts) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert special[-1] and texts[-1] == "<|im_end|>" and not any(special[:-1])
    # a long sequence: the decoding window moves (CONTEXT_TOKENS) and the join still holds
    long = tok(" ".join([text] * 12), add_special_tokens=False)["input_ids"]
    assert "".join(token_texts(tok, long)[0]) == tok.decode(
        long, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    assert token_texts(None, [3, 4]) == (["", ""], [False, False])


def test_a_tool_masked_hole_keeps_its_neighbours_text(tiny_model_dir):
    """A completion with an unscored token inside it (a tool's output, masked out of the loss), here the first byte
    of "ü": the scored tokens' texts are the pieces of the whole completion's decoding at their positions (the
    second byte completes "ü"), not of the scored ids decoded alone (where it completes nothing)."""
    from transformers import PreTrainedTokenizerFast

    from tokendyn.effects.token_view import token_view_frame

    tok = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    ids = tok(" Oliver says ü so Zoey is a knave", add_special_tokens=False)["input_ids"]
    c = len(ids)
    hole = next(k for k, i in enumerate(ids) if tok.decode([i]) == "\ufffd")  # the first byte of "ü"
    prompt = tok("Who?", add_special_tokens=False)["input_ids"]
    full = torch.tensor([prompt + ids])
    scored = torch.ones(1, c, dtype=torch.bool)
    scored[0, hole] = False
    batch = ProbeBatch(full, torch.ones_like(full), scored, torch.ones(1, dtype=torch.float64), temperature=T)
    pi = torch.full((1, c), 0.5, dtype=torch.float64)
    frame = token_view_frame(batch, 1, step=0, pi_old=pi, bins=torch.where(scored, 2, -1), tokenizer=tok)
    pieces, _ = token_texts(tok, ids)
    assert frame["pos"].to_list() == [k for k in range(c) if k != hole]
    assert frame["text"].to_list() == [pieces[k] for k in frame["pos"].to_list()]
    assert frame.filter(pl.col("pos") == hole + 1)["text"].item() == "ü"
    alone, _ = token_texts(tok, [ids[k] for k in frame["pos"].to_list()])
    assert "ü" not in alone


def test_a_decoder_that_rewrites_its_prefix_recovers():
    """A decoder whose text for a longer prefix does not extend the shorter one (here: every decode upper-cases
    its first character): at most CONTEXT_TOKENS tokens are left empty, then a fresh window gives text again."""
    from tokendyn.effects.token_view import CONTEXT_TOKENS

    class Rewriting:
        all_special_ids: list[int] = []

        def decode(self, ids, **_):
            text = "".join(f" w{i}" for i in ids)
            return text[:2].upper() + text[2:] if len(ids) > 3 else text

    texts, _ = token_texts(Rewriting(), list(range(40)))
    assert len(texts) == 40
    first = texts.index("")
    assert any(texts[first + CONTEXT_TOKENS + 1 :])  # text again after the first rewrite
    runs, run = [], 0
    for x in texts:
        run = run + 1 if x == "" else 0
        runs.append(run)
    assert max(runs) <= CONTEXT_TOKENS + 1


def test_the_trainer_records_every_token_of_the_view(tiny_model_dir, tmp_path):
    """A run with the view on every sampled sequence, the comparison and the real change: every scored token once
    per step; summed over a bin the view's dpi_cf and dpi_real give the `prob_change` records' means, its shares
    the `shares` record's jvp_share, the base rule's dpi the `paired` record's sums."""
    from test_trainer import _config, _trainer

    from tokendyn import load_run

    n = 4
    options = dict(max_steps=2, probe_every=1, probe_sample_sequences=n, probe_view_sequences=n)
    cfg = _config(tmp_path, probe_compare_rules=["reweight"], **options)
    _trainer(tiny_model_dir, cfg).train()
    run = load_run(tmp_path / "run")
    view = run["token_view"].collect()
    rules = run["token_view_rules"].collect()
    assert sorted(set(view["step"])) == [0, 1]  # global_step before each of the two optimizer steps
    assert view.select(pl.struct("step", "seq", "pos").is_unique().all()).item()
    assert view["dpi_real"].null_count() == 0 and view["dpi_cf"].null_count() == 0
    assert view["share"].null_count() == 0 and view["head_ratio"].null_count() == 0
    assert set(view["seq"]) == set(range(n))
    assert view["text"].str.len_chars().sum() > 0
    assert rules.height == view.height * 2 * 2  # (base, reweight) x (equal_norm, optimizer)

    change = run["prob_change"].collect()
    for update, col in (("counterfactual", "dpi_cf"), ("real", "dpi_real")):
        want = change.filter(
            (pl.col("update") == update) & (pl.col("bin") >= 0) & (pl.col("source_bin") == -1)
        ).select("step", "bin", "count", "mean")
        got = view.group_by("step", "bin").agg(pl.len().alias("n"), pl.col(col).mean().alias("got"))
        both = want.join(got, on=["step", "bin"], how="inner")
        assert both.height == want.height > 0
        assert (both["count"] == both["n"]).all(), update
        assert ((both["mean"] - both["got"]).abs() <= 1e-12 + 1e-9 * both["mean"].abs()).all(), update

    shares = run["shares"].collect().filter((pl.col("group") == "all") & (pl.col("bin") >= 0))
    got = view.group_by("step", "bin").agg(pl.col("share").sum())
    both = shares.join(got, on=["step", "bin"], suffix="_view")
    assert both.height > 0 and ((both["jvp_share"] - both["share_view"]).abs() < 1e-9).all()

    paired = run["paired"].collect().filter(pl.col("mode") == "equal_norm")
    tokens = rules.filter(pl.col("mode") == "equal_norm").join(
        view.select("step", "seq", "pos", "bin"), on=["step", "seq", "pos"]
    )
    got = tokens.group_by("step", "rule", "seq", "bin").agg(pl.col("delta_pi").sum())
    both = paired.join(got, on=["step", "rule", "seq", "bin"])
    assert both.height == paired.height > 0
    assert ((both["sum_dpi"] - both["delta_pi"]).abs() < 1e-12).all()


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_a_view_smaller_than_the_sample_and_lopti_groups_token_by_token(tiny_model_dir, tmp_path, order):
    """The view keeps the first probe_view_sequences of a larger analysis sample, and each token's Lopti group is
    its own pi_old against eta (low: pi_old < eta), in either stage order."""
    from test_trainer import _config, _trainer

    from tokendyn import load_run

    eta = 0.5
    options = dict(max_steps=2, probe_every=1, probe_sample_sequences=4, probe_view_sequences=2)
    cfg = _config(tmp_path, lopti_eta=eta, lopti_order=order, **options)
    _trainer(tiny_model_dir, cfg).train()
    view = load_run(tmp_path / "run")["token_view"].collect()
    assert view.height > 0 and set(view["seq"]) == {0, 1}
    want = pl.when(pl.col("pi_old") < eta).then(pl.lit("low")).otherwise(pl.lit("high"))
    assert view.select((pl.col("group") == want).all()).item()
    assert {"low", "high"} <= set(view["group"])


def test_dpi_real_equals_a_float64_before_and_after(tiny_model_dir, tmp_path):
    """Each token's real dpi against an independent measurement: the parameters copied before and after each
    probed optimizer step, each copy run in float64 on the rollout's own rows, pi = softmax(logits / T)[o_t]."""
    from test_trainer import TEMPERATURE, _config, _trainer
    from transformers import TrainerCallback

    from tokendyn import load_run

    n = 3
    cfg = _config(tmp_path, max_steps=2, probe_every=1, probe_sample_sequences=n, probe_view_sequences=n)
    trainer = _trainer(tiny_model_dir, cfg, sgd_lr=1e-2)
    rollouts, states = [], {}
    generate = trainer._generate_and_score_completions

    def keep(inputs):
        out = generate(inputs)
        rollouts.append({k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)})
        return out

    trainer._generate_and_score_completions = keep

    class Snapshots(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            states[(state.global_step, "before")] = copy.deepcopy(trainer.model.state_dict())

        def on_step_end(self, args, state, control, **kw):
            states[(state.global_step - 1, "after")] = copy.deepcopy(trainer.model.state_dict())

    trainer.add_callback(Snapshots())
    trainer.train()
    view = load_run(tmp_path / "run")["token_view"].collect()
    assert sorted(set(view["step"])) == [0, 1]
    from transformers import AutoModelForCausalLM

    model64 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    checked = 0
    for step in (0, 1):
        out = rollouts[step]
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)[:n]
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)[:n]
        c = out["completion_ids"].size(1)
        pis = []
        for when in ("before", "after"):
            model64.load_state_dict({k: v.double() for k, v in states[(step, when)].items()}, strict=True)
            with torch.no_grad(), exact_float64():  # float64 at every op (a plain float64 Qwen2 is not)
                logits = model64(input_ids=ids, attention_mask=attn).logits[:, -c - 1 : -1] / TEMPERATURE
            pis.append(torch.softmax(logits, -1).gather(-1, ids[:, -c:, None]).squeeze(-1))
        ref = pis[1] - pis[0]
        rows = view.filter(pl.col("step") == step)
        want = ref[torch.tensor(rows["seq"].to_list()), torch.tensor(rows["pos"].to_list())]
        got = torch.tensor(rows["dpi_real"].to_list(), dtype=torch.float64)
        err = (got - want).abs()
        # what is left is the float32 forward of the run's own measurement (pi of the float32 model before and after:
        # 2.2e-6 at max |dpi| 0.19 here), not the reference's
        assert float(err.max()) <= 5e-7 + 2e-5 * float(want.abs().max()), (step, float(err.max()))
        big = want.abs() > 1e-4
        assert int(big.sum()) > 10 and bool((got[big].sign() == want[big].sign()).all())
        checked += len(got)
    assert checked == view.height


def test_a_rollout_cut_short_keeps_its_view_with_dpi_real_null(tiny_model_dir, tmp_path):
    """max_steps inside a probed rollout (two optimizer steps per rollout, training stops after the first): the real
    change of the whole rollout never comes, and the view is written when training ends, dpi_real null."""
    from test_trainer import _config, _trainer

    from tokendyn import load_run

    options = dict(max_steps=1, probe_every=1, probe_sample_sequences=2, probe_view_sequences=2)
    cfg = _config(
        tmp_path, steps_per_generation=4, **options
    )  # 2 micro-batches per step: 2 steps per rollout
    _trainer(tiny_model_dir, cfg).train()
    view = load_run(tmp_path / "run")["token_view"].collect()
    assert view.height > 0 and set(view["step"]) == {0} and set(view["seq"]) == {0, 1}
    assert view["dpi_real"].null_count() == view.height
    assert view["dpi_cf"].null_count() == 0 and view["share"].null_count() == 0


def test_each_run_of_a_page_keeps_its_own_bins(tiny_model_dir, tmp_path):
    """Two runs binned differently (4 quarter bins; 2 halves) on one page: each run's bins are its own records'
    edges and its tokens' bins index them (the first run's edges are not used for the second)."""
    from test_trainer import _config, _trainer

    from tokendyn.figures.data import load_runs
    from tokendyn.figures.view import view_data

    dirs = []
    for name, bins in (("quarters", "0,0.25,0.5,0.75,1"), ("halves", "0,0.5,1")):
        options = dict(max_steps=1, probe_every=1, probe_sample_sequences=2, probe_view_sequences=2)
        cfg = _config(tmp_path / name, probe_bins=bins, **options)
        _trainer(tiny_model_dir, cfg).train()
        dirs.append(str(tmp_path / name / "run"))
    data = view_data(load_runs(dirs))
    edges = [[(b["lo"], b["hi"]) for b in r["bins"]] for r in data["runs"]]
    assert edges == [[(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)], [(0.0, 0.5), (0.5, 1.0)]]
    for run, n in zip(data["runs"], (4, 2), strict=True):
        used = {b for step in run["steps"] for seq in step["seqs"] for b in seq["bin"]}
        assert used <= set(range(n)) and len(run["bins"]) == n


def test_the_report_view_keeps_the_latest_steps_within_its_cap(tmp_path):
    """view_data(max_tokens): each run keeps its latest probed steps within its equal part of the cap (at least the
    last one), says what it left out, and the fragment carries that note; no cap: every step."""
    from tokendyn.figures.data import Records, RunInfo
    from tokendyn.figures.view import view_data, view_fragment

    def run(label, steps, per_step):
        n = len(steps) * per_step
        return pl.DataFrame(
            {
                "run": [label] * n, "step": [s for s in steps for _ in range(per_step)], "stage": ["train"] * n,
                "seq": [0] * n, "pos": list(range(per_step)) * len(steps), "token_id": [1] * n, "text": ["a"] * n,
                "special": [False] * n, "bin": [0] * n, "pi_old": [0.1] * n, "advantage": [1.0] * n,
                "group": [None] * n, "share": [None] * n, "dpi_cf": [0.0] * n, "dpi_real": [None] * n,
                "head_ratio": [1.0] * n,
            }
        )  # fmt: skip

    frame = pl.concat([run("a", [0, 2, 4, 6], 10), run("b", [1, 3], 30)])
    records = Records([RunInfo(tmp_path, "a", "a"), RunInfo(tmp_path, "b", "b")], {"token_view": frame})
    full = view_data(records)
    assert full["trimmed"] == {} and [len(r["steps"]) for r in full["runs"]] == [4, 2]
    capped = view_data(records, max_tokens=50)  # 25 per run
    assert [[s["step"] for s in r["steps"]] for r in capped["runs"]] == [[4, 6], [3]]
    assert capped["trimmed"] == {"a": (2, 4), "b": (1, 2)}
    html = view_fragment(records, 50)
    assert "a: the last 2 of 4 probed steps; b: the last 1 of 2 probed steps" in html
    assert "tokendyn view RUN_DIR" in html and "the last" not in view_fragment(records)


def test_view_command_names_a_bad_input_in_one_line(tmp_path, capsys):
    from tokendyn.cli import main

    run = tmp_path / "run"
    (run / "records").mkdir(parents=True)
    (run / "run.json").write_text('{"method": "GRPO"}')
    cases = [
        ([str(tmp_path / "missing")], "missing"),
        ([str(run), "--out", str(tmp_path / "page.txt")], "--out must name an .html file"),
        ([str(run)], "token view: needs `token_view` records"),
    ]
    broken = tmp_path / "broken"
    (broken / "records").mkdir(parents=True)
    (broken / "run.json").write_text('{"method": "GRPO"}')
    (broken / "records" / "token_view-rank000-000000.parquet").write_bytes(b"PAR1 not a parquet file")
    cases.append(([str(broken)], "run_dirs: unreadable records"))
    for argv, message in cases:
        code = main(["view", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (argv, err)
        assert err.startswith("tokendyn view: error:")
    assert not (run / "view.html").exists() and not (broken / "view.html").exists()


def test_written_files_get_the_mode_open_would_give(tmp_path):
    """atomic_write's temp file is 0600; the file it leaves is 0666 less the umask, like a plain open (a report or
    view others on the machine can read)."""
    import os

    from tokendyn.common import atomic_write

    old = os.umask(0o022)
    try:
        path = atomic_write(tmp_path / "page.html", lambda tmp: Path(tmp).write_text("x"))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_an_offline_probe_records_the_view_with_its_text(tiny_model_dir, tmp_path):
    """`tokendyn probe`'s path: text rollouts, the view's texts join to each completion's text, no real update."""
    from test_offline_probe import _load

    from tokendyn import load_run
    from tokendyn.hooks.offline import probe_rollouts

    model, tok = _load(tiny_model_dir)
    completions = [" Oliver is a knave", " tell the truth", " lie\n\tdone", " count: one two"]
    rows = [
        {"prompt": "Zoey says that", "completion": c, "reward": float(k), "group": "a"}
        for k, c in enumerate(completions)
    ]
    probe_rollouts(
        model, tok, rows, tmp_path / "run", temperature=0.7, view_sequences=3, compare_rules=["reweight"]
    )
    view = load_run(tmp_path / "run")["token_view"].collect()
    assert sorted(set(view["seq"])) == [0, 1, 2]
    for seq in range(3):
        text = "".join(view.filter(pl.col("seq") == seq).sort("pos")["text"])
        assert text == completions[seq]
    assert view["dpi_real"].null_count() == view.height and view["dpi_cf"].null_count() == 0
    rules = load_run(tmp_path / "run")["token_view_rules"].collect()
    assert rules.height == 2 * view.height and set(rules["mode"]) == {"equal_norm"}
    key = ["step", "stage", "seq", "pos"]  # each rule row at its view token, stage included
    assert rules.join(view.select(key), on=key, how="inner").height == rules.height


def test_shares_of_a_rounding_level_update_are_not_shown():
    """Shares that do not add up to 1 over the sample (g at its rounding level) become nulls, the others stay."""
    from tokendyn.effects.token_view import token_view_frame

    mask = torch.tensor([[True, True, False], [True, True, True]])
    batch = ProbeBatch(
        input_ids=torch.arange(10).view(2, 5), attention_mask=torch.ones(2, 5, dtype=torch.long),
        completion_mask=mask, advantages=torch.tensor([0.0, 0.0]), temperature=1.0,
    )  # fmt: skip
    pi = torch.full((2, 3), 0.5, dtype=torch.float64)
    bins = torch.where(mask, 2, -1)
    exact = torch.tensor([[0.5, 0.25, 9.0], [0.125, 0.0625, 0.0625]])  # 9.0 sits on padding
    frame = token_view_frame(batch, 2, step=0, pi_old=pi, bins=bins, shares=exact)
    assert frame["share"].to_list() == [0.5, 0.25, 0.125, 0.0625, 0.0625]
    noise = token_view_frame(batch, 2, step=0, pi_old=pi, bins=bins, shares=exact * 0.83)
    assert noise["share"].null_count() == noise.height == 5
