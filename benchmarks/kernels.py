"""What the compiler made of a backend's kernels, for the paper runner's report.

Each report lists the kernels compiled (or loaded) in this process so far, one dict
per kernel; backends without a report give an empty list.
"""
from __future__ import annotations

import importlib


def cuda_kernels() -> list[dict]:
    """Per loaded specialisation: seconds to compile or load, registers, local (spill) bytes."""
    return importlib.import_module("attnx.backends.cuda").compile_time_report()


def triton_kernels() -> list[dict]:
    """Per compiled kernel: warps, stages, shared memory, registers, spills, wgmma or mma.sync."""
    launch = importlib.import_module("attnx.backends.triton.launch")
    functions = list(launch.KERNEL_FNS.items())
    if hasattr(launch, "bwd_preprocess"):
        functions.append(("bwd_preprocess", launch.bwd_preprocess))
    rows = []
    for name, fn in functions:
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for compiled in kernels.values():
                try:
                    compiled._init_handles()  # fills n_regs / n_spills
                except Exception:  # noqa: BLE001 - metadata only
                    pass
                meta = compiled.metadata
                ptx = compiled.asm.get("ptx", "")
                constants = getattr(getattr(compiled, "src", None), "constants", {})
                rows.append({"kernel": name, "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                             "shared": meta.shared, "regs": getattr(compiled, "n_regs", None),
                             "spills": getattr(compiled, "n_spills", None), "wgmma": "wgmma" in ptx,
                             "mma_sync": "mma.sync" in ptx, "constants": str(constants)[:200]})
    return rows


REPORTS = {"cuda": cuda_kernels, "triton": triton_kernels}


def kernel_report(backend: str) -> list[dict]:
    """`backend`'s kernel report, or [] when it has none or it cannot be read."""
    report = REPORTS.get(backend)
    if report is None:
        return []
    try:
        return report()
    except Exception as err:  # noqa: BLE001 - a report is a bonus, never the end of a run
        return [{"error": f"{type(err).__name__}: {str(err)[:200]}"}]
