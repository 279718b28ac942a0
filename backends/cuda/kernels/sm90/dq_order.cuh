// The Hopper backward's ordered dQ (DQ_ORDERED, sm90/fa_bwd.cu): the turn counters' wait and release.
#pragma once
#include "sm90/ptx.cuh"

namespace sm90_bwd {

// ---- Ordered dQ (DQ_ORDERED) --------------------------------------------------------------------
// FlashAttention-3's deterministic dQ: one int32 turn counter per (batch, query head, query block)
// in global memory (zeroed by the launcher). The key blocks that add to query block m are contiguous,
// [n_first(m), n_last(m)] (visibility is an interval of keys per query that moves with the query), and
// they add in DESCENDING order: key block n waits until the counter equals n_last(m) - n, adds its
// part with red.global.add, and increments it. Descending (FlashAttention-3's causal order) because
// with a causal mask the diagonal block is the first to reach query block m in every thread block's
// walk; ascending order would make key block n wait for key block n - 1 to walk the 128 / BM query
// blocks that only it sees, at every step of the staircase (modelled: ~1.8x the unordered time).
// Deadlock freedom: under DQ_ORDERED the grid runs each head's key blocks from the last to the first
// (work_of), so every key block a thread block waits for (n + 1 .. n_last(m), same batch and kv head)
// has a lower blockIdx and was launched no later: it is resident or done, and its own waits point at
// still lower blockIdx, so the thread block of lowest blockIdx that is not done never waits on one
// that cannot run (the waits form no cycle and end at one that waits on nothing). A thread block holds
// nothing another one needs while it waits (it has already freed its Q/dO stage; K and V are its own).
// Each dQ element has one writer per thread block except in the split by keys, where consumer 1 adds
// after consumer 0 (a named barrier orders the two reductions: fp32 adds are applied in that order).
// red rather than ld + add + st: the additions are fire-and-forget (one L2 round trip, in the release
// fence, inside the turn instead of two) and need no registers for loaded values (d128 score-mod sits
// at R237 of 240); the order fixes the bits either way.
DEVI int load_acquire(const int* addr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
// One thread spins until the counter shows this key block's turn (back-off capped at 256 ns: a turn
// usually comes within a step, ~3.5 us at d128).
DEVI void wait_turn(const int* sem, int turn) {
  u32 backoff = 32;
  while (load_acquire(sem) != turn) {
    asm volatile("nanosleep.u32 %0;\n" ::"r"(backoff));
    backoff = backoff < 256 ? 2 * backoff : 256;
  }
}
// After a barrier that follows every adding thread's reductions: the fence makes them (cumulatively,
// through the barrier) visible at gpu scope before the next key block can see the increment.
DEVI void pass_turn(int* sem) {
  asm volatile("fence.sc.gpu;\nred.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
// The increment as a release alone: enough when the thread itself performed (and waited for) what it releases
// (DQ_WRITER's TMA adds, after their completion wait and the proxy fence).
DEVI void release_turn(int* sem) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}

}  // namespace sm90_bwd
