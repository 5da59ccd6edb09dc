"""K&K data sets: the official records regenerated from seed 1234, and fresh training data.

Official splits (Logic-RL / AR-Lopti): the seed-1234 stream, train = positions 100..999,
test = positions 1000..1099 (``docs/kk.md`` §1.1). Fresh training data comes from other seeds with
every puzzle whose statement structure equals a held-out puzzle's removed (names and templates
are cosmetic, so structure is what must not leak).
"""

from __future__ import annotations

from functools import lru_cache

from .generator import check_people, generate_problems
from .prompts import render_prompt
from .render import COT_FOOT, COT_HEAD, KNIGHT_KNAVE, Puzzle, render

OFFICIAL_SEED = 1234
SPLITS = {"train": (100, 900), "test": (1000, 100)}
# the 2-person stream has only ~400 distinct puzzles: its held-out slice is the first 100
HELDOUT_2PPL = (0, 100)


@lru_cache(maxsize=64)
def puzzles(n: int, seed: int, start: int, count: int) -> tuple[Puzzle, ...]:
    """Stream positions start..start+count-1 of the n-person stream of ``seed``, rendered."""
    return tuple(render(i, p, s, seed) for i, p, s in generate_problems(check_people(n), seed, start, count))


def official_split(n: int, split: str) -> tuple[Puzzle, ...]:
    """The official ``train`` or ``test`` puzzles for n people (n = 3..7 in the paper)."""
    if split not in SPLITS:
        raise ValueError(f"split: must be one of {sorted(SPLITS)}, got {split!r}")
    start, count = SPLITS[split]
    return puzzles(n, OFFICIAL_SEED, start, count)


def heldout(n: int) -> tuple[Puzzle, ...]:
    """Evaluation puzzles: the official test split (n >= 3), or seed-1234 positions 0..99 for n = 2."""
    if check_people(n) == 2:
        return puzzles(2, OFFICIAL_SEED, *HELDOUT_2PPL)
    return official_split(n, "test")


@lru_cache(maxsize=16)
def heldout_structures(n: int) -> frozenset:
    return frozenset(p.statements for p in heldout(n))


def fresh_puzzles(n: int, seed: int, count: int) -> list[Puzzle]:
    """``count`` puzzles from the stream of ``seed`` (not the official 1234) with every puzzle
    whose statements equal a held-out puzzle's removed."""
    if seed == OFFICIAL_SEED:
        raise ValueError(f"seed: fresh data must not use the official seed {OFFICIAL_SEED}")
    if count <= 0:
        raise ValueError(f"count: must be > 0, got {count}")
    banned = heldout_structures(n)
    out: list[Puzzle] = []
    start, chunk = 0, max(64, count)
    while len(out) < count:
        try:
            batch = puzzles(n, seed, start, chunk)
        except ValueError:  # the stream ran out (n = 2): take what is left
            batch = _tail(n, seed, start)
            if not batch:
                break
        out.extend(p for p in batch if p.statements not in banned)
        start += len(batch)
        if len(batch) < chunk:
            break
    return out[:count]


def _tail(n: int, seed: int, start: int) -> tuple[Puzzle, ...]:
    from .generator import problem_stream

    rest = [(i, p, s) for i, (p, s) in enumerate(problem_stream(n, seed)) if i >= start]
    return tuple(render(i, p, s, seed) for i, p, s in rest)


def official_record(p: Puzzle, split: str, row: int, template: str = "qwen-instruct") -> dict:
    """One row in the schema of the official parquet files (``docs/kk.md`` §2)."""
    return {
        "quiz": p.quiz,
        "names": list(p.names),
        "knight_knave": dict(KNIGHT_KNAVE),
        "solution": list(p.solution),
        "solution_text": p.solution_text,
        "solution_text_format": p.solution_text_format,
        "cot_head": COT_HEAD,
        "cot_repeat_steps": list(p.cot_steps),
        "cot_foot": COT_FOOT,
        "statements": p.statements_repr,
        "index": p.index,
        "data_source": "kk_logic",
        "prompt": [{"content": render_prompt(p.quiz, template), "role": "user"}],
        "ability": "logic",
        "reward_model": {
            "ground_truth": {"solution_text_format": p.solution_text_format, "statements": p.statements_repr},
            "style": "rule",
        },
        "extra_info": {"index": row, "split": split},
    }


def trl_rows(items, template: str = "qwen-instruct") -> list[dict]:
    """Rows for TRL's GRPOTrainer: a raw-text ``prompt`` and the reward's ``ground_truth``."""
    return [
        {
            "prompt": render_prompt(p.quiz, template),
            "ground_truth": p.solution_text_format,
            "people": p.people,
            "index": p.index,
            "quiz": p.quiz,
            "names": list(p.names),
            "solution": list(p.solution),
        }
        for p in items
    ]


def kk_dataset(
    people: list[int],
    split: str = "train",
    seed: int | None = None,
    count: int | None = None,
    template: str = "qwen-instruct",
):
    """A ``datasets.Dataset`` for TRL over several sizes (rows grouped by size, as the official
    ``merge_*`` files; the trainer shuffles).

    ``split="train"`` / ``"test"``: the official puzzles; ``split="fresh"``: ``count`` puzzles per
    size from ``seed`` (default 42), held-out structures removed.
    """
    from datasets import Dataset

    rows: list[dict] = []
    for n in people:
        if split == "fresh":
            items = fresh_puzzles(n, 42 if seed is None else seed, count or 900)
        elif split == "heldout":
            items = list(heldout(n))
        else:
            items = list(official_split(n, split))
        if count is not None and split != "fresh":
            items = items[:count]
        rows.extend(trl_rows(items, template))
    return Dataset.from_list(rows)
