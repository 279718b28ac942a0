"""Typed errors raised by attnx."""
from __future__ import annotations


class AttnxError(Exception):
    """Base class of every error attnx raises on purpose."""


class InvalidArgumentError(AttnxError, ValueError):
    """An argument has the right type but a wrong value or shape."""


class InvalidTypeError(AttnxError, TypeError):
    """An argument has the wrong type or dtype."""


class NoBackendError(AttnxError, ValueError, RuntimeError):
    """No allowed backend accepts the problem.

    ``reasons`` maps every backend that was considered to the list of reasons it
    declined, so the message never hides all but the first failure. It is both a
    ``ValueError`` (the input is outside what the allowed backends support) and a
    ``RuntimeError`` (torch's SDPA raises that when no kernel fits).
    """

    def __init__(self, message: str, reasons: dict[str, list[str]]):
        self.reasons = reasons
        self.message = message
        lines = [message]
        for name, why in reasons.items():
            lines.append(f"  {name}: " + "; ".join(why))
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # pickling (multiprocessing, a distributed worker's error) rebuilds it from both arguments
        return type(self), (self.message, self.reasons)
