"""The version, in one place (pyproject.toml reads it; torch-free)."""

__version__ = "0.1.0"
