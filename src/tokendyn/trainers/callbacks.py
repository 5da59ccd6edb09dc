"""Trainer callbacks of a tokendyn run: the parquet metrics log and the held-out evaluation."""

from __future__ import annotations

import math
from pathlib import Path

from transformers import TrainerCallback


class ParquetLogCallback(TrainerCallback):
    """Every ``on_log`` row (reward, accuracy, Lopti fractions, held-out accuracy, ...) appended to
    ``metrics.parquet``, rewritten atomically so a crash never leaves a half-written file. ``rows``: the rows kept
    from before a resume (the new ones are appended)."""

    def __init__(
        self,
        path: str | Path,
        method: str,
        rows: list[dict] | None = None,
        accuracy: str = "rewards/kk_accuracy/mean",
    ):
        self.path = Path(path)
        self.method = method
        self.accuracy = accuracy  # the logged key of the task's training accuracy
        self.rows: list[dict] = list(rows or [])

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        row = {"step": state.global_step, "method": self.method}
        row.update(
            {k: float(v) for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        )
        self.rows.append(row)
        self._write()

    def _write(self) -> None:
        import polars as pl

        from ..common import atomic_write

        frame = pl.DataFrame(self.rows, infer_schema_length=None)
        atomic_write(self.path, lambda tmp: frame.write_parquet(tmp))

    def summary(self) -> dict:
        """Mean training reward and accuracy over the steps, and the last held-out accuracies."""

        def mean(key):
            vals = [r[key] for r in self.rows if key in r and not math.isnan(r[key])]
            return sum(vals) / len(vals) if vals else None

        heldout = {}
        for r in self.rows:
            heldout.update({k: v for k, v in r.items() if k.startswith("heldout/")})
        means = {k: mean(k) for k in ("reward", self.accuracy, "lopti/stage1_fraction")}
        return {
            "mean_train_reward": means["reward"],
            "mean_train_accuracy": means[self.accuracy],
            "mean_lopti_stage1_fraction": means["lopti/stage1_fraction"],
            "last_heldout": heldout,
            "mean_heldout_accuracy": mean("heldout/accuracy"),
        }


class HeldoutEvalCallback(TrainerCallback):
    """Greedy accuracy per puzzle size on the official test puzzles, at step 0, every ``eval_steps``
    and at the end, logged through the trainer (so ``report_to`` backends see it) right after the
    trainer's own log of that step. ``done``: steps already evaluated (a resumed run does not repeat them);
    ``at_start=False``: not at step 0 (a study evaluates its shared starting policy once)."""

    def __init__(
        self,
        trainer,
        people: list[int],
        n: int,
        eval_steps: int | float,
        temperature: float,
        template: str,
        done: set[int] | None = None,
        at_start: bool = True,
    ):
        self.trainer, self.people, self.n = trainer, list(people), n
        self.at_start = at_start
        self.every = max(1, int(eval_steps or 1))
        self.temperature, self.template = temperature, template
        self.done: set[int] = set(done or ())

    def _evaluate(self, state) -> None:
        if state.global_step in self.done:
            return
        self.done.add(state.global_step)
        from .evaluate import evaluate

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        results = evaluate(
            model,
            self.trainer.processing_class,
            self.people,
            n=self.n,
            modes=("greedy",),
            template=self.template,
            seed=state.global_step,
        )
        if was_training:
            model.train()
        logs = {f"heldout/accuracy_{r.people}ppl": r.accuracy for r in results}
        logs.update({f"heldout/reward_{r.people}ppl": r.mean_reward for r in results})
        logs["heldout/accuracy"] = sum(r.accuracy for r in results) / len(results)
        self.trainer.log(logs)

    def on_train_begin(self, args, state, control, **kwargs):
        # step 0 only: a resumed run's checkpoint step was evaluated before the checkpoint if it was due (its row is
        # kept, see `done`), and must not gain a row an uninterrupted run does not have
        if state.is_world_process_zero and state.global_step == 0 and self.at_start:
            self._evaluate(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # after the trainer's own log of a step (so TRL's per-step metrics are already flushed)
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        if state.global_step % self.every == 0 or state.global_step >= state.max_steps:
            self._evaluate(state)


class ArithHeldoutEvalCallback(HeldoutEvalCallback):
    """Greedy accuracy per difficulty on the arithmetic task's held-out split (its first ``min(n, split size)``
    problems, `tokendyn.trainers.arith_eval`), at the same steps as `HeldoutEvalCallback`, ``max_completion_length``
    new tokens at most: ``heldout/accuracy_{d}digit`` and their mean ``heldout/accuracy``; and every problem's
    outcome in ``OUTPUT_DIR/heldout.parquet`` (step, digits, problem, correct; rewritten atomically after each
    evaluation, a resumed run keeping the rows of the steps it does not repeat), for intervals paired by problem."""

    FILE = "heldout.parquet"

    def __init__(
        self,
        trainer,
        digits: list[int],
        n: int,
        eval_steps: int | float,
        cfg,
        done=None,
        at_start: bool = True,
    ):
        super().__init__(trainer, [], n, eval_steps, cfg.temperature, "", done, at_start)
        self.digits, self.max_new_tokens = list(digits), int(cfg.max_completion_length)
        self.path = Path(cfg.output_dir) / self.FILE
        self.outcomes: list[dict] = []
        if self.path.is_file():
            import polars as pl

            kept = pl.read_parquet(self.path).filter(pl.col("step").is_in(sorted(self.done)))
            self.outcomes = kept.to_dicts()

    def _evaluate(self, state) -> None:
        if state.global_step in self.done:
            return
        self.done.add(state.global_step)
        from .arith_eval import arith_outcomes

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        rows = arith_outcomes(
            model, self.trainer.processing_class, self.digits, self.n, max_new_tokens=self.max_new_tokens
        )
        if was_training:
            model.train()
        logs = {}
        for d in self.digits:
            mine = [r["correct"] for r in rows if r["digits"] == d]
            logs[f"heldout/accuracy_{d}digit"] = sum(mine) / len(mine)
        logs["heldout/accuracy"] = sum(logs.values()) / len(logs)
        step = int(state.global_step)
        self.outcomes += [
            {"step": step, "digits": r["digits"], "problem": r["problem"], "correct": int(r["correct"])}
            for r in rows
        ]
        if self.trainer.accelerator.is_main_process:
            import polars as pl

            from ..records import write_parquet

            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_parquet(pl.DataFrame(self.outcomes), self.path)
        self.trainer.log(logs)


def _bar_class():
    from transformers.trainer_callback import ProgressCallback

    class RewardProgressCallback(ProgressCallback):
        """transformers' training bar with the numbers a K&K run is watched by on it (mean reward, training
        accuracy, the last held-out accuracy) instead of one raw ``{'loss': ...}`` dict printed per step."""

        SHOWN = (
            ("reward", "reward"),
            ("rewards/kk_accuracy/mean", "acc"),
            ("rewards/arith_accuracy/mean", "acc"),
            ("heldout/accuracy", "heldout"),
        )

        def __init__(self, description: str = "train"):
            super().__init__()
            self.description = description
            self.shown: dict[str, str] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            from tqdm.auto import tqdm

            if state.is_world_process_zero:
                self.training_bar = tqdm(total=state.max_steps, desc=self.description, dynamic_ncols=True)
            self.current_step = 0

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs:
                return
            for key, short in self.SHOWN:
                v = logs.get(key)
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                    self.shown[short] = f"{v:.3f}"
            if self.shown:
                self.training_bar.set_postfix(self.shown, refresh=True)

    return RewardProgressCallback


def use_reward_bar(trainer, show: bool = True, description: str = "train") -> None:
    """Replace the trainer's log printers (transformers' ProgressCallback / PrinterCallback) by one progress bar
    that shows reward and accuracy; ``show=False``: no bar and no printed logs (the metrics still reach
    ``report_to`` and metrics.parquet)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    if show:
        trainer.add_callback(_bar_class()(description))
