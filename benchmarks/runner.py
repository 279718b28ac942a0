"""The measurement loop: every point, every peer, one row each, never dying of one failure.

Each (point, peer) pair becomes a row with a status: "ok", "skipped" (with why),
"unsupported" (the peer refused the problem), "oom" or "error" (with the message).
Rows of one point are measured back to back in one process, so their ratios are
side by side. The dispatcher's pick is recorded for every point.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

import attnx

from . import memory as memory_probe
from .peers import AttnxPeer, Peer
from .progress import Progress
from .settings import Point
from .timing import input_copies, make_call, make_inputs, measure_time

MEMORY_HEADROOM = 0.7  # skip a point whose estimated peak exceeds this share of free memory
MEMORY_CALL_FACTOR = 4  # memory points run once, so they may take this many times --max-call-seconds


@dataclass
class Budget:
    """Wall-clock limits: the whole run, and one call of one peer (estimated from smaller sizes)."""

    max_seconds: Optional[float]
    max_call_seconds: float
    start: float = field(default_factory=time.monotonic)

    def spent(self) -> bool:
        return self.max_seconds is not None and time.monotonic() - self.start > self.max_seconds


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:limit]


def _breaks_context(err: BaseException) -> bool:
    """Errors after which every later CUDA call in this process fails too."""
    text = str(err).lower()
    return any(s in text for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                   "misaligned address", "device-side assert"))


def _is_unsupported(err: BaseException) -> bool:
    text = str(err)
    refusals = ("No available kernel", "No viable backend", "not supported")
    return isinstance(err, NotImplementedError) or any(r.lower() in text.lower() for r in refusals)


def dispatcher_pick(point: Point, inputs) -> tuple[Optional[str], dict]:
    """Which backend `attnx.attention` would pick here, and every backend's reasons."""
    q, k, v, _ = inputs[0]
    with torch.enable_grad() if point.mode == "fwd+bwd" else torch.no_grad():
        decision = attnx.explain(q, k, v, causal=point.causal)
    return decision.chosen, decision.reasons


class Runner:
    def __init__(self, device: str, peers: list[Peer], budget: Budget, quick=False, progress: Progress = None,
                 timer=None):
        self.device, self.peers, self.budget, self.quick = device, peers, budget, quick
        self.progress = progress
        self.timer = timer  # `timer(call) -> Timing`, or None for timing.measure_time's default
        self.rows: list[dict] = []
        self.picks: list[dict] = []
        self._last_ok: dict = {}  # (peer, group) -> (flops, seconds) of the last measured point
        self.context_lost: Optional[str] = None  # set after an error that poisons the CUDA context

    # -- one point -------------------------------------------------------------------
    def run_point(self, point: Point) -> None:
        inputs, chosen, reasons, failure = None, None, {}, None
        try:
            if not self.budget.spent() and not self.context_lost:
                try:
                    inputs = make_inputs(point, self.device, input_copies(point) if point.measure == "time" else 1)
                    chosen, reasons = dispatcher_pick(point, inputs)
                except Exception as err:  # recorded on every row of this point
                    inputs, failure = None, {"status": "oom" if _is_oom(err) else "error",
                                             "note": "inputs or attnx.explain failed: " + _first_line(err)}
            self.picks.append({**point.as_dict(), "picked": chosen})
            for peer in self.peers:
                row = failure or self._run_peer(point, peer, inputs, reasons)
                self.rows.append({**point.as_dict(), "peer": peer.name, "family": peer.family, **row})
                if self.progress:
                    self.progress.step(f"{point.label()} {peer.name}: {row['status']}")
        finally:
            del inputs
            self._free()

    def _skip_reason(self, point, peer, inputs, reasons) -> Optional[str]:
        if self.context_lost:
            return self.context_lost
        if inputs is None or self.budget.spent():
            return "time budget spent (--max-seconds)"
        why = peer.skip_reason(point, self.device)
        if why:
            return why
        if isinstance(peer, AttnxPeer) and reasons.get(peer.backend):
            return "declines: " + "; ".join(reasons[peer.backend])
        needed = peer.memory_estimate(point)
        if needed and needed > MEMORY_HEADROOM * memory_probe.available_bytes(self.device):
            return f"would not fit (needs ~{needed / 2**30:.1f} GiB)"
        last = self._last_ok.get((peer.name, point.group))
        if last is not None:
            estimate = last[1] * point.flops / last[0]
            limit = self.budget.max_call_seconds * (MEMORY_CALL_FACTOR if point.measure == "memory" else 1)
            if estimate > limit:
                return f"too slow (~{estimate:.1f} s per call expected)"
        return None

    def _run_peer(self, point, peer, inputs, reasons) -> dict:
        why = self._skip_reason(point, peer, inputs, reasons)
        if why:
            return {"status": "skipped", "note": why}
        try:
            fn = peer.build(point)
            if point.measure == "memory":
                extra, seconds = self._memory(point, peer, fn, inputs)
                self._last_ok[(peer.name, point.group)] = (point.flops, seconds)
                return {"status": "ok", "extra_bytes": extra, "ms": seconds * 1e3}
            timing = measure_time(fn, point, inputs, self.device, self.quick, self.timer)
        except Exception as err:  # one peer's failure is a row, not the end of the run
            if self.device == "cuda" and _breaks_context(err):
                self.context_lost = f"CUDA context lost after {peer.name} failed at {point.label()}"
            self._free()
            status = "oom" if _is_oom(err) else ("unsupported" if _is_unsupported(err) else "error")
            return {"status": status, "note": _first_line(err)}
        ms = timing.median_ms if self.device == "cuda" else timing.min_ms
        self._last_ok[(peer.name, point.group)] = (point.flops, ms / 1e3)
        return {"status": "ok", "median_ms": timing.median_ms, "min_ms": timing.min_ms, "reps": timing.reps,
                "ms": ms, "tflops": point.flops / (ms / 1e3) / 1e12,
                "gbps": point.kv_bytes / (ms / 1e3) / 1e9}

    def _memory(self, point, peer, fn, inputs) -> tuple[int, float]:
        """(peak extra bytes, seconds of the measured call)."""
        if self.device == "cuda":
            call = make_call(fn, point, inputs)
            call(0)  # compile / autotune outside the measured call
            return memory_probe.measure_cuda(call)
        timeout = 60 if self.quick else 900
        return memory_probe.measure_cpu(peer.name, point, timeout)

    def _free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # -- a whole setting ---------------------------------------------------------------
    def run(self, points: list[Point]) -> None:
        for point in points:
            self.run_point(point)


def dispatch_check(rows: list[dict], picks: list[dict], tolerance: float = 0.05) -> list[dict]:
    """For each timed point: attnx's pick, the fastest attnx backend, and the pick's slowdown."""
    checks = []
    for pick in picks:
        if pick["measure"] != "time":
            continue
        key = {name: pick[name] for name in Point.__dataclass_fields__}
        same = [r for r in rows if r["family"] == "attnx" and all(r[n] == v for n, v in key.items())]
        timed = {r["peer"].removeprefix("attnx."): r["ms"] for r in same if r["status"] == "ok"}
        check = {**key, "picked": pick["picked"], "best": None, "picked_ms": None, "best_ms": None,
                 "slowdown": None, "flag": False, "note": ""}
        if timed:
            best = min(timed, key=timed.get)
            check.update(best=best, best_ms=timed[best])
            if pick["picked"] in timed:
                slowdown = timed[pick["picked"]] / timed[best] - 1
                check.update(picked_ms=timed[pick["picked"]], slowdown=slowdown, flag=slowdown > tolerance)
            elif pick["picked"] is not None:
                check.update(note=f"the pick ({pick['picked']}) was not timed here")
        elif pick["picked"] is not None:
            check["note"] = "no attnx backend was timed here"
        checks.append(check)
    return checks
