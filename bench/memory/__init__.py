"""The memory model behind `bench/probe_memory.py`, by job: `measure` (the allocator's peak, the models and batches,
each component's peak at one size), `fit` (features in bytes and the least-squares fit), `predict` (Qwen2.5-7B on 8
GPUs with FSDP2, and the report). The other bench scripts use its models and formulas from here (bench/ is on
their path as the folder of the script run)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, as for bench/probe_memory.py

from .fit import Fit, HeadFit, ProbeFit, features, fit_all, load_fits, run  # noqa: E402
from .measure import DELTA, EPS_HIGH, EPS_LOW, Size, build_model, gb, make_batch, mb, self_check  # noqa: E402
from .predict import HELD_OUT_TARGET, predict_7b, report  # noqa: E402

__all__ = [
    "DELTA",
    "EPS_HIGH",
    "EPS_LOW",
    "HELD_OUT_TARGET",
    "Fit",
    "HeadFit",
    "ProbeFit",
    "Size",
    "build_model",
    "features",
    "fit_all",
    "gb",
    "load_fits",
    "make_batch",
    "mb",
    "predict_7b",
    "report",
    "run",
    "self_check",
]
