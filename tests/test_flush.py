"""Records are flushed by time as well as by count: a kill -9 loses at most the last `flush_seconds` of records (plus
the step being recorded), and never leaves a file that cannot be read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest

from tokendyn.records import FLUSH_SECONDS, RecordWriter, shard_files

ROW = {"step": [0], "stage": ["train"], "update": ["real"], "update_stage": ["train"], "source_bin": [-1], "bin": [0],
       "bin_lo": [0.0], "bin_hi": [1.0], "lr": [1e-3]}  # fmt: skip


def _prob_change(step: int) -> dict:
    from tokendyn.records import SCHEMAS

    cols = {c: [None] for c in SCHEMAS["prob_change"]}
    cols.update(ROW)
    cols["step"] = [step]
    return {"prob_change": cols}


def _steps(run_dir) -> list[int]:
    files = shard_files(run_dir, "prob_change")
    return sorted(pl.concat([pl.read_parquet(f) for f in files])["step"].to_list()) if files else []


def _until(condition, deadline_s: float = 30.0) -> bool:
    """Whether ``condition()`` comes true within ``deadline_s`` (polled every 10 ms): a wait for the thing itself,
    as long as a loaded machine needs, instead of a fixed sleep that a slow timer thread overruns."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_writer_flushes_when_the_time_is_up(tmp_path):
    """The timer's contract in terms that hold whatever the load: what is buffered is written without another add
    once flush_seconds have passed since the last flush, and never before (when the records are first seen, a clock
    started before that flush shows at least flush_seconds, however late the timer thread runs)."""
    assert FLUSH_SECONDS <= 30
    since = time.monotonic()  # no later than the writer's last flush (its creation)
    w = RecordWriter(tmp_path, rank=0, flush_every=1000, flush_seconds=0.3)
    w.add(_prob_change(0))  # the count (1000 adds) is not up
    assert _until(lambda: _steps(tmp_path) == [0])  # no add comes: the timer writes it
    assert time.monotonic() - since >= 0.3  # not before the time is up
    since = time.monotonic()
    w.flush()  # nothing buffered: writes nothing, and the time counts from here
    w.add(_prob_change(1))
    w.add(_prob_change(2))
    assert _until(lambda: _steps(tmp_path) == [0, 1, 2])
    assert time.monotonic() - since >= 0.3
    w.flush_seconds = 0.0  # 0: every add writes at once
    w.add(_prob_change(9))
    assert _steps(tmp_path) == [0, 1, 2, 9]
    # an explicit flush disarms the timer: a timer armed by the add of 3 (due in 0.3 s) and left running would
    # write 4 early; disarmed, 4 waits for its own timer (30 s) or the next flush
    w.flush_seconds = 0.3
    w.add(_prob_change(3))
    w.flush()
    assert _steps(tmp_path) == [0, 1, 2, 3, 9]
    w.flush_seconds = 30.0
    w.add(_prob_change(4))
    assert not _until(lambda: 4 in _steps(tmp_path), deadline_s=1.0)  # 3x the stale timer's due time
    w.flush()
    assert _steps(tmp_path) == [0, 1, 2, 3, 4, 9]
    with pytest.raises(ValueError, match="flush_seconds must be a number >= 0"):
        RecordWriter(tmp_path, flush_seconds=-1)


CHILD = textwrap.dedent(
    """
    import sys, time
    import torch
    sys.path.insert(0, {tests!r})
    from _models import make_batch, tiny_qwen2
    from tokendyn.hooks import instrument

    torch.set_num_threads(1)
    model = tiny_qwen2(sharpen=4.0)
    batch = make_batch(model, n=4, sample=False)
    with instrument(model, {run!r}, flush_every=10**6, flush_seconds={seconds}, check_tokens=None, rank=0) as probe:
        for step in range(10**6):
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
            z = out.logits[:, -batch.c - 1 : -1].float()
            logps = torch.log_softmax(z, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
            probe.begin_step(step=step, completion_mask=batch.completion_mask, advantages=batch.advantages,
                         completion_ids=batch.completion_ids, logps=logps)
            (-(logps * batch.advantages.unsqueeze(1)).sum()).backward()
            probe.end_step()
            model.zero_grad()
            print(step, time.time(), flush=True)
            time.sleep(0.05 if step < 15 else 1.0)  # from step 15 on, long steps: the timer must flush
    """
)


def test_a_kill_loses_at_most_the_last_seconds(tmp_path):
    seconds = 0.5
    run = tmp_path / "run"
    code = CHILD.format(tests=str(Path(__file__).parent), run=str(run), seconds=seconds)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    done: list[tuple[int, float]] = []
    try:
        for line in child.stdout:
            step, t = line.split()
            done.append((int(step), float(t)))
            if len(done) >= 18:
                break
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    killed = time.time()
    assert child.returncode == -signal.SIGKILL
    kinds = {f.name.split("-rank")[0] for f in (run / "records").glob("*.parquet")}
    for kind in kinds:  # every file on disk is whole
        for f in shard_files(run, kind):
            pl.read_parquet(f)
    assert not list((run / "records").glob(".*"))  # no temp file left visible as a record
    on_disk = {s for f in shard_files(run, "binstats") for s in pl.read_parquet(f)["step"].to_list()}
    # every step finished more than flush_seconds before the kill is on disk (flushed by the next add, or by the
    # timer during the long steps)
    old = [s for s, t in done if t < killed - seconds - 0.3]
    assert len(old) >= 16 and set(old) <= on_disk, (old, sorted(on_disk))
