"""FlexAttention beside attnx in the serving benchmarks (decode, packed prefill), as issue-style tables ask.

FlexAttention has no cache-length or page-table inputs of its own, so it is timed where it computes the
same function: dense K/V for a decode step (every key visible) and, for packed sequences, the packed
tokens as one batch row with a document mask (a query sees its own sequence's keys; causal within it).
Compiled once per shape family through `peers.FlexPeer` (dynamic shapes, raised recompile limits). Each
builder returns a callable timing one call, or None with a printed line where compiling or running
failed (a row that cannot run must not end the table).
"""
from __future__ import annotations

import torch


def _compiled():
    from .peers import FlexPeer

    return FlexPeer._flex()


def _first_call(fn, what: str):
    """`fn` after one call (compiles outside the timing), or None with a line saying why it cannot run."""
    try:
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception as err:  # noqa: BLE001 - a peer that fails is reported, the table goes on
        print(f"  ({what}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})", flush=True)
        return None


def flex_decode(q, k, v):
    """Dense decode: q (B, Hq, Sq, D) against k, v (B, Hkv, Sk, D), every key visible, GQA by
    `enable_gqa`."""
    flex = _compiled()
    gqa = q.shape[1] != k.shape[1]
    return _first_call(lambda: flex(q, k, v, enable_gqa=gqa), "flex decode")


def flex_document(q, k, v, lens, causal: bool):
    """Packed sequences: q (total, Hq, D), k, v (total, Hkv, D) with per-sequence `lens`, as one batch row
    (1, H, total, D) under a document mask (causal inside a sequence: Sq == Sk there, so top-left and
    bottom-right agree). The block mask is built outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled()
    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device),
                                  torch.tensor(lens, device=q.device))

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    try:
        block_mask = create_block_mask(same_document_causal if causal else same_document, None, None, total, total,
                                       device=q.device)
    except Exception as err:  # noqa: BLE001
        print(f"  (flex block mask: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        return None
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    return _first_call(lambda: flex(qb, kb, vb, block_mask=block_mask, enable_gqa=gqa), "flex document mask")


def packed_out(out: torch.Tensor) -> torch.Tensor:
    """A `flex_document` call's (1, Hq, total, Dv) output as packed (total, Hq, Dv)."""
    return out[0].transpose(0, 1)
