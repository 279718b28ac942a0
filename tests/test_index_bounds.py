"""Whatever the index tensors hold, no backend reads or writes outside its buffers (issue 10, item 5).

Garbage `cu_seqlens_*`, `seqlens_k` and `page_table` values (negative, huge, falling, past the
end) go to every backend that runs on a CPU: `naive`, `blocked`, and `triton` through Triton's
interpreter (`TRITON_INTERPRET=1`, in a subprocess: this file run as a script). The results for
garbage are unspecified; what is checked:

* inputs sit inside larger buffers whose every other element is NaN (each dimension padded on
  both sides): a read outside an input tensor reads NaN, and since every value inside is finite,
  a NaN anywhere in ``out``, ``lse`` or a gradient means a read outside the inputs;
* every buffer `triton`'s launcher allocates (``out``, ``lse``, the split-KV partials, ``delta``,
  ``dq``/``dk``/``dv``) is carved from the middle of a larger one whose ends hold a sentinel: a
  sentinel changed means a write outside the buffer;
* the inputs (the guard elements included) are bitwise unchanged;
* `naive` and `blocked` read the values on the host and raise `InvalidArgumentError` (never an
  untyped error); the other backends (none here) may compute anything in bounds;
* `flash_attn_with_kvcache`'s append: a garbage length or page raises before anything is written
  (the pool, every other sequence's pages included, is unchanged).

The checks were seen to fail (2026-12-01, by hand): widening any one clamp of
`backends/triton/kernels_common.py` by a single element (a cache length to capacity + 1, a page
to -1, a packed end to the packed length + 1) made cases report NaN outputs and guard writes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import attnx
from attnx.problem import make_call

ROOT = Path(__file__).resolve().parent.parent
GUARD = 2                 # NaN elements on each side of every input dimension
FLAT_GUARD = 64           # sentinel elements before and after each allocated output
SENTINEL = 1234.5
BIG, SMALL = 2**31 - 1, -2**31

B, HQ, HKV = 3, 2, 1      # one kv head: the decode kernel splits the keys (4 interpreter "SMs")
TOTAL_K, MAX_K = 30, 12
CAPACITY, PAGE, NUM_PAGES = 40, 4, 12           # 10 pages a sequence, a pool of 12


class Case(NamedTuple):
    id: str
    q_format: str          # dense, varlen
    kv_format: str         # varlen, cache, paged
    sq: int                # rows per sequence (dense q) or max_seqlen_q (packed): <= 16 runs the decode kernel
    index: dict            # name -> values
    dtype: str = "float32"
    d: int = 16
    grad: bool = True
    max_given: bool = True  # max_seqlen_* given (else computed from the garbage)
    total_q: int = 0        # packed q: its rows


def _cu(kind: str, total: int) -> list:
    return {"ok": [0, total // 3, 2 * total // 3, total],
            "falls": [0, total, 1, total],
            "negative": [-7, -1, 3, total],
            "huge": [0, BIG, SMALL, total],
            "past-end": [0, total + 5, total + 100, total + 1000],
            "short": [0, 0, 1, 1]}[kind]


def _lengths(kind: str) -> list:
    return {"ok": [5, CAPACITY, 0],
            "negative": [-5, 3, -1],
            "huge": [BIG, 3, SMALL],
            "past": [CAPACITY + 1, CAPACITY + 4, 2**30]}[kind]


def _table(kind: str) -> list:
    ok = [[(b * 10 + j) % NUM_PAGES for j in range(CAPACITY // PAGE)] for b in range(B)]
    if kind == "ok":
        return ok
    bad = {"outside": [-1, NUM_PAGES, BIG, SMALL], "negative": [-1, -2, -NUM_PAGES, -NUM_PAGES - 1]}[kind]
    return [[bad[(b + j) % len(bad)] if (b + j) % 3 != 1 else row[j] for j, _ in enumerate(row)]
            for b, row in enumerate(ok)]


def _cases() -> list:
    cases = []
    varlen = [("falls", "ok"), ("ok", "negative"), ("huge", "past-end"), ("short", "short"), ("past-end", "falls")]
    for sq in (2, 20):  # the split-KV decode kernel (<= 16 rows); the main kernel
        for cq, ck in varlen:
            cases.append(Case(f"varlen-q{cq}-k{ck}-sq{sq}", "varlen", "varlen", sq,
                              dict(cu_seqlens_q=_cu(cq, 3 * sq), cu_seqlens_k=_cu(ck, TOTAL_K)), total_q=3 * sq))
        for lengths in ("negative", "huge", "past"):
            cases.append(Case(f"cache-{lengths}-sq{sq}", "dense", "cache", sq, dict(seqlens_k=_lengths(lengths))))
        cases.append(Case(f"varlenq-cache-falls-huge-sq{sq}", "varlen", "cache", sq,
                          dict(cu_seqlens_q=_cu("falls", 3 * sq), seqlens_k=_lengths("huge")), total_q=3 * sq))
        for table, lengths in (("outside", "ok"), ("negative", "ok"), ("outside", "huge"), ("ok", "past")):
            cases.append(Case(f"paged-{table}-{lengths}-sq{sq}", "dense", "paged", sq,
                              dict(seqlens_k=_lengths(lengths), page_table=_table(table))))
        cases.append(Case(f"varlenq-paged-short-outside-sq{sq}", "varlen", "paged", sq,
                          dict(cu_seqlens_q=_cu("short", 3 * sq), seqlens_k=_lengths("negative"),
                               page_table=_table("outside")), total_q=3 * sq))
    # the tuned dense path of the main kernels (bf16, D = 64) for packed and cache formats
    cases.append(Case("varlen-huge-falls-bf16", "varlen", "varlen", 20,
                      dict(cu_seqlens_q=_cu("huge", 60), cu_seqlens_k=_cu("falls", TOTAL_K)), "bfloat16", 64,
                      total_q=60))
    cases.append(Case("cache-past-bf16", "dense", "cache", 20, dict(seqlens_k=_lengths("past")), "bfloat16", 64))
    # max_seqlen_* computed from garbage offsets (a negative or huge longest sequence)
    cases.append(Case("varlen-computed-max-negative", "varlen", "varlen", 2,
                      dict(cu_seqlens_q=[0, -3, -6, -9], cu_seqlens_k=[0, -1, -2, 30]), max_given=False, total_q=6))
    return cases


CASES = _cases()


# -- inputs inside NaN-padded buffers --------------------------------------------------------------
def _padded(shape, dtype, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): random values in the view, NaN in every padded element around it."""
    buffer = torch.full([n + 2 * GUARD for n in shape], float("nan"), dtype=dtype)
    view = buffer[tuple(slice(GUARD, GUARD + n) for n in shape)]
    view.copy_(torch.randn(shape, generator=generator).to(dtype))
    return buffer, view


def make_inputs(case: Case):
    """(tensors, options, buffers) for `case`; ``buffers`` are every input's padded storage."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    dtype = getattr(torch, case.dtype)
    q_shape = (case.total_q, HQ, case.d) if case.q_format == "varlen" else (B, HQ, case.sq, case.d)
    kv_shape = {"varlen": (TOTAL_K, HKV, case.d), "cache": (B, HKV, CAPACITY, case.d),
                "paged": (NUM_PAGES, PAGE, HKV, case.d)}[case.kv_format]
    (qb, q), (kb, k), (vb, v) = (_padded(s, dtype, gen) for s in (q_shape, kv_shape, kv_shape))
    options = {name: torch.tensor(values, dtype=torch.int32) for name, values in case.index.items()}
    if case.max_given:
        if case.q_format == "varlen":
            options["max_seqlen_q"] = case.sq
        if case.kv_format == "varlen":
            options["max_seqlen_k"] = MAX_K
    return (q, k, v), options, [qb, kb, vb] + [t for t in options.values() if isinstance(t, torch.Tensor)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise snapshot (NaN == NaN)."""
    return t.detach().clone().view(torch.uint8) if t.is_floating_point() else t.detach().clone()


# -- outputs inside sentinel-guarded buffers ----------------------------------------------------
class Guarded:
    """Allocations carved from the middle of sentinel-filled buffers (interior zeroed), all remembered."""

    def __init__(self):
        self.made: list[tuple[torch.Tensor, int]] = []  # (flat buffer, elements of the tensor)

    def like(self, shape, strides_order, dtype, device) -> torch.Tensor:
        """A tensor of `shape`, its dims laid out in `strides_order` (outermost first), guarded."""
        numel = 1
        for n in shape:
            numel *= n
        flat = torch.full((numel + 2 * FLAT_GUARD,), SENTINEL, dtype=dtype, device=device)
        flat[FLAT_GUARD:FLAT_GUARD + numel] = 0
        self.made.append((flat, numel))
        ordered = flat[FLAT_GUARD:FLAT_GUARD + numel].view([shape[i] for i in strides_order])
        inverse = sorted(range(len(shape)), key=lambda i: strides_order[i])
        return ordered.permute(inverse)

    def like_tensor(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
        return self.like(tuple(t.shape), order, dtype or t.dtype, t.device)

    def problems(self) -> list[str]:
        found = []
        for i, (flat, numel) in enumerate(self.made):
            guards = torch.cat([flat[:FLAT_GUARD], flat[FLAT_GUARD + numel:]])
            if not bool((guards == SENTINEL).all()):
                found.append(f"allocation {i} ({numel} elements): written outside")
        return found


class _GuardedTorch:
    """`torch` as the triton launcher sees it, with its allocations guarded."""

    def __init__(self, guarded: Guarded):
        self._guarded = guarded

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, shape, dtype=None, device=None, **_):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self._guarded.like(shape, list(range(len(shape))), dtype or torch.float32, device)

    def empty_like(self, t, dtype=None, **_):
        return self._guarded.like_tensor(t, dtype)

    zeros_like = empty_like  # the interior starts at 0


def run_case(case: Case, backend: str, guard_launcher: bool) -> dict:
    """``{"problems": [...], "ran": what ran}`` for `case` forward (and backward) on `backend`.

    ``problems`` is empty when everything stayed in bounds; a typed `InvalidArgumentError` is no
    problem (the backend read the values and refused them: ``ran`` is "refused").
    """
    tensors, options, buffers = make_inputs(case)
    before = [_bits(t) for t in buffers]
    guarded = Guarded()
    restore = []
    if guard_launcher:
        from attnx.backends.triton import launch

        real_alloc = launch.alloc_out
        restore = [(launch, "alloc_out", real_alloc), (launch, "torch", launch.torch)]
        launch.alloc_out = lambda p, q: guarded.like_tensor(real_alloc(p, q))
        launch.torch = _GuardedTorch(guarded)
    problems, ran = [], "nothing"
    try:
        p, x = make_call(*tensors, **options, grad_inputs=("q", "k", "v") if case.grad else ())
        chosen = attnx.get_backend(backend)
        reasons = chosen.reasons(p)
        if reasons:
            return {"problems": [f"declined: {reasons}"], "ran": "declined"}
        ran = _kernels(p) if backend == "triton" else backend
        out, lse = chosen.forward(p, x)
        results = {"out": out, "lse": lse}
        if case.grad:
            dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
            grads = chosen.backward(p, x, out, lse, dout)
            results.update(dq=grads.dq, dk=grads.dk, dv=grads.dv)
        for name, t in results.items():
            if bool(t.isnan().any()):
                problems.append(f"{name}: NaN (a read outside the inputs)")
    except attnx.InvalidArgumentError:
        ran = "refused"
    except Exception as err:  # noqa: BLE001 - any other error is a finding
        problems.append(f"{type(err).__name__}: {err}")
    finally:
        for module, name, value in restore:
            setattr(module, name, value)
    problems += guarded.problems()
    problems += [f"input buffer {i} changed" for i, (t, old) in enumerate(zip(buffers, before))
                 if not torch.equal(_bits(t), old)]
    return {"problems": problems, "ran": ran}


def _kernels(p) -> str:
    """Which triton forward kernel runs `p`: "decode/<splits>" or "main/<path>"."""
    from attnx.backends.triton import configs, launch

    if not configs.use_decode(p):
        return f"main/{configs.path_of(p)}"
    fam = configs.family(p.vendor, p.arch)
    programs = p.batch * p.heads_kv * -(-p.group_size * p.seqlen_q // configs.DECODE_BLOCK_R)
    return f"decode/{configs.decode_splits(fam, launch._sm_count('cpu', None), programs, p.seqlen_k)}"


# -- naive and blocked, in this process ---------------------------------------------------------
@pytest.mark.parametrize("backend", ["naive", "blocked"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_host_backends_refuse_garbage_in_bounds(case, backend):
    assert run_case(case, backend, guard_launcher=False) == {"problems": [], "ran": "refused"}


def test_host_backends_raise_typed_errors_for_garbage():
    """Every case holds a value a sequence would read: naive refuses each one, naming an argument."""
    for case in CASES:
        tensors, options, _ = make_inputs(case)
        with pytest.raises(attnx.InvalidArgumentError, match=r"`(cu_seqlens_[qk]|seqlens_k|page_table)`"):
            attnx.attention(*tensors, **options, backend="naive")


# -- triton, through the interpreter in a subprocess --------------------------------------------
def _interpreter_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


@pytest.fixture(scope="module")
def triton_findings(tmp_path_factory):
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("index-bounds") / "findings.json"
    proc = subprocess.run([sys.executable, __file__, str(path)], cwd=ROOT, env=_interpreter_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and path.exists(), \
        f"the interpreter run failed (a crash is a read or write outside a buffer):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(path.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_triton_stays_in_bounds(case, triton_findings):
    assert triton_findings[case.id]["problems"] == []


def test_triton_cases_ran_every_kernel(triton_findings):
    """Each case ran (no refusal: triton reads no value on the host), through the decode kernel with
    one split and several, and the main kernel on its general and dense paths (forward and backward)."""
    ran = {triton_findings[case.id]["ran"] for case in CASES}
    assert all(r.startswith(("decode/", "main/")) for r in ran), ran
    assert {"main/general", "main/dense", "decode/1"} <= ran, ran
    assert any(r.startswith("decode/") and r != "decode/1" for r in ran), ran


def test_a_read_of_a_guard_reaches_the_output(triton_findings):
    """The NaN guard works through the kernels: `k` shifted one row into its guard gives NaN."""
    assert triton_findings["_control_reads_guard"], "a read of the NaN guard went unnoticed"


def test_the_guards_notice_reads_and_writes_outside():
    guarded = Guarded()
    t = guarded.like_tensor(torch.empty(3, 4))
    assert guarded.problems() == []
    t.as_strided((1,), (1,), t.storage_offset() + t.numel()).fill_(0.0)   # one element past the end
    assert guarded.problems() == ["allocation 0 (12 elements): written outside"]
    _, view = _padded((3, 4), torch.float32, torch.Generator().manual_seed(0))
    assert bool(torch.isfinite(view).all())
    assert bool(view.as_strided((3, 4), view.stride(), view.storage_offset() - 1).isnan().any())


# -- the flash-attn drop-in's append ------------------------------------------------------------
@pytest.mark.parametrize("lengths, rows", [
    ((2, -1, 3), None), ((2, 3, 39), None), ((BIG, 0, 0), None),
    ((2, 5, 9), [[0, 1, 2], [3, -1, 5], [6, 7, 8]]),       # sequence 1's second page: -1 (would wrap)
    ((2, 5, 9), [[0, 1, 2], [3, 4, 5], [6, 7, NUM_PAGES]]),
])
def test_kvcache_append_refuses_garbage_before_writing(lengths, rows):
    from attnx.compat.flash_attn import flash_attn_with_kvcache

    paged = rows is not None
    shape = (NUM_PAGES, PAGE, HKV, 16) if paged else (B, CAPACITY, HKV, 16)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    saved = k_cache.clone(), v_cache.clone()
    extra = dict(block_table=torch.tensor(rows, dtype=torch.int32)) if paged else {}
    with pytest.raises(attnx.InvalidArgumentError, match="`(cache_seqlens|block_table)`"):
        flash_attn_with_kvcache(torch.randn(B, 1, HQ, 16), k_cache, v_cache, torch.randn(B, 2, HKV, 16),
                                torch.randn(B, 2, HKV, 16), cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                **extra)
    assert torch.equal(k_cache, saved[0]) and torch.equal(v_cache, saved[1])


def _control(case: Case) -> bool:
    """A read outside the inputs is noticed: the same case with `k` shifted one row into its guard."""
    tensors, options, _ = make_inputs(case)
    q, k, v = tensors
    shifted = k.as_strided(k.shape, k.stride(), k.storage_offset() - k.stride(0))  # row -1 .. n-2: row -1 is NaN
    from attnx.backends.triton import BACKEND

    p, x = make_call(q, shifted, v, **options)
    out, _ = BACKEND.forward(p, x)
    return bool(out.isnan().any())


if __name__ == "__main__":
    findings = {case.id: run_case(case, "triton", guard_launcher=True) for case in CASES}
    print("\n".join(f"{name}: {found}" for name, found in findings.items()))
    findings["_control_reads_guard"] = _control(Case("control", "varlen", "varlen", 2, dict(
        cu_seqlens_q=_cu("ok", 6), cu_seqlens_k=_cu("ok", TOTAL_K)), total_q=6))
    Path(sys.argv[1]).write_text(json.dumps(findings, indent=1))
