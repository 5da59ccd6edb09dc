"""The doctor's verdicts in the live log: at the end of training, `tokendyn doctor`'s one-line summary of the run
(`tokendyn.analysis.diagnosis.summary_line`: its act / watch / fine counts and the findings that say act or watch)
through the ``tokendyn.doctor`` logger, after the probe has written its last records.

It reads the run's record files only: no model call, no random draw (the diagnosis' bootstraps use their own seeded
generators), so training is unchanged; a diagnosis that fails is logged in one line and training goes on. Once, at
the end: the diagnosis re-reads every record of the run, and the probe writes its records in batches, so a line after
each probed rollout would cost a full read per rollout and judge records not yet written.
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from transformers import TrainerCallback

LOGGER = "tokendyn.doctor"
logger = logging.getLogger(LOGGER)


def doctor_line(run_dir: str | Path) -> tuple[str, bool]:
    """(the run's summary line with the command that prints the whole diagnosis, whether a finding says act)."""
    from tokendyn.analysis.diagnosis import diagnose_run, summary_line

    run = diagnose_run(run_dir)
    line = f"{summary_line(run)}; details: tokendyn doctor {shlex.quote(str(run_dir))}"
    return line, bool(run["counts"]["act"])


def console() -> logging.Logger:
    """The logger, with a handler to stderr when no handler is configured on it or above it (as transformers gives its
    own logger one); levels and handlers the user configured are kept."""
    if not logger.hasHandlers():  # nothing configured: a console line of its own, at INFO
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("tokendyn").addHandler(handler)
        if logger.level == logging.NOTSET and logging.getLogger("tokendyn").level == logging.NOTSET:
            logger.setLevel(logging.INFO)  # (a level the user set on tokendyn's loggers is left as it is)
    return logger


class DoctorLogCallback(TrainerCallback):
    """Logs `doctor_line` of ``run_dir`` at the end of training (main process only; WARNING when a finding says act,
    else INFO). Register it after the probe's callback, which writes the last records at the same event."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.log_summary()

    def log_summary(self) -> None:
        log = console()
        try:
            line, act = doctor_line(self.run_dir)
        except Exception as exc:  # the diagnosis must never fail training
            first = (str(exc).strip().splitlines() or [""])[0]
            log.warning(
                "tokendyn doctor: could not diagnose %s (%s: %s)", self.run_dir, type(exc).__name__, first
            )
            return
        log.log(logging.WARNING if act else logging.INFO, line)
