"""What a ``tokendyn train`` run trains on: `RunArguments`, every field a flag (the trainer's are in the config),
checked when built (one line per bad value). Re-exported by `tokendyn.trainers.runner`, which runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tasks.arith.generator import HELDOUT_SIZE, MAX_DIGITS, MIN_DIGITS
from ..tasks.kk.generator import MAX_PEOPLE, MIN_PEOPLE

TRAIN_SPLITS = ("official", "fresh")
TASKS = ("kk", "arith")


@dataclass
class RunArguments:
    """What to train on; every field is a ``tokendyn train`` flag (the trainer's are in the config)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or local directory of the policy (default: the embedded default)."},
    )
    task: str = field(
        default="kk",
        metadata={"help": "Task: kk (Knights and Knaves) or arith (a + b).", "choices": list(TASKS)},
    )
    people: list[int] = field(
        default_factory=lambda: [3, 4, 5], metadata={"help": "Puzzle sizes to train on (2..8)."}
    )
    train_split: str = field(
        default="official",
        metadata={
            "help": "official: the paper's training puzzles (seed 1234, positions 100..999); fresh: new puzzles from "
            "--train_seed with held-out structures removed.",
            "choices": list(TRAIN_SPLITS),
        },
    )
    train_seed: int = field(
        default=7, metadata={"help": "Seed of the fresh training puzzles (not 1234) or sums."}
    )
    train_puzzles_per_size: int = field(default=900, metadata={"help": "Training puzzles per size (1..900)."})
    eval_people: list[int] | None = field(
        default=None,
        metadata={"help": "Sizes evaluated on held-out puzzles every eval_steps (default: --people)."},
    )
    eval_n: int = field(
        default=20,
        metadata={"help": "Held-out puzzles per size per evaluation (0 = off, <= 100; arith: sums, <= 200)."},
    )
    arith_digits: list[int] = field(
        default_factory=lambda: [1, 2],
        metadata={"help": "arith: digits of the operands, 1..3 (several: a mix)."},
    )
    arith_train_problems: int = field(
        default=1000, metadata={"help": "arith: training sums per difficulty (held-out pairs left out)."}
    )
    arith_eval_digits: list[int] | None = field(
        default=None, metadata={"help": "arith: difficulties evaluated (default: --arith_digits)."}
    )
    template: str = field(
        default="qwen-instruct", metadata={"help": "Prompt template: qwen-instruct | base."}
    )
    rollouts: int = field(
        default=15,
        metadata={
            "help": "Length of the run in rollout batches (each generation batch is one RL step of the paper); "
            "sets max_steps so that every method sees the same rollouts (Lopti takes twice the optimizer steps "
            "per rollout). 0 = use --max_steps as given. An explicit --max_steps with this left at its default "
            "wins (rollouts 0); giving both is an error. --eval_steps counts rollouts when this is set; --save_steps "
            "always counts rollouts (a checkpoint falls on a rollout boundary)."
        },
    )

    preset: str | None = field(
        default=None,
        metadata={
            "help": "A set of trainer fields (flags and --config win): baseline, ar, lopti, ar_lopti (the paper's "
            "scripts: official base loss and optimizer), gspo, 80_20, clip_cov, kl_cov "
            "(`tokendyn.trainers.presets.PRESETS`).",
        },
    )
    threads: int | None = field(
        default=None, metadata={"help": "CPU threads of torch and polars (default: every core)."}
    )

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be an integer >= 1, got {self.threads}")
        for name in ("people", "eval_people"):
            sizes = getattr(self, name)
            if sizes is None:
                continue
            bad = [k for k in sizes if not MIN_PEOPLE <= int(k) <= MAX_PEOPLE]
            if bad or not sizes:
                raise ValueError(f"{name}: every size must be in {MIN_PEOPLE}..{MAX_PEOPLE}, got {sizes}")
        if self.preset is not None:
            from .presets import PRESETS

            if self.preset not in PRESETS:
                raise ValueError(f"preset: must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.task not in TASKS:
            raise ValueError(f"task: must be one of {list(TASKS)}, got {self.task!r}")
        for name in ("arith_digits", "arith_eval_digits"):
            digits = getattr(self, name)
            if digits is None:
                continue
            bad = [d for d in digits if not MIN_DIGITS <= int(d) <= MAX_DIGITS]
            if bad or not digits or len(set(digits)) < len(digits):
                raise ValueError(
                    f"{name}: difficulties in {MIN_DIGITS}..{MAX_DIGITS} (digits of the operands), each once, "
                    f"got {digits}"
                )
        if not 1 <= self.arith_train_problems <= 10**6:
            raise ValueError(f"arith_train_problems: must be in 1..1000000, got {self.arith_train_problems}")
        if self.train_split not in TRAIN_SPLITS:
            raise ValueError(f"train_split: must be one of {list(TRAIN_SPLITS)}, got {self.train_split!r}")
        if self.train_split == "fresh" and self.train_seed == 1234:
            raise ValueError("train_seed: fresh puzzles must not use the official seed 1234")
        if not 1 <= self.train_puzzles_per_size <= (900 if self.train_split == "official" else 10**6):
            raise ValueError(
                f"train_puzzles_per_size: must be in 1..900 for the official split, got "
                f"{self.train_puzzles_per_size}"
            )
        if self.rollouts < 0:
            raise ValueError(f"rollouts: must be >= 0 (0 = use max_steps), got {self.rollouts}")
        if self.task == "arith":
            if not 0 <= self.eval_n <= max(HELDOUT_SIZE.values()):
                raise ValueError(
                    f"eval_n: must be in 0..{max(HELDOUT_SIZE.values())} with --task arith, got {self.eval_n}"
                )
        elif not 0 <= self.eval_n <= 100:
            raise ValueError(f"eval_n: must be in 0..100, got {self.eval_n}")
        from ..tasks.kk.prompts import TEMPLATES

        if self.template not in TEMPLATES:
            raise ValueError(f"template: must be one of {sorted(TEMPLATES)}, got {self.template!r}")
