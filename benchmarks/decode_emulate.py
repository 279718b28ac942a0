"""The cuda decode kernel's arithmetic emulated in torch on the record the launcher packs (fa_decode.cu).

`benchmarks.cuda_decode check --emulate` runs every case through `emulate` on the CPU: the launcher's
host side (`launch_decode.prepare`) is real, the kernels are this file. `check_copy_map` checks the
lane arithmetic of the K/V copies and the page lookups against the variant's shared memory.
"""
from __future__ import annotations

import torch


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every element from `t`'s first to the end of its storage, flat: what a kernel may address from its
    pointer. Indexing past it raises, so an out-of-bounds read in the emulation is an error, not a value."""
    n = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (n,), (1,))


def _at(flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """flat[offsets] as float32, raising on any offset outside [0, len(flat)) (torch would wrap a negative one)."""
    if offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) >= flat.numel()):
        raise IndexError(f"emulated read outside the buffer: offsets {int(offsets.min())}..{int(offsets.max())} "
                         f"of {flat.numel()}")
    return flat[offsets].float()


def check_copy_map(variant) -> None:
    """load_kv's and lookup_page's lane arithmetic for `variant` (fa_decode.cu): copy i of lane l is 16
    bytes of row r = (l + 32 i) / CPR, column chunk (l + 32 i) % CPR; every (row, chunk) of the BLOCK_N x
    CPR block exactly once; the page of row r is shuffled from register pair i / CPR (a compile-time index:
    it must be r / 32 for every lane) of lane r % 32, which looked up key 32 * (r / 32) + lane; the ring
    stages of every warp and Q fit the variant's shared memory."""
    bn, hd, nw, st = variant.block_n, variant.head_dim, variant.warps, variant.stages
    cpr, ld = hd // 8, hd + 8
    chunks = bn * cpr // 32
    if bn % 16 or bn > 64 or (bn * cpr) % 32 or not 2 <= st <= 4:
        raise ValueError(f"fa_decode.cu's static_asserts refuse BLOCK_N={bn} HEAD_DIM={hd} KV_STAGES={st}")
    seen = set()
    for lane in range(32):
        for i in range(chunks):
            c = lane + 32 * i
            row, col = c // cpr, c % cpr
            if row // 32 != i // cpr:
                raise AssertionError(f"lane {lane} copy {i}: row {row} in page register {row // 32}, kernel "
                                     f"reads {i // cpr}")
            if bn <= 32 and row >= 32:
                raise AssertionError("a block of <= 32 keys has one page register")
            seen.add((row, col))
    if len(seen) != bn * cpr or seen != {(r, c) for r in range(bn) for c in range(cpr)}:
        raise AssertionError(f"copies cover {len(seen)} of {bn * cpr} chunks")
    kv_ld = hd if variant.kv_swizzle else ld
    if variant.kv_swizzle:
        check_swizzle(bn, hd)
    ring = 16 * ld * 2 + nw * st * 2 * bn * kv_ld * 2
    merge = nw * 16 * ((hd + 4) * 4 + 8)
    if max(ring, merge) > variant.shared_bytes():
        raise AssertionError(f"the rings need {ring} / merge {merge} bytes, launched with {variant.shared_bytes()}")


def _page_index(keys: torch.Tensor, r) -> torch.Tensor:
    """lookup_key's page index: a shift by page_shift where the launcher gives one, else a division."""
    if r["page_shift"] >= 0:
        if 1 << r["page_shift"] != r["page_size"]:
            raise AssertionError(f"page_shift {r['page_shift']} for page size {r['page_size']}")
        return keys >> r["page_shift"]
    return keys // r["page_size"]


def kv_chunk(r: int, cc: int, hd: int) -> int:
    """fa_decode.cu `kv_chunk` with KV_SWIZZLE: the byte offset of 16-byte chunk cc of row r in a stage."""
    return r * hd * 2 + ((cc & ~7) | ((cc ^ r) & 7)) * 16


def check_swizzle(bn: int, hd: int) -> None:
    """The swizzled ring's map: a bijection onto the BLOCK_N x HD stage; each global 128-byte line (8 chunks of
    a row) on one shared 128-byte line; the 8 row addresses of every ldmatrix 8x8 matrix (8 consecutive rows
    at one chunk) in 8 different 16-byte bank groups."""
    if hd % 64:
        raise ValueError(f"KV_SWIZZLE needs whole 128-byte lines per row, HEAD_DIM={hd}")
    cpr = hd // 8
    offsets = {kv_chunk(r, c, hd) for r in range(bn) for c in range(cpr)}
    if offsets != set(range(0, bn * hd * 2, 16)):
        raise AssertionError("the swizzle does not tile the stage exactly")
    for r in range(bn):
        for line in range(cpr // 8):
            if len({kv_chunk(r, line * 8 + c, hd) // 128 for c in range(8)}) != 1:
                raise AssertionError(f"row {r}'s line {line} spans two shared lines")
    for r0 in range(0, bn, 8):
        for c in range(cpr):
            if len({(kv_chunk(r0 + i, c, hd) // 16) % 8 for i in range(8)}) != 8:
                raise AssertionError(f"ldmatrix rows {r0}..{r0 + 7} chunk {c}: bank conflict")


def emulate(plan):
    """(out_k, lse) as fa_decode.cu computes them from `plan` (launch_decode.prepare): the same blocks,
    rows, splits, warp key blocks, clamped lengths and page entries, per-warp softmax, warp merge and
    combine, in float32. Reads memory only through the record's pointers, strides and sizes. PAGE_BATCH
    (`Variant.page_batch`) changes when a block's entry is loaded, not which: block bi of a warp's `nt`
    reads the entry of its first key, as here, and no entry past the warp's blocks is loaded."""
    check_copy_map(plan.variant)
    r = {name: plan.args[name].item() for name in plan.args.dtype.names}
    by_ptr = {t.data_ptr(): t for t in plan.keep}
    mem = {name: _storage(by_ptr[r[name]]) for name in ("q", "k", "v", "seqlens_k", "page_table", "alibi", "sinks")
           if r[name]}
    inf = float("inf")
    log2e = 1.4426950408889634
    nw, bn = plan.variant.warps, plan.variant.block_n
    dv, d = r["head_dim_v"], r["head_dim"]
    sq, group = r["seqlen_q"], r["group"]
    programs = r["batch"] * r["heads_kv"] * r["row_chunks"]
    rows_out = torch.full((r["splits"], r["rows"], dv), float("nan"))
    lse_out = torch.full((r["splits"], r["rows"]), float("nan"))
    ar = torch.arange
    for blk in range(plan.grid):
        split, prog = divmod(blk, programs)
        bh, chunk = divmod(prog, r["row_chunks"])
        b, hk = divmod(bh, r["heads_kv"])
        if "page_table" in mem and r["num_pages"] <= 0:
            sk = 0
        elif "seqlens_k" in mem:
            sk = min(max(int(_at(mem["seqlens_k"], torch.tensor(b))), 0), r["capacity"])
        else:
            sk = r["capacity"]
        offset = sk - sq if r["align_br"] else r["key_offset"]
        r0 = chunk * 16
        r1 = min(r0 + 16, group * sq) - 1
        i_lo, i_hi = (r0 % sq, r1 % sq) if r0 // sq == r1 // sq else (0, sq - 1)
        key_lo = max(0, i_lo + offset - r["window_left"], split * r["split_keys"])
        key_hi = min(sk - 1, i_hi + offset + r["window_right"], split * r["split_keys"] + r["split_keys"] - 1)
        grs = ar(r0, r1 + 1)
        heads, qi = hk * group + grs // sq, grs % sq
        qoff = b * r["q_bs"] + heads * r["q_hs"] + qi * r["q_rs"]
        q = _at(mem["q"], qoff[:, None] + ar(d))  # (rows, d)
        parts = []
        for w in range(nw):
            first = key_lo // bn + w
            last = key_hi // bn if key_hi >= key_lo else key_lo // bn - 1
            blocks = list(range(first, last + 1, nw))
            keys = (torch.tensor(blocks, dtype=torch.long)[:, None] * bn + ar(bn)).reshape(-1)
            live = keys < sk
            if "page_table" in mem:
                kl = keys[live]
                if r["page_size"] % bn == 0:  # block_in_page: key n0's entry, rows n0's + r
                    n0 = kl - kl % bn
                    idx = _page_index(n0, r)
                    prow = n0 - idx * r["page_size"] + kl % bn
                else:
                    idx = _page_index(kl, r)
                    prow = kl - idx * r["page_size"]
                page = _at(mem["page_table"], b * r["pt_bs"] + idx).long().clamp(0, r["num_pages"] - 1)
                koff, voff = page * r["k_bs"] + prow * r["k_rs"], page * r["v_bs"] + prow * r["v_rs"]
                kbase, vbase = hk * r["k_hs"], hk * r["v_hs"]
            else:
                koff, voff = keys[live] * r["k_rs"], keys[live] * r["v_rs"]
                kbase, vbase = b * r["k_bs"] + hk * r["k_hs"], b * r["v_bs"] + hk * r["v_hs"]
            kt = torch.zeros(len(keys), d)
            vt = torch.zeros(len(keys), dv)
            kt[live] = _at(mem["k"], kbase + koff[:, None] + ar(d))
            vt[live] = _at(mem["v"], vbase + voff[:, None] + ar(dv))
            s = q @ kt.T * r["scale"]
            if r["softcap"] > 0:
                s = r["softcap"] * torch.tanh(s * r["softcap_inv"])
            if "alibi" in mem:
                slope = _at(mem["alibi"], b * r["alibi_bs"] + heads * r["alibi_hs"])
                s = s - slope[:, None] * (qi[:, None] + offset - keys[None, :]).abs().float()
            pos = qi[:, None] + offset
            seen = (keys[None, :] < sk) & (keys[None, :] >= pos - r["window_left"]) & \
                (keys[None, :] <= pos + r["window_right"])
            s = torch.where(seen, s * log2e, torch.tensor(-inf))
            m = torch.where(s.isnan(), torch.tensor(-inf), s).amax(1) if s.shape[1] else torch.full((len(grs),), -inf)
            shift = torch.where(m == -inf, torch.zeros_like(m), m)
            pr = torch.exp2(s - shift[:, None])
            parts.append((m, pr.sum(1), pr @ vt))
        top = torch.stack([m for m, _, _ in parts]).amax(0)
        shift = torch.where(top == -inf, torch.zeros_like(top), top)
        wts = [torch.exp2(m - shift) for m, _, _ in parts]
        total = sum(wt * l for wt, (_, l, _) in zip(wts, parts))
        acc = sum(wt[:, None] * o for wt, (_, _, o) in zip(wts, parts))
        grow = (b * r["heads_q"] + heads) * sq + qi
        sink = _at(mem["sinks"], heads) * log2e if (r["splits"] == 1 and "sinks" in mem) else \
            torch.full_like(total, -inf)
        topk = torch.maximum(shift, sink)
        keep = torch.exp2(shift - topk)
        full = total * keep + torch.exp2(sink - topk)
        empty = total == 0
        rows_out[split, grow] = torch.where(empty[:, None], torch.zeros_like(acc), acc * (keep / full)[:, None])
        lse_out[split, grow] = torch.where(empty, sink / log2e, (topk + torch.log2(full)) / log2e)
    if r["splits"] == 1:
        out, lse = rows_out[0], lse_out[0]
    else:  # the combine (one block per row, or each program's last block): the splits' parts and the sink
        if plan.combine_grid != (0 if plan.variant.fused_combine else r["rows"]):
            raise AssertionError(f"combine grid {plan.combine_grid} for {r['rows']} rows (one block per row)")
        l2 = lse_out * log2e
        sink = (mem["sinks"].float()[: r["heads_q"]] * log2e).repeat_interleave(sq).repeat(r["batch"]) \
            if "sinks" in mem else torch.full((r["rows"],), -inf)
        allp = torch.cat([l2, sink[None]])
        top = torch.where(allp.isnan(), torch.tensor(-inf), allp).amax(0)
        shift = torch.where(top == -inf, torch.zeros_like(top), top)
        total = torch.exp2(allp - shift).sum(0)
        seen = ~(total == 0)
        lse2 = torch.where(seen, shift + torch.log2(total), torch.tensor(-inf))
        base = torch.where(seen, lse2, torch.zeros_like(lse2))
        out = (torch.exp2(l2 - base)[:, :, None] * rows_out).sum(0)
        lse = lse2 / log2e
    b_, hq_ = r["batch"], r["heads_q"]
    return out.reshape(b_, hq_, sq, dv), lse.reshape(b_, hq_, sq)
