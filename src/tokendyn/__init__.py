"""tokendyn: which tokens drive the update in RL on language models.

``tokendyn.load_run(run_dir)`` opens a run directory's records (`tokendyn.analysis.run`); it is imported on first
use, so that ``import tokendyn`` (and the CLI's start) stays light.
"""

__version__ = "0.1.0"

__all__ = ["Run", "__version__", "load_run"]


def __getattr__(name: str):
    if name in ("load_run", "Run"):
        from tokendyn.analysis import run

        return getattr(run, name)
    raise AttributeError(f"module 'tokendyn' has no attribute {name!r}")
