"""attnx behind the APIs existing code already calls.

* `scaled_dot_product_attention`: ``torch.nn.functional.scaled_dot_product_attention``'s
  signature and semantics; `use_attnx_for_sdpa` routes unmodified code's calls through it.
* ``attnx.compat.flash_attn``: flash-attn 2.x's ``flash_attn_func``, ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache`` and the packed variants (``import attnx.compat.flash_attn as flash_attn``).
* ``attnx.compat.transformers.register()``: ``attn_implementation="attnx"`` for Hugging Face
  transformers models (imports transformers only when called).

See docs/integration.md.
"""
from .errors import CompatArgumentError, CompatTypeError
from .sdpa import scaled_dot_product_attention
from .sdpa_override import use_attnx_for_sdpa

__all__ = ["scaled_dot_product_attention", "use_attnx_for_sdpa", "CompatArgumentError", "CompatTypeError"]
