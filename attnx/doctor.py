"""`python -m attnx.doctor`: what this machine can do with attnx.

Prints versions, devices, every backend with "available" or why not (with the
install hint), and which backend the dispatcher would pick for typical problems on
each device. ``--json`` prints the same as JSON; ``--selftest`` also runs a small
conformance subset on every available backend and exits non-zero if any case fails.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .capability import DeviceInfo, probe
from .dispatch import decide
from .problem import Problem
from .registry import registered_backends

# (label, dtype, head_dim, Sq, Sk, causal, mask kind, needs grad)
TYPICAL = (
    ("fp16 d128 causal S=4096", torch.float16, 128, 4096, 4096, True, None, False),
    ("bf16 d128 causal S=4096 training", torch.bfloat16, 128, 4096, 4096, True, None, True),
    ("bf16 d64 decode Sq=1 Sk=8192", torch.bfloat16, 64, 1, 8192, True, None, False),
    ("fp32 d64 bool mask S=1024", torch.float32, 64, 1024, 1024, False, "bool", False),
    ("fp32 d64 additive mask S=1024 training", torch.float32, 64, 1024, 1024, False, "additive", True),
    ("fp64 d32 S=128", torch.float64, 32, 128, 128, False, None, False),
    ("fp16 d256 S=2048", torch.float16, 256, 2048, 2048, False, None, False),
)


def typical_problem(device: DeviceInfo, dtype, head_dim, seqlen_q, seqlen_k, causal, mask_kind, needs_grad):
    """A Problem as `make_problem` would build it for batch 2, 16 heads, on `device`."""
    device_type = "cpu" if device.vendor == "cpu" else ("mps" if device.vendor == "apple" else "cuda")
    return Problem.create(
        device=device_type, vendor=device.vendor, arch=device.arch, dtype=dtype, batch=2, heads_q=16,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, causal=causal, mask_kind=mask_kind,
        mask_shape=(1, 1, seqlen_q, seqlen_k) if mask_kind else None, needs_grad=needs_grad)


def _backend_rows() -> list[dict]:
    rows = []
    for backend in registered_backends().values():
        row = {"name": backend.name, "available": backend.available,
               "reasons": list(backend.unavailable_reasons), "description": backend.description}
        if backend.available:
            try:
                details = backend.doctor_details()
                if details:
                    row["details"] = details
            except Exception as err:  # the doctor reports a broken backend, it does not die of it
                row["details"] = {"error": f"{type(err).__name__}: {err}"}
        rows.append(row)
    return rows


def collect() -> dict:
    """Everything the doctor prints, as plain data."""
    machine = probe()
    picks = {}
    for device in machine.devices:
        device_picks = {}
        for label, *spec in TYPICAL:
            decision = decide(typical_problem(device, *spec))
            device_picks[label] = {
                "chosen": decision.chosen,
                "declined": {name: why for name, why in decision.reasons.items() if why},
            }
        picks[device.name] = device_picks
    return {**machine.as_dict(), "backends": _backend_rows(), "picks": picks}


def _print_report(report: dict) -> None:
    print(f"attnx doctor — Python {report['python']} on {report['platform']}")
    print("\nversions")
    for name, version in report["versions"].items():
        missing = "none" if name.endswith("runtime") else "not installed"
        print(f"  {name:14s} {version or missing}")
    print("\ndevices")
    for device in report["devices"]:
        extra = []
        if device["compute_capability"]:
            extra.append(f"compute capability {device['compute_capability'][0]}.{device['compute_capability'][1]}")
        if device["multiprocessors"]:
            extra.append(f"{device['multiprocessors']} SMs/CUs")
        if device["memory_bytes"]:
            extra.append(f"{device['memory_bytes'] / 2**30:.0f} GiB")
        if device["shared_memory_per_block"]:
            extra.append(f"{device['shared_memory_per_block'] // 1024} KiB shared/block")
        if device["cores"]:
            extra.append(f"{device['cores']} cores")
        print(f"  {device['name']:8s} {device['vendor']:7s} {device['arch']:8s} {device['model']}"
              + (f" ({', '.join(extra)})" if extra else ""))
    print("\nbackends")
    for row in report["backends"]:
        status = "available" if row["available"] else "unavailable: " + "; ".join(row["reasons"])
        print(f"  {row['name']:8s} {status}")
        for key, value in row.get("details", {}).items():
            print(f"  {'':8s}   {key}: {value}")
    for device, picks in report["picks"].items():
        print(f"\ndispatcher picks on {device}")
        for label, pick in picks.items():
            print(f"  {label:40s} -> {pick['chosen'] or 'NONE'}")
    if report.get("selftest"):
        print("\nselftest")
        for name, result in report["selftest"].items():
            print(f"  {name:8s} {result['summary']}")
            for failure in result["failures"]:
                print(f"  {'':8s}   FAIL {failure}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnx.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--selftest", action="store_true",
                        help="run a small conformance subset on every available backend; exit 1 on failure")
    args = parser.parse_args(argv)
    report = collect()
    failed = False
    if args.selftest:
        from .selftest import run_selftest

        report["selftest"] = run_selftest()
        failed = any(not r["passed"] for r in report["selftest"].values())
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
        if args.selftest:
            print("\nselftest " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
