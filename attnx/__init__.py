"""attnx: exact FlashAttention-style attention for every device, from Python.

    out = attnx.attention(q, k, v, causal=True)

See `attnx.attention` for the arguments, `attnx.explain` for the dispatcher's
decision, `attnx.use_backend` to restrict it, `attnx.plan` for repeated calls,
`attnx.merge` to combine partial results, ``attnx.compat`` for drop-in SDPA, flash-attn
and transformers entry points, and ``python -m attnx.doctor``.
"""
__version__ = "0.2.0"

from .api import Plan, attention, explain, plan
from .backward_api import attention_backward
from .autograd import alloc_out, lse_shape, sum_to_shape
from .backend import Backend
from .dispatch import Decision
from .errors import AttnxError, InvalidArgumentError, InvalidTypeError, NoBackendError
from .index_checks import check_indices, validate_indices
from .inputs import Grads, Inputs
from .kvcache import CacheCapacityError, CachePlan, KVCache
from .merge import merge
from .problem import Problem, make_call, make_problem
from .registry import (get_backend, list_backends, register_backend, registered, registered_backends,
                       unregister_backend)
from .selection import use_backend

from . import compat  # noqa: E402  (cheap: imports transformers or flash-attn shims only when used)

__all__ = [
    "attention", "attention_backward", "explain", "plan", "Plan", "merge", "KVCache", "CachePlan", "CacheCapacityError",
    "use_backend", "list_backends", "register_backend", "validate_indices", "check_indices",
    "unregister_backend", "registered", "get_backend", "registered_backends", "Backend", "Problem", "Inputs",
    "Grads", "Decision", "make_call", "make_problem", "alloc_out", "lse_shape", "sum_to_shape",
    "AttnxError", "InvalidArgumentError", "InvalidTypeError", "NoBackendError", "compat", "__version__",
]
