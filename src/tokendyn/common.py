"""Small shared helpers: atomic writes and output-path checks (a run directory is never left
half-written: write to a temporary file beside the target, then rename)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class UsageError(ValueError):
    """Bad user input: printed by the CLI as one line naming the file, the row or field, and what is allowed.
    The input errors of every command derive from it (`RolloutsError`, `ResumeError`, `NoRecordsError`, ...)."""


def check_writable(path: str | os.PathLike, field: str) -> Path:
    """Fail early, naming ``field``, when ``path`` cannot be created or written."""
    p = Path(path)
    parent = p.parent if p.suffix else p
    probe = parent
    while not probe.exists():
        probe = probe.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tokendyn-write-check.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError:
        raise ValueError(
            f"{field}: cannot write to {str(p)!r} ({str(probe)!r} is not a writable directory)"
        ) from None
    if p.exists() and p.is_dir() and p.suffix:
        raise ValueError(f"{field}: {str(p)!r} is a directory, expected a file path")
    return p


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """The one atomic writer: call ``write(tmp_path)`` on a hidden temp file beside ``path``, fsync it, then rename
    it onto ``path`` (os.replace, atomic on POSIX): readers see the old file or the new one, never a partial one.
    The file gets the mode a plain ``open`` would create (0666 less the umask), not the temp file's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(
            tmp, 0o666 & ~_umask()
        )  # mkstemp's 0600 -> the mode open() would give (0644 under umask 022)
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, obj) -> Path:
    def _w(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False, default=str)
            f.write("\n")

    return atomic_write(path, _w)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[str], None]]:
    """A rich bar on stderr; yields ``tick(text)``, which advances it by one and shows ``text`` (the last result)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, TextColumn("{task.fields[last]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total, last="")
        yield lambda text: bar.update(task, advance=1, last=text)
