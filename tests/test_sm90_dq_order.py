"""CI (CPU): a model of the ordered dQ of the Hopper backward (kernels/sm90/fa_bwd.cu, DQ_ORDERED).

The kernel's index formulas are ported here (`queries_seeing`/`keys_seen` of common/mask.cuh, `work_of`,
`key_block_of` and the turn of a key block on a query block) and checked against brute force over the
visibility rule for causal, window, offset, GQA and ragged lengths: the key blocks that add to a query
block are exactly those whose walk visits it, they are contiguous, each one's turn is the number of
contributors above it, and every thread block it waits for has a lower blockIdx. Then the protocol
itself runs under random schedules with few resident thread blocks (in-order dispatch), on the plain
schedule and on DQ_LATE's (each addition a step late): it never deadlocks, and each query block sees its
additions in the same order on every schedule. The same model with the key blocks in ascending grid order
deadlocks (the check can fail). The opt-in rotated walk (DQ_ROTATE, for problems where every query sees
every key): its turns follow each query block's visit order, its protocol runs without deadlock when a
head's key blocks are all resident (and deadlocks when not: why the launcher asks for that), and a
lockstep model shows the chain of turns it removes. The writer-thread protocol (DQ_WRITER) under random
schedules: no deadlock, the same order. Last, the launcher with a recording stand-in for the
launch: the counters reach the kernel only for ordered variants.
"""
import random

import numpy as np
import pytest

BN = 128
UNBOUNDED = 1 << 30  # attnx.limits.UNBOUNDED_WINDOW


def cdiv0(a, b):
    """C's integer division (toward zero)."""
    return int(a / b) if a < 0 else a // b


class Vis:
    def __init__(self, sq, sk, offset, left, right):
        self.sq, self.sk, self.offset, self.left, self.right = sq, sk, offset, left, right

    def queries_seeing(self, key_first, key_last):
        return max(0, key_first - self.right - self.offset), min(self.sq - 1, key_last + self.left - self.offset)

    def keys_seen(self, row_first, row_last):
        return max(0, row_first + self.offset - self.left), min(self.sk - 1, row_last + self.offset + self.right)

    def visible(self):
        """(Sq, Sk) bool: query i sees key j."""
        pos = np.arange(self.sq)[:, None] + self.offset
        j = np.arange(self.sk)[None, :]
        return (j >= pos - self.left) & (j <= pos + self.right)


def key_block_of(rank, nblk, ordered=True):
    return nblk - 1 - rank if ordered else rank


def work_of(vis, bm, nblk, block, ordered=True):
    """(n, m_first, m_count) of thread block `block` inside its (batch, kv head), as the kernel's work_of."""
    n = key_block_of(block % nblk, nblk, ordered)
    n0 = n * BN
    q_lo, q_hi = vis.queries_seeing(n0, min(n0 + BN, vis.sk) - 1)
    m_first = cdiv0(q_lo, bm)
    m_count = cdiv0(q_hi, bm) - m_first + 1 if q_hi >= q_lo else 0
    return n, m_first, m_count


def rotation_stride(vis, bm):
    """DQ_ROTATE's k = M / N (bwd_roles.cuh rotation_stride)."""
    return (-(-vis.sq // bm)) // (-(-vis.sk // BN))


def walk(vis, bm, n, m_first, m_count, group, rotate=False):
    """The (query head, query block) steps of key block n in order (step_head, step_m0; DQ_ROTATE: each head's
    query blocks from rot = k n % m_count on, cyclically)."""
    rot = rotation_stride(vis, bm) * n % m_count if rotate and m_count else 0
    return [(h, m_first + (i + rot) % m_count) for h in range(group) for i in range(m_count)]


def turn_of(vis, bm, n, m, rotate=False):
    """The counter value key block n waits for on query block m (kernel: k_hi / BN - n0 / BN; DQ_ROTATE:
    (min(m / k, N - 1) - n) mod N)."""
    if rotate:
        nblk = -(-vis.sk // BN)
        return (min(m // rotation_stride(vis, bm), nblk - 1) - n) % nblk
    m0 = m * bm
    _, k_hi = vis.keys_seen(m0, min(m0 + bm, vis.sq) - 1)
    return cdiv0(k_hi, BN) - n


def random_problem(rng):
    sq, sk = rng.choice([1, 2, 63, 64, 65, 127, 128, 129, 200, 333, 520]), rng.choice([1, 5, 127, 128, 129, 300, 700])
    kind = rng.choice(["full", "causal", "window", "window+offset", "causal+offset"])
    offset = sk - sq  # bottom-right
    left, right = UNBOUNDED, UNBOUNDED
    if "causal" in kind:
        right = 0
    if "window" in kind:
        left, right = rng.choice([0, 1, 17, 64, 200]), rng.choice([0, 3, 64, 129])
    if "offset" in kind:
        offset = rng.randint(-sq - 10, sk + 10)
    return Vis(sq, sk, offset, left, right), rng.choice([64, 128])


def check_formulas(vis, bm):
    nblk = -(-vis.sk // BN)
    mblk = -(-vis.sq // bm)
    seen = vis.visible()
    # brute force: query block m and key block n share a visible pair
    contrib = np.zeros((mblk, nblk), bool)
    for m in range(mblk):
        for n in range(nblk):
            contrib[m, n] = seen[m * bm:(m + 1) * bm, n * BN:(n + 1) * BN].any()
    walks = {}
    for block in range(nblk):
        n, m_first, m_count = work_of(vis, bm, nblk, block)
        walks[n] = (block, set(range(m_first, m_first + m_count)))
    assert sorted(walks) == list(range(nblk))  # the reversed grid still covers every key block once
    for m in range(mblk):
        visiting = [n for n in range(nblk) if m in walks[n][1]]
        assert visiting == [n for n in range(nblk) if contrib[m, n]]  # the walks match the visibility rule
        if not visiting:
            continue
        assert visiting == list(range(visiting[0], visiting[-1] + 1))  # contiguous
        for n in visiting:
            turn = turn_of(vis, bm, n, m)
            above = [x for x in visiting if x > n]
            assert turn == len(above)
            # everything n waits for was launched before it (lower blockIdx)
            assert all(walks[x][0] < walks[n][0] for x in above)


def run_protocol(vis, bm, group, resident, rng, ordered=True, late=False, max_ticks=200000, rotate=False):
    """Thread blocks of one (batch, kv head) dispatched in blockIdx order into `resident` slots; each tick a
    random resident one advances one step if its turn has come. `late` (DQ_LATE): a step's addition waits
    until the block has begun its next step (or left the loop), local work that waits for no other block,
    modelled as a tick of its own before each addition. Returns the order of additions per (hq, m), or None
    on a deadlock."""
    nblk = -(-vis.sk // BN)
    counters, order = {}, {}
    pending = list(range(nblk))  # blockIdx order
    running = {}  # block -> [steps, position]
    for tick in range(max_ticks):
        while pending and len(running) < resident:
            block = pending.pop(0)
            n, m_first, m_count = work_of(vis, bm, nblk, block, ordered)
            steps = walk(vis, bm, n, m_first, m_count, group, rotate)
            running[block] = [n, steps, 0, not late]  # the last: the next step begun (always, unless late)
        if not running:
            return order
        ready = [b for b, (n, steps, i, begun) in running.items()
                 if i == len(steps) or not begun or counters.get(steps[i], 0) == turn_of(vis, bm, n, steps[i][1], rotate)]
        if not ready:
            return None  # every resident block waits: deadlock
        block = rng.choice(ready)
        n, steps, i, begun = running[block]
        if i == len(steps):
            del running[block]
            continue
        if not begun:
            running[block][3] = True
            continue
        running[block][3] = not late
        counters[steps[i]] = counters.get(steps[i], 0) + 1
        order.setdefault(steps[i], []).append(n)
        running[block][2] += 1
    raise AssertionError("no progress limit reached")


@pytest.mark.parametrize("seed", range(6))
def test_turns_match_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(40):
        vis, bm = random_problem(rng)
        check_formulas(vis, bm)


def test_turns_on_named_shapes():
    for vis, bm in [(Vis(1000, 1000, 0, UNBOUNDED, 0), 64), (Vis(1000, 300, -3, UNBOUNDED, 0), 64),
                    (Vis(100, 400, 0, UNBOUNDED, 0), 128), (Vis(300, 1000, 400, 64, 64), 64),
                    (Vis(1000, 1000, 0, 100, 20), 128), (Vis(1, 4096, 4095, UNBOUNDED, 0), 64),
                    (Vis(77, 1000, 923, UNBOUNDED, UNBOUNDED), 64)]:
        check_formulas(vis, bm)


@pytest.mark.parametrize("late", [False, True], ids=["plain", "dq_late"])
@pytest.mark.parametrize("seed", range(4))
def test_protocol_never_deadlocks_and_orders_each_query_block(seed, late):
    rng = random.Random(100 + seed)
    for _ in range(12):
        vis, bm = random_problem(rng)
        group = rng.choice([1, 2, 3])
        first = None
        for resident in (1, 2, 3, 8):
            order = run_protocol(vis, bm, group, resident, rng, late=late)
            assert order is not None, "deadlock"
            for key, ns in order.items():
                assert ns == sorted(ns, reverse=True)  # descending key blocks, each once
                assert len(set(ns)) == len(ns)
            first = order if first is None else first
            assert order == first  # the same order of additions on every schedule



def run_writer_protocol(vis, bm, group, resident, rng, slots=1, ordered=True, max_ticks=200000):
    """DQ_WRITER: each thread block is two agents. Its consumers stage step j's part once the staging is free
    (the writer has read part j - `slots`: dq_empty) and go on; its writer waits for step j's turn, then for
    the part (dq_full), adds it and passes the turn. Each tick a random agent that can move moves. Returns
    the order of additions per (hq, m), or None on a deadlock."""
    nblk = -(-vis.sk // BN)
    counters, order = {}, {}
    pending = list(range(nblk))
    running = {}  # block -> [n, steps, staged, added]
    for _ in range(max_ticks):
        while pending and len(running) < resident:
            block = pending.pop(0)
            n, m_first, m_count = work_of(vis, bm, nblk, block, ordered)
            running[block] = [n, walk(vis, bm, n, m_first, m_count, group), 0, 0]
        if not running:
            return order
        moves = []
        for block, (n, steps, staged, added) in running.items():
            if added == len(steps):
                moves.append((block, "leave"))
                continue
            if staged < len(steps) and staged - added < slots:
                moves.append((block, "stage"))
            if added < staged and counters.get(steps[added], 0) == turn_of(vis, bm, n, steps[added][1]):
                moves.append((block, "add"))
        if not moves:
            return None
        block, move = rng.choice(moves)
        entry = running[block]
        if move == "leave":
            del running[block]
        elif move == "stage":
            entry[2] += 1
        else:
            key = entry[1][entry[3]]
            counters[key] = counters.get(key, 0) + 1
            order.setdefault(key, []).append(entry[0])
            entry[3] += 1
    raise AssertionError("no progress limit reached")


@pytest.mark.parametrize("seed", range(4))
def test_writer_protocol_never_deadlocks_and_gives_the_same_order(seed):
    """DQ_WRITER (the deterministic twin's since 2026-12-03): with the turns taken by a writer thread and the
    consumers blocked only by the one staging buffer, no schedule deadlocks, whatever the residency, and every
    query block gets its additions in the order of the consumer-thread protocol above."""
    rng = random.Random(300 + seed)
    for _ in range(10):
        vis, bm = random_problem(rng)
        group = rng.choice([1, 2, 3])
        reference = run_protocol(vis, bm, group, 1, rng)
        for resident in (1, 2, 3, 8):
            order = run_writer_protocol(vis, bm, group, resident, rng)
            assert order is not None, "deadlock"
            assert order == reference
    # (the model can fail: key blocks in ascending grid order, one resident, wait for one never launched)
    assert run_writer_protocol(Vis(1000, 1000, 0, UNBOUNDED, UNBOUNDED), 64, 1, 1, rng, ordered=False) is None


def test_model_catches_a_deadlock():
    """Key blocks in ascending grid order with the descending turns: the first resident block waits for
    one that is never launched (the reason the kernel reverses the grid under DQ_ORDERED)."""
    vis = Vis(1000, 1000, 0, UNBOUNDED, 0)
    assert run_protocol(vis, 64, 1, 2, random.Random(0), ordered=False) is None
    assert run_protocol(vis, 64, 1, 2, random.Random(0), ordered=False, late=True) is None


# every query sees every key; at least as many query blocks as key blocks
FULL_SHAPES = [(sq, sk, bm) for bm in (64, 128) for sq in (1, 64, 65, 300, 1000, 4096)
               for sk in (1, 128, 129, 700, 1000) if -(-sq // bm) >= -(-sk // BN)]


@pytest.mark.parametrize("sq,sk,bm", FULL_SHAPES)
def test_rotated_turns_follow_the_visit_order(sq, sk, bm):
    """DQ_ROTATE on a problem where every query sees every key: every key block visits every query block once;
    on each query block the turns are a permutation of 0..N-1 that follows the order of the visits in steps,
    consecutive adders at least k = M / N steps apart (the lockstep walk puts them at the same step)."""
    vis = Vis(sq, sk, sk - sq, UNBOUNDED, UNBOUNDED)
    nblk, mblk, k = -(-sk // BN), -(-sq // bm), rotation_stride(vis, bm)
    assert k >= 1
    visits = {}  # m -> [(step, turn)] over the key blocks
    for n in range(nblk):
        _, m_first, m_count = work_of(vis, bm, nblk, nblk - 1 - n)
        assert (m_first, m_count) == (0, mblk)
        steps = walk(vis, bm, n, m_first, m_count, 1, rotate=True)
        assert sorted(m for _, m in steps) == list(range(mblk))
        for step, (_, m) in enumerate(steps):
            visits.setdefault(m, []).append((step, turn_of(vis, bm, n, m, rotate=True)))
    for m, seen in visits.items():
        seen.sort()
        assert [t for _, t in seen] == list(range(nblk))  # turn order == visit order
        assert all(b - a >= k for (a, _), (b, _) in zip(seen, seen[1:]))


@pytest.mark.parametrize("late", [False, True], ids=["plain", "dq_late"])
def test_rotated_protocol_runs_when_a_heads_blocks_are_resident(late):
    """The rotated turns under random schedules: with a head's key blocks all resident (what rotation_applies
    asks: no more key blocks than SMs) no deadlock and the same order of additions on every schedule, equal to
    the turns; with fewer resident blocks the model finds the deadlock the launcher's condition avoids."""
    rng = random.Random(7)
    for sq, sk, bm in [(1000, 700, 64), (4096, 1000, 128), (300, 129, 64), (65, 1, 64)]:
        vis = Vis(sq, sk, sk - sq, UNBOUNDED, UNBOUNDED)
        nblk = -(-sk // BN)
        for group in (1, 2):
            first = None
            for _ in range(3):
                order = run_protocol(vis, bm, group, nblk, rng, late=late, rotate=True)
                assert order is not None, "deadlock"
                for (h, m), ns in order.items():
                    assert [turn_of(vis, bm, n, m, rotate=True) for n in ns] == list(range(nblk))
                first = order if first is None else first
                assert order == first
    vis = Vis(1000, 1000, 0, UNBOUNDED, UNBOUNDED)
    assert run_protocol(vis, 64, 1, 2, random.Random(0), late=late, rotate=True) is None


def lockstep_ticks(vis, bm, rotate):
    """Ticks until every key block of one head finishes, all resident, each advancing one step per tick when
    its turn was passed at an earlier tick (a turn takes a tick to reach the next block)."""
    nblk = -(-vis.sk // BN)
    walks = {n: walk(vis, bm, *work_of(vis, bm, nblk, nblk - 1 - n), 1, rotate) for n in range(nblk)}
    position, counters, tick = {n: 0 for n in walks}, {}, 0
    while any(position[n] < len(w) for n, w in walks.items()):
        tick += 1
        done = [n for n, w in walks.items() if position[n] < len(w)
                and counters.get(w[position[n]], 0) == turn_of(vis, bm, n, w[position[n]][1], rotate)]
        for n in done:  # (counters change after the tick: the next block sees them a tick later)
            counters[walks[n][position[n]]] = counters.get(walks[n][position[n]], 0) + 1
            position[n] += 1
    return tick


def test_rotation_removes_the_lockstep_chain():
    """Why DQ_ROTATE: in lockstep every key block waits a tick per block above it on the first query block,
    so one head takes M + N - 1 ticks; rotated, the turns are passed before they are needed: M ticks."""
    for sq, sk, bm in [(16384, 16384, 64), (4096, 4096, 128), (2000, 1000, 64)]:
        vis = Vis(sq, sk, 0, UNBOUNDED, UNBOUNDED)
        nblk, mblk = -(-sk // BN), -(-sq // bm)
        assert lockstep_ticks(vis, bm, rotate=False) == mblk + nblk - 1
        assert lockstep_ticks(vis, bm, rotate=True) == mblk


def test_rotation_applies_only_where_every_query_sees_every_key():
    """launch_sm90_bwd.rotation_applies: full visibility, M >= N >= 1 and N <= SMs; causal masks, windows, more
    key blocks than query blocks or than SMs keep the plain ordered walk."""
    import torch

    from attnx.backends.cuda.launch_sm90_bwd import rotation_applies
    from attnx.problem import Problem

    def problem(sq, sk, **kw):
        return Problem.create(dtype=torch.bfloat16, batch=1, heads_q=2, seqlen_q=sq, seqlen_k=sk, head_dim=128,
                              device="cuda", vendor="nvidia", arch="sm_90", needs_grad=True, deterministic=True, **kw)

    assert rotation_applies(problem(16384, 16384), 64, 128, 132)
    assert rotation_applies(problem(4096, 4096), 128, 128, 132)
    assert not rotation_applies(problem(16384, 16384), 64, 128, 100)  # 128 key blocks, 100 SMs
    assert not rotation_applies(problem(256, 4096), 64, 128, 132)  # 4 query blocks, 32 key blocks
    assert not rotation_applies(problem(4096, 4096, causal=True), 64, 128, 132)
    assert not rotation_applies(problem(4096, 4096, window=(256, 256)), 64, 128, 132)
    assert rotation_applies(problem(4096, 1), 64, 128, 132)  # one key block: nothing to rotate, nothing wrong


def test_launcher_passes_zeroed_turn_counters_only_to_ordered_variants(monkeypatch):
    """launch_sm90_bwd.backward with a recording stand-in for the launch (CPU tensors, no GPU): an ordered
    variant gets one more argument, the address of zeroed int32 counters, one per (batch, query head, query
    block of BM); without DQ_TMA the table's variant keeps the 7 arguments of its signature, with it one more:
    the fp32 map of dq_accum (the ordered twin, with DQ_TMA: both, the counters first)."""
    import torch

    from attnx.autograd import backend_view
    from attnx.backends.cuda import launch_sm90_bwd as launcher
    from attnx.backends.cuda.variants import ordered_twin
    from attnx.problem import make_call

    q = torch.randn(2, 4, 300, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1000, 64, dtype=torch.bfloat16) for _ in range(2))
    p, x = make_call(q, k, v, causal=True, grad_inputs=())
    p = p._replace(arch="sm_90", vendor="nvidia")
    xv = backend_view(p, x)
    seen, made = {}, []
    zeros = torch.zeros

    def recording_zeros(*args, **kwargs):  # the int32 tensors the launcher allocates (turn counters)
        t = zeros(*args, **kwargs)
        if t.dtype == torch.int32:
            made.append(t)
        return t

    def launch(kernel, grid, threads, smem, args, device_index):
        last = args[-1]
        counters = [t for t in made if isinstance(last, np.uint64) and t.data_ptr() == int(last)]
        seen.update(grid=grid, args=len(args), counters=[(t.numel(), int(t.abs().sum())) for t in counters])

    monkeypatch.setattr(torch, "zeros", recording_zeros)
    monkeypatch.setattr(launcher, "tensor_map", lambda t, rows: ("map", rows))
    monkeypatch.setattr(launcher, "dq_reduce_map", lambda t: ("dq map", tuple(t.shape), t.dtype))
    monkeypatch.setattr(launcher, "get_kernel", lambda variant, arch, device_index: variant)
    monkeypatch.setattr(launcher, "_device_index", lambda t: 0)
    monkeypatch.setattr(launcher, "_launch", launch)
    out, lse = torch.zeros(2, 4, 300, 64, dtype=torch.bfloat16), torch.zeros(2, 4, 300)
    dout = torch.randn_like(out)
    table = launcher.backward_variant_for(p)
    assert table is not None and not table.dq_ordered and table.block_m == 128
    launcher.backward(p, xv, out, lse, dout, ordered_twin(table)._replace(dq_tma=False))
    assert seen == {"grid": 2 * 2 * 8, "args": 8, "counters": [(2 * 4 * 3, 0)]}
    def last_arg(kernel, grid, threads, smem, args, device_index):
        seen.update(args=len(args), last=args[-1])

    monkeypatch.setattr(launcher, "_launch", last_arg)
    for variant in (table._replace(dq_tma=False), table._replace(dq_tma=True)):  # DQ_TMA: + the dq_accum map
        launcher.backward(p, xv, out, lse, dout, variant)
        assert seen["args"] == 7 + variant.dq_tma
        assert (seen["last"] == ("dq map", (2, 4, 300, 64), torch.float32)) == variant.dq_tma
    launcher.backward(p, xv, out, lse, dout, ordered_twin(table))  # DQ_TMA in turn: the counters, then the map
    assert seen["args"] == 9 and seen["last"] == ("dq map", (2, 4, 300, 64), torch.float32)
