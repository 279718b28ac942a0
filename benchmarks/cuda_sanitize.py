"""Small fwd + bwd problems through the cuda backend, for compute-sanitizer (memcheck, racecheck).

    compute-sanitizer --tool memcheck python benchmarks/cuda_sanitize.py
"""
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attnx  # noqa: E402,F401
from attnx.autograd import run  # noqa: E402
from attnx.problem import make_problem  # noqa: E402
from attnx.registry import _import_builtin_backends  # noqa: E402

_import_builtin_backends()
BACKEND = importlib.import_module("attnx.backends.cuda").BACKEND

CASES = [
    dict(dtype=torch.float16, hq=4, hkv=2, sq=70, sk=130, d=64, causal=True),
    dict(dtype=torch.bfloat16, hq=2, hkv=2, sq=129, sk=65, d=128, softcap=10.0, alibi=True, window=(20, 5)),
    dict(dtype=torch.bfloat16, hq=2, hkv=1, sq=33, sk=47, d=256, layout="bshd"),
    dict(dtype=torch.float16, hq=2, hkv=2, sq=50, sk=50, d=40, dv=24),
]

for c in CASES:
    layout = c.get("layout", "bhsd")
    dv = c.get("dv", c["d"])

    def mk(h, s, w):
        shape = (1, s, h, w) if layout == "bshd" else (1, h, s, w)
        return torch.randn(*shape, device="cuda", dtype=c["dtype"]).requires_grad_(True)
    q, k, v = mk(c["hq"], c["sq"], c["d"]), mk(c["hkv"], c["sk"], c["d"]), mk(c["hkv"], c["sk"], dv)
    slopes = torch.rand(c["hq"], device="cuda") if c.get("alibi") else None
    p = make_problem(q, k, v, causal=c.get("causal", False), window=c.get("window"), softcap=c.get("softcap"),
                     alibi_slopes=slopes, layout=layout)
    out, lse = run(p, BACKEND, q, k, v, None, slopes)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("ok", {k: v for k, v in c.items() if k != "dtype"}, flush=True)
