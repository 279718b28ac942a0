"""attnx: exact FlashAttention-style attention for every device, from Python.

    out = attnx.attention(q, k, v, causal=True)

See `attnx.attention` for the arguments, `attnx.explain` for the dispatcher's
decision, `attnx.use_backend` to restrict it, and ``python -m attnx.doctor``.
"""
__version__ = "0.1.0"

from .api import attention, explain
from .autograd import alloc_out, sum_to_shape
from .backend import Backend
from .dispatch import Decision
from .errors import AttnxError, InvalidArgumentError, InvalidTypeError, NoBackendError
from .problem import Problem, make_problem
from .registry import get_backend, list_backends, register_backend, registered_backends
from .selection import use_backend

__all__ = [
    "attention", "explain", "use_backend", "list_backends", "register_backend", "get_backend", "registered_backends",
    "Backend", "Problem", "Decision", "make_problem", "alloc_out", "sum_to_shape",
    "AttnxError", "InvalidArgumentError", "InvalidTypeError", "NoBackendError", "__version__",
]
