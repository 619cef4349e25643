"""The package version, in one place (`gbfunc.__version__`, written into checkpoints)."""

__version__ = "0.1.0"
