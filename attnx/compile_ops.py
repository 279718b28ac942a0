"""torch.library custom ops, so `torch.compile(fullgraph=True)` traces attnx without graph breaks.

Eager calls do not come through here (a custom op costs ~20 us a call on a CPU);
`attnx.attention` routes through these ops only while torch.compile traces. The ops'
schemas are generated from the fields of `Inputs` and the `SCALARS` table below, so a
new tensor in the contract reaches torch.compile without an edit here. The op
implementations run the same validation, dispatch and backend as eager calls.
"""
from __future__ import annotations

import torch

from .autograd import run_backward, run_forward
from .dispatch import choose
from .empty import empty_attention
from .inputs import Grads, Inputs
from .problem import grad_names, make_call

# The non-tensor options of a call as the ops carry them: (name, schema type).
SCALARS = (("causal", "bool"), ("window_left", "int?"), ("window_right", "int?"), ("offset", "int?"),
           ("scale", "float?"), ("softcap", "float?"), ("layout", "str"), ("max_seqlen_q", "int?"),
           ("max_seqlen_k", "int?"), ("deterministic", "bool?"), ("backend", "str"), ("grads", "bool[]"))
_TENSORS = Inputs.field_names()
_REQUIRED = ("q", "k", "v")
_GRAD_NAMES = tuple(n for n in _TENSORS if n in Inputs.DIFFERENTIABLE)


def _tensor_schema(names) -> str:
    return ", ".join(f"Tensor{'' if n in _REQUIRED else '?'} {n}" for n in names)


def _scalar_schema() -> str:
    return ", ".join(f"{t} {n}" for n, t in SCALARS)


_lib = torch.library.Library("attnx", "FRAGMENT")
_lib.define(f"attention_fwd({_tensor_schema(_TENSORS)}, {_scalar_schema()}) -> (Tensor, Tensor)")
_lib.define(f"attention_bwd({_tensor_schema(_TENSORS)}, Tensor out, Tensor lse, Tensor dout, {_scalar_schema()}) "
            f"-> ({', '.join('Tensor' for _ in _GRAD_NAMES)})")


def _call(tensors, scalars) -> tuple:
    """(Problem, Inputs, backend name) from the ops' flat arguments."""
    s = dict(zip((n for n, _ in SCALARS), scalars))
    options = dict(zip(_TENSORS, tensors))
    q, k, v = options.pop("q"), options.pop("k"), options.pop("v")
    p, x = make_call(q, k, v, causal=s["causal"], window=(s["window_left"], s["window_right"]), offset=s["offset"],
                     scale=s["scale"], softcap=s["softcap"], layout=s["layout"], max_seqlen_q=s["max_seqlen_q"],
                     max_seqlen_k=s["max_seqlen_k"], deterministic=s["deterministic"],
                     grad_inputs=[name for name, wanted in zip(_GRAD_NAMES, s["grads"]) if wanted], **options)
    return p, x, s["backend"] or None


def _fwd_impl(*args):
    n = len(_TENSORS)
    p, x, backend = _call(args[:n], args[n:])
    if p.is_empty:
        return empty_attention(p, x)
    with torch.no_grad():
        out, lse = run_forward(p, choose(p, backend), x)
    return out.contiguous(), lse.contiguous()


def _bwd_impl(*args):
    n = len(_TENSORS)
    out, lse, dout = args[n:n + 3]
    p, x, backend = _call(args[:n], args[n + 3:])
    if p.is_empty:
        grads = Grads(*(torch.zeros_like(t) if (t := getattr(x, name)) is not None else None
                        for name in _GRAD_NAMES))
    else:
        grads = run_backward(p, choose(p, backend), x, out, lse, dout)
    # the gradients asked for, contiguous (the fake below promises that); empty placeholders for the others
    wanted = args[-1]
    return tuple(grads.of(name).contiguous() if flag else x.q.new_empty((0,))
                 for name, flag in zip(_GRAD_NAMES, wanted))


_lib.impl("attention_fwd", _fwd_impl, "CompositeExplicitAutograd")
_lib.impl("attention_bwd", _bwd_impl, "CompositeExplicitAutograd")


def _out_shapes(x: Inputs, layout: str) -> tuple[tuple, tuple]:
    """Shapes of out and lse from the tensors' shapes alone (fake tensors have no values)."""
    q, v = x.q, x.v
    dv = v.shape[-1]
    if x.cu_seqlens_q is not None:
        return (q.shape[0], q.shape[1], dv), (q.shape[1], q.shape[0])
    if layout == "bshd":
        b, s, h, _ = q.shape
        return (b, s, h, dv), (b, h, s)
    b, h, s, _ = q.shape
    return (b, h, s, dv), (b, h, s)


@torch.library.register_fake("attnx::attention_fwd")
def _fwd_fake(*args):
    n = len(_TENSORS)
    x = Inputs.from_tuple(args[:n])
    layout = args[n + [name for name, _ in SCALARS].index("layout")]
    out_shape, lse_shape = _out_shapes(x, layout)
    return x.q.new_empty(out_shape), x.q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("attnx::attention_bwd")
def _bwd_fake(*args):
    n = len(_TENSORS)
    x = Inputs.from_tuple(args[:n])
    wanted = args[-1]  # the "grads" flags, one per name in _GRAD_NAMES
    return tuple(x.q.new_empty(getattr(x, name).shape, dtype=getattr(x, name).dtype) if flag
                 else x.q.new_empty((0,)) for name, flag in zip(_GRAD_NAMES, wanted))


def _setup_context(ctx, inputs, output):
    n = len(_TENSORS)
    ctx.scalars = inputs[n:]
    ctx.save_for_backward(*inputs[:n], *output)


def _backward(ctx, dout, _dlse):
    n = len(_TENSORS)
    *tensors, out, lse = ctx.saved_tensors
    grads = torch.ops.attnx.attention_bwd(*tensors, out, lse, dout, *ctx.scalars)
    by_name = dict(zip(_GRAD_NAMES, grads))
    needs = ctx.needs_input_grad[:n]
    return tuple(by_name[name] if name in by_name and needs[i] else None for i, name in enumerate(_TENSORS)) \
        + (None,) * len(SCALARS)


torch.library.register_autograd("attnx::attention_fwd", _backward, setup_context=_setup_context)


def traced_attention(q, k, v, options: dict, backend):
    """The call `attnx.attention` makes while torch.compile traces it."""
    tensors = dict(options, q=q, k=k, v=v)
    window = options["window"]
    window_left, window_right = (None, None) if window is None else window
    wanted = grad_names(Inputs(*(tensors[n] for n in _TENSORS)))
    scalars = dict(options, window_left=window_left, window_right=window_right, backend=backend or "",
                   grads=[name in wanted for name in _GRAD_NAMES],
                   scale=None if options["scale"] is None else float(options["scale"]),
                   softcap=None if options["softcap"] is None else float(options["softcap"]))
    return torch.ops.attnx.attention_fwd(*(tensors[n] for n in _TENSORS), *(scalars[n] for n, _ in SCALARS))
