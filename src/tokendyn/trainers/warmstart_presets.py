"""The warm start's recipes (`tokendyn.trainers.warmstart`): each version of the embedded default, the test and GPU
presets, and the ``cpu`` alias of the current default."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..policy import ModelPreset


@dataclass(frozen=True)
class WarmstartPreset:
    model: ModelPreset
    people: tuple[int, ...]
    people_weights: tuple[float, ...]
    steps: int
    batch_size: int
    lr: float
    puzzles_per_size: int
    eval_n: int
    warmup_frac: float = 0.05
    # curriculum: the first name_pool_frac of the steps draw every puzzle's names from a small pool
    # (name_pool names), which makes name copying (what a from-scratch policy learns last) emerge early
    name_pool: int = 0
    name_pool_frac: float = 0.0
    # phase 1: copy_steps of repeating random word sequences, where content-based copying (an induction
    # circuit) forms in a few hundred steps; K&K needs it to copy the puzzle's names (measured: without this
    # phase, 8M tokens of K&K alone never learned to copy names)
    copy_steps: int = 0
    weight_decay: float = 0.01
    tokenizer_corpus: int = 300  # puzzles per size used to train the BPE
    reasoning: str = "v1"  # reference reasoning style (trainers.completions.STYLES)


PRESETS: dict[str, WarmstartPreset] = {
    # seconds: for tests (trains, saves, reloads and generates; learns little)
    "tiny": WarmstartPreset(
        model=ModelPreset(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
        ),
        people=(3,),
        people_weights=(1.0,),
        steps=6,
        batch_size=4,
        lr=3e-3,
        puzzles_per_size=40,
        copy_steps=2,
        eval_n=4,
        tokenizer_corpus=40,
    ),
    # the first embedded default (v1): conclusions about 1-3 people, 1,200 steps (docs/warmstart_v1/seed0.json)
    "cpu_v1": WarmstartPreset(
        model=ModelPreset(
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
        ),
        people=(3, 4, 5, 6, 7),
        people_weights=(0.4, 0.25, 0.15, 0.1, 0.1),
        steps=1200,
        batch_size=32,
        lr=2e-3,
        puzzles_per_size=5000,
        eval_n=100,
        copy_steps=600,
    ),
    # one modern GPU: a wider, deeper model trained longer
    "gpu": WarmstartPreset(
        model=ModelPreset(
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
        ),
        people=(3, 4, 5, 6, 7),
        people_weights=(0.2, 0.2, 0.2, 0.2, 0.2),
        steps=20000,
        batch_size=64,
        lr=6e-4,
        puzzles_per_size=50000,
        copy_steps=2000,
        eval_n=100,
    ),
}


# second version (docs/warmstart_v2/): reasoning about 2..N people in varied orders with varied openers, a
# 3-person-heavier mix, 700 steps; closer to an LLM's probability histogram but less accurate (not shipped)
PRESETS["cpu_v2"] = replace(
    PRESETS["cpu_v1"],
    people_weights=(0.5, 0.2, 0.1, 0.1, 0.1),
    steps=700,
    puzzles_per_size=10000,
    copy_steps=500,
    reasoning="v2",
)


# third version: the reasoning restates claims and decides no role before the answer (style v3), 2-person puzzles
# join the mix (the smallest logic first), 3 people weighted most; evaluated on 3..7 people as the others
PRESETS["cpu_v3"] = replace(
    PRESETS["cpu_v1"],
    people=(2, 3, 4, 5, 6, 7),
    people_weights=(0.15, 0.4, 0.2, 0.1, 0.075, 0.075),
    steps=1800,
    puzzles_per_size=10000,
    copy_steps=500,
    reasoning="v3",
)


# fourth version: v3 with interjections (more free choices per token), trained longer
PRESETS["cpu_v4"] = replace(PRESETS["cpu_v3"], steps=2000, reasoning="v4")


# fifth version: twice v4's interjections, trained longer still
PRESETS["cpu_v5"] = replace(PRESETS["cpu_v3"], steps=2400, reasoning="v5")


# sixth version: v5 with more 3-person puzzles in the mix, trained longer (v5's loss was still falling)
PRESETS["cpu_v6"] = replace(PRESETS["cpu_v5"], people_weights=(0.1, 0.5, 0.15, 0.1, 0.075, 0.075), steps=2750)


# seventh version: v6's data on a deeper model (6 layers: 1.6 M parameters), for the logic the answer needs
PRESETS["cpu_v7"] = replace(
    PRESETS["cpu_v6"], model=replace(PRESETS["cpu_v6"].model, num_hidden_layers=6), steps=1900
)


# eighth version: v6's mix and steps, interjections ending in ".", "!" or "..." (reasoning style v6): the token after
# an interjection becomes a free choice too
PRESETS["cpu_v8"] = replace(PRESETS["cpu_v6"], reasoning="v6")


# the embedded default (shipped in tokendyn/default_policy/: seed 1 of the three trained; warmstart.json there holds its
# numbers and the target table of every seed trained)
DEFAULT_CPU_PRESET = "cpu_v8"


PRESETS["cpu"] = PRESETS[DEFAULT_CPU_PRESET]


def canonical_preset(name: str) -> str:
    """The versioned name of a preset: ``cpu`` is an alias of the current default's version, and records name the
    version (they still name their recipe after the default moves on)."""
    return DEFAULT_CPU_PRESET if name == "cpu" else name


def eval_sizes(preset: WarmstartPreset) -> list[int]:
    """The sizes a warm start is evaluated on: its training sizes from 3 people up (the official test sets)."""
    return [n for n in preset.people if n >= 3] or list(preset.people)


def check_preset(name: str) -> WarmstartPreset:
    if name not in PRESETS:
        raise ValueError(f"preset: must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
