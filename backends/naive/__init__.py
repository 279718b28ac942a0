"""The naive backend: SPEC.md's formula with the whole score matrix in memory."""
from .backend import BACKEND, NaiveBackend

__all__ = ["BACKEND", "NaiveBackend"]
