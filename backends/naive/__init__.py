"""The naive backend: the formula of docs/semantics.md with the whole score matrix in memory."""
from .backend import BACKEND, NaiveBackend

__all__ = ["BACKEND", "NaiveBackend"]
