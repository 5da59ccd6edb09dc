"""The package version (a leaf: the CLI and run.json read it without importing the package root)."""

__version__ = "0.1.0"
