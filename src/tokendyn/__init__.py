"""tokendyn: which tokens drive the update in RL on language models."""

__version__ = "0.1.0"
