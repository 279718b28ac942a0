"""The decode timings of benchmarks/cuda_decode.py (`time`) and the pieces its sweeps share.

Llama-3-8B decode steps on fresh random inputs (`llama_decode_inputs`), paged copies of a dense cache
(`paged_copy`), kernels replayed from CUDA graphs (`graphed`), and `time_all`: GB/s of K+V read once for
SDPA's kernels, FlexAttention, the cuda decode kernel in each key format, triton and the dispatcher's pick.
"""
from __future__ import annotations

import torch

from .backward_check import bench


def paged_copy(k, v, page_size, heads_major: bool = False):
    """The dense (B, Hkv, S, D) cache as a page pool (num_pages, page_size, Hkv, D) in shuffled page order
    and its table. `heads_major`: the pool stored (num_pages, Hkv, page_size, D) (a page's rows of one head
    adjacent, as FlashInfer's HND layout) and passed as its (num_pages, page_size, Hkv, D) view."""
    b, h, s, d = k.shape
    pages = s // page_size
    perm = torch.randperm(b * pages, device=k.device)
    pools = []
    for t in (k, v):
        if heads_major:
            pool = torch.empty(b * pages, h, page_size, d, device=t.device, dtype=t.dtype)
            pool[perm] = t.reshape(b, h, pages, page_size, d).permute(0, 2, 1, 3, 4).reshape(b * pages, h, page_size, d)
            pools.append(pool.transpose(1, 2))
        else:
            pool = torch.empty(b * pages, page_size, h, d, device=t.device, dtype=t.dtype)
            pool[perm] = t.reshape(b, h, pages, page_size, d).permute(0, 2, 3, 1, 4).reshape(b * pages, page_size, h, d)
            pools.append(pool)
    return pools[0], pools[1], perm.reshape(b, pages).to(torch.int32)


# Key formats of the decode timings: "dense"; "cache" (B, Hkv, S, D) with lengths; "cache-tok" the same keys
# stored token-major (B, S, Hkv, D), as `attnx.KVCache.allocate` stores them; "pagedN" a pool of N-token pages
# (num_pages, N, Hkv, D); "pagedN-hnd" that pool stored heads-major (`paged_copy`).
def format_kind(fmt: str) -> tuple[str, int | None]:
    """(the Problem's kv_format, page size or None) of a timing format name."""
    base = fmt.split("-")[0]
    if base.startswith("paged"):
        return "paged", int(base[5:])
    return base, None


def format_keys(fmt: str, k, v, lens):
    """(k, v, keyword arguments) of `attnx.attention` for the (B, Hkv, S, D) keys `k`, `v` in format `fmt`."""
    kind, page_size = format_kind(fmt)
    if kind == "dense":
        return k, v, {}
    if kind == "paged":
        kk, vv, table = paged_copy(k, v, page_size, heads_major=fmt.endswith("-hnd"))
        return kk, vv, dict(seqlens_k=lens, page_table=table)
    if fmt.endswith("-tok"):  # a token-major copy, passed as its (B, Hkv, S, D) view
        k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    return k, v, dict(seqlens_k=lens)


def graphed(fn):
    """`fn` captured in a CUDA graph (warmed up first: compiles and autotuning stay outside), as its replay;
    None (with a line) where capture fails."""
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as err:
        print(f"  (graph capture failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
              flush=True)
        return None


DEFAULT_TOLERANCE = 2e-2  # bf16 outputs of magnitude < 1 (their rounding is 4e-3) against float32


def default_error(q, k, v, out) -> float:
    """Max abs error of the default path's `out` against the float32 formula on the first and last
    sequence (every key visible: one new token, full caches)."""
    group = q.shape[1] // k.shape[1]
    worst = 0.0
    for i in {0, q.shape[0] - 1}:
        kf, vf = (t[i].float().repeat_interleave(group, 0) for t in (k, v))
        scores = q[i].float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
        ref = torch.softmax(scores, -1) @ vf
        worst = max(worst, float((out[i].float() - ref).abs().max()))
    return worst


LLAMA_HEADS = (32, 8)  # Llama-3-8B: query heads, kv heads


def llama_decode_inputs(batches, lengths, max_gb: float, head_dim: int = 128):
    """Yield (B, keys, GB of K+V, q, k, v, lengths) of a Llama-3-8B decode step (bf16, one new token, fresh
    random, on the GPU) per (B, keys); shapes with more K+V than `max_gb` are skipped with a line. The
    caller drops its references at the end of each step: the next step's tensors come after an
    `empty_cache`."""
    hq, hkv = LLAMA_HEADS
    for b in batches:
        for s in lengths:
            gbytes = 2 * b * hkv * s * head_dim * 2 / 1e9  # K + V read once
            if gbytes > max_gb:
                print(f"{b:>3} {s:>7} (skipped: {gbytes:.0f} GB of K+V > --max-gb {max_gb})", flush=True)
                continue
            q = torch.randn(b, hq, 1, head_dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, hkv, s, head_dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
            yield b, s, gbytes, q, k, v, lens
            q = k = v = lens = None
            torch.cuda.empty_cache()


TIME_FORMATS = ("dense", "cache", "paged16", "paged1")


def time_all(batches, lengths, max_gb: float, fused: bool = False, formats=TIME_FORMATS) -> None:
    """Llama-3-8B decode (32 q heads, 8 kv heads, d128, bf16, one new token): GB/s of K+V read once,
    kernels replayed from a CUDA graph (the Python call is not what is compared); `eager` rows add it.
    torch's kernels (SDPA's three, FlexAttention) run the dense problem: they take no cache lengths or
    page tables. `fused`: the launcher's kernel with FUSED_COMBINE too, where keys are split."""
    import attnx
    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch_decode
    from attnx.problem import make_call
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .flex_rows import flex_decode

    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'B':>3} {'Sk':>7} {'format':<8} {'kernel':<22} {'ms':>8} {'GB/s':>8} {'splits':>6}")
    for b, s, gbytes, q, k, v, lens in llama_decode_inputs(batches, lengths, max_gb):

        def row(fmt, name, fn, splits="", eager=False):
            replay = fn if eager else graphed(fn)
            ms = bench(replay) if replay is not None else float("nan")
            print(f"{b:>3} {s:>7} {fmt:<8} {name + (' (eager)' if eager else ''):<22} {ms:8.3f} "
                  f"{gbytes / ms * 1e3:8.0f} {splits!s:>6}", flush=True)

        for name, kind in (("sdpa-default", None), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(kind=kind):
                if kind is None:
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                with sdpa_kernel(kind):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            row("dense", name, sdpa)
        flex = flex_decode(q, k, v)  # FlexAttention has no cache lengths or pages: dense rows only
        if flex is not None:
            row("dense", "flex", flex, f"err {default_error(q, k, v, flex()):.1e}")
        for fmt in formats:
            kk, vv, kw = format_keys(fmt, k, v, lens)
            p, x = make_call(q, kk, vv, grad_inputs=(), **kw)
            p = p._replace(arch=f"sm_{major}{minor}")
            xv = backend_view(p, x)
            plan = launch_decode.prepare(p, xv, sms)
            splits = plan.splits
            row(fmt, "cuda decode", lambda: launch_decode.forward(p, xv), splits)
            twin = plan.variant._replace(fused_combine=True) if fused and not plan.variant.fused_combine else None
            plan = None  # (it holds the pools)
            if twin is not None and splits > 1:
                row(fmt, "cuda decode +fused", lambda: launch_decode.forward(p, xv, variant=twin), splits)
            if fmt in ("dense", "paged16"):
                row(fmt, "cuda decode", lambda: launch_decode.forward(p, xv), splits, eager=True)
            row(fmt, "triton", lambda: attnx.attention(q, kk, vv, backend="triton", **kw))
            # what users get: the dispatcher's pick through the public call, checked, then timed
            pick = attnx.explain(q, kk, vv, **kw).chosen
            err = default_error(q, k, v, attnx.attention(q, kk, vv, **kw))
            row(fmt, f"default={pick}", lambda: attnx.attention(q, kk, vv, **kw), f"err {err:.1e}")
            row(fmt, f"default={pick}", lambda: attnx.attention(q, kk, vv, **kw), f"err {err:.1e}", eager=True)
            if not err <= DEFAULT_TOLERANCE:
                raise AssertionError(f"B={b} Sk={s} {fmt}: the default ({pick}) is {err:.2e} off the float32 "
                                     f"formula (tolerance {DEFAULT_TOLERANCE})")
            kk = vv = None  # the pools go before the next format's
        q = k = v = lens = None  # (llama_decode_inputs frees them before the next step's)
