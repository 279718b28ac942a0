"""Small fwd + bwd problems through the cuda backend, for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python benchmarks/cuda_sanitize.py

On sm_90 the forwards run the Hopper family (TMA, mbarriers, wgmma), the backwards the Ampere kernels.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402
from attnx.autograd import run  # noqa: E402
from attnx.problem import make_call  # noqa: E402

BACKEND = attnx.get_backend("cuda")

CASES = [
    dict(dtype=torch.float16, hq=4, hkv=2, sq=70, sk=130, d=64, causal=True),
    dict(dtype=torch.bfloat16, hq=2, hkv=2, sq=129, sk=65, d=128, softcap=10.0, alibi=True, window=(20, 5)),
    dict(dtype=torch.bfloat16, hq=2, hkv=1, sq=33, sk=47, d=256, layout="bshd"),
    dict(dtype=torch.float16, hq=2, hkv=2, sq=50, sk=50, d=40, dv=24),
    dict(dtype=torch.float16, hq=4, hkv=2, sq=90, sk=60, d=64, causal=True, offset=-25, sinks=True),
    dict(dtype=torch.bfloat16, hq=2, hkv=2, sq=40, sk=100, d=128, window=(30, 4), offset=70, sinks=True),
    # several key blocks, so the Hopper forward's K/V ring wraps around its buffers
    dict(dtype=torch.bfloat16, hq=4, hkv=1, sq=260, sk=900, d=128, causal=True),
    dict(dtype=torch.float16, hq=2, hkv=2, sq=130, sk=400, d=192, layout="bshd"),
]

for c in CASES:
    layout = c.get("layout", "bhsd")
    dv = c.get("dv", c["d"])

    def mk(h, s, w):
        shape = (1, s, h, w) if layout == "bshd" else (1, h, s, w)
        return torch.randn(*shape, device="cuda", dtype=c["dtype"]).requires_grad_(True)
    q, k, v = mk(c["hq"], c["sq"], c["d"]), mk(c["hkv"], c["sk"], c["d"]), mk(c["hkv"], c["sk"], dv)
    slopes = torch.rand(c["hq"], device="cuda") if c.get("alibi") else None
    sinks = torch.randn(c["hq"], device="cuda").requires_grad_(True) if c.get("sinks") else None
    p, x = make_call(q, k, v, causal=c.get("causal", False), window=c.get("window"), offset=c.get("offset"),
                     softcap=c.get("softcap"), alibi_slopes=slopes, sinks=sinks, layout=layout)
    out, lse = run(p, BACKEND, x)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("ok", {k: v for k, v in c.items() if k != "dtype"}, flush=True)
