"""Does compute-sanitizer's initcheck see what a TMA store writes? (issue 13: the grid's initcheck findings)

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python -m benchmarks.initcheck_probe out
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python -m benchmarks.initcheck_probe lse

One Hopper forward (d128, bf16, B1 H2 S256) through the cuda backend; the kernel writes out with
`cp.async.bulk.tensor` stores and lse with `st.global` from registers. The probe then reads one of them
with a torch kernel and checks the values against the float64 formula, so a run that reports
"uninitialized" reads of `out` while the values are right (and none for `lse`) shows the tool does not
track bulk-tensor stores, rather than that the kernel leaves memory unwritten. Needs an sm_90 GPU.

Without the caching allocator every tensor is fresh device memory that nothing but its producer wrote.
The first probe (2026-12-02, run 2: 0 reports for out) ran with the allocator and made q, k, v as
float32 randn cast to bf16: out reused a freed float32 temporary that randn had written, so it said
nothing about TMA stores. q, k, v are now drawn in bf16 directly.
"""
from __future__ import annotations

import sys

import torch

import attnx
from attnx.reference import attention_reference


def main(which: str) -> int:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = attnx.attention(q, k, v, backend="cuda", return_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), scale=128 ** -0.5,
                                           compute_dtype=torch.float64)
    read = out.float() if which == "out" else lse.float()  # the one read initcheck watches
    want = ref_out if which == "out" else ref_lse
    err = (read.double() - want).abs().max().item()
    torch.cuda.synchronize()
    good = err < (2e-2 if which == "out" else 1e-3)
    print(f"probe {which}: max error {err:.2e} vs float64 -> {'ok' if good else 'WRONG'}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "out"))
