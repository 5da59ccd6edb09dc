"""A W&B run kept offline and read back with W&B's own reader: the environment that keeps every W&B file under one
folder with no network (`offline_env`), and the history rows of the run's transaction log (the ``run-*.wandb`` file
of ``WANDB_DIR/wandb/offline-run-*/``) as W&B itself decodes them: ``wandb leet inspect --json`` prints one JSON
object per record of the log (wandb 0.31, as verl pulls it in here, has no Python reader of the log any more: its
``wandb.sdk.internal.datastore`` is gone with the Python backend; wandb-core reads it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def offline_env(root: Path) -> dict[str, str]:
    """The W&B variables of an offline run whose files all land under ``root`` (nothing read from or written to
    the user's W&B folders, nothing sent)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_CACHE_DIR": str(root / "cache"),
        "WANDB_CONFIG_DIR": str(root / "config"),
        "WANDB_DATA_DIR": str(root / "data"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
    }


def run_file(root: Path) -> Path:
    """The transaction log of the one offline run under ``root`` (a ``WANDB_DIR``)."""
    files = sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def log_records(path: Path, env: dict[str, str]) -> list[dict]:
    """Every record of a ``.wandb`` file, decoded by ``wandb leet inspect --json`` (W&B's own reader)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def exit_code(records: list[dict]) -> int | None:
    """The exit code of a run's log records (None when the run was never finished: no exit record)."""
    codes = [r["exit"].get("exit_code", 0) for r in records if r.get("type") == "exit"]
    assert len(codes) <= 1
    return codes[0] if codes else None


def history(records: list[dict]) -> list[dict]:
    """The history rows of a run's log records in the order they were logged: each row's items, with W&B's step
    (``_step``)."""
    rows = [r["history"] for r in records if r.get("type") == "history"]
    for row in rows:
        assert row["item"]["_step"] == row.get("step", {}).get("num", 0)
    return [row["item"] for row in rows]
