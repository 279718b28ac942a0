"""The tensors of one call (`Inputs`) and their gradients (`Grads`).

`Problem` is the hashable signature a backend decides from; `Inputs` carries the
tensors that go with it, by name. Every layer between `attnx.attention` and a
backend (autograd, the torch.compile custom ops, plans) moves an `Inputs` as a
whole, so adding a tensor to the contract is adding one field here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class Inputs:
    """The tensors of one attention call.

    What a backend receives (`Backend.forward` / `Backend.backward`):
      * dense format: ``q``, ``k``, ``v`` as ``(B, H, S, D)`` views in any strides (the
        caller's ``bshd`` tensors transposed, never copied); ``mask`` None or a view
        expanded to ``(B, Hq, Sq, Sk)`` (zero strides where it broadcasts);
        ``alibi_slopes`` None or a float32 ``(B, Hq)`` view;
      * ``sinks`` None or float32 ``(Hq,)``;
      * varlen q: ``q`` ``(total_q, Hq, D)`` with int32 ``cu_seqlens_q`` ``(B + 1,)``;
      * varlen kv: ``k``/``v`` ``(total_k, Hkv, D)`` with int32 ``cu_seqlens_k``;
      * cache kv: ``k``/``v`` dense ``(B, Hkv, Smax, D)`` views with int32 ``seqlens_k`` ``(B,)``;
      * paged kv: ``k``/``v`` page pools ``(num_pages, page_size, Hkv, D)``, int32
        ``page_table`` ``(B, max_pages)`` and ``seqlens_k``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Optional[Tensor] = None
    alibi_slopes: Optional[Tensor] = None
    sinks: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    seqlens_k: Optional[Tensor] = None
    page_table: Optional[Tensor] = None

    # inputs that can receive gradients (the integer index tensors never do)
    DIFFERENTIABLE = ("q", "k", "v", "mask", "sinks")

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return _INPUT_FIELDS

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, n) for n in self.field_names())

    def present(self) -> tuple[str, ...]:
        """The names of the fields that are not None, in field order."""
        return tuple(n for n in _INPUT_FIELDS if getattr(self, n) is not None)

    @classmethod
    def from_tuple(cls, values) -> "Inputs":
        return cls(*values)

    def replace(self, **changes) -> "Inputs":
        return dataclasses.replace(self, **changes)


_INPUT_FIELDS = tuple(f.name for f in dataclasses.fields(Inputs))


@dataclass
class Grads:
    """Gradients of the differentiable inputs; None where an input needs none.

    A backend returns ``dq``, ``dk``, ``dv`` in the shapes of the ``q``, ``k``, ``v`` it was
    given; ``dmask`` (only when ``p.mask_requires_grad``) of shape ``p.mask_shape``, the
    gradient summed over the dimensions where the mask broadcasts; ``dsinks`` (only when
    ``p.has_sinks``) float32 ``(Hq,)``.
    """

    dq: Optional[Tensor] = None
    dk: Optional[Tensor] = None
    dv: Optional[Tensor] = None
    dmask: Optional[Tensor] = None
    dsinks: Optional[Tensor] = None

    def of(self, name: str) -> Optional[Tensor]:
        """The gradient of input `name` ("q", "mask", ...)."""
        return getattr(self, "d" + name)


def sinks_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """Gradient of the sinks from the forward's ``lse`` and ``delta = rowsum(dout * out)``.

    A sink is a key of score ``sink_h`` and value 0, so its probability in row i is
    ``exp(sink_h - lse_i)`` and ``d sink_h = -sum_i exp(sink_h - lse_i) * delta_i``, over
    every row of head h. ``lse`` and ``delta`` are ``(..., Hq, rows)`` with heads second to last.
    """
    lse = lse.float()
    weight = torch.exp(sinks.float()[:, None] - lse)
    # a sink of -inf is no sink: its row may have lse = -inf too, and exp(-inf + inf) is NaN
    total = -torch.where(lse == float("-inf"), 0.0, weight * delta.float())
    return total.movedim(-2, 0).reshape(total.shape[-2], -1).sum(dim=1)  # every row of each head
