"""What this machine can do: devices, architectures and package versions.

Nothing here imports triton or cupy unless they are installed; results are cached
so the attention hot path never probes twice.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import platform
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device as attnx sees it."""

    name: str                 # torch device string, e.g. "cuda:0"
    vendor: str               # "cpu", "nvidia", "amd", "apple", "other"
    arch: str                 # "sm_90", "gfx942", "cpu", "mps", ...
    model: str = ""
    compute_capability: Optional[tuple] = None
    multiprocessors: Optional[int] = None
    memory_bytes: Optional[int] = None
    shared_memory_per_block: Optional[int] = None
    cores: Optional[int] = None

    def as_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=None)
def _arch_of(device_type: str, index: Optional[int]) -> tuple[str, str]:
    if device_type == "cuda":
        index = torch.cuda.current_device() if index is None else index
        if torch.version.hip:
            props = torch.cuda.get_device_properties(index)
            return "amd", getattr(props, "gcnArchName", "gfx").split(":")[0]
        major, minor = torch.cuda.get_device_capability(index)
        return "nvidia", f"sm_{major}{minor}"
    if device_type == "cpu":
        return "cpu", "cpu"
    if device_type == "mps":
        return "apple", "mps"
    return "other", device_type


def device_arch(device: torch.device) -> tuple[str, str]:
    """(vendor, arch) of a torch device, cached per device."""
    return _arch_of(device.type, device.index)


def _cuda_device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    vendor, arch = _arch_of("cuda", index)
    smem = getattr(props, "shared_memory_per_block_optin", None) or getattr(props, "shared_memory_per_block", None)
    return DeviceInfo(
        name=f"cuda:{index}", vendor=vendor, arch=arch, model=props.name,
        compute_capability=(props.major, props.minor) if vendor == "nvidia" else None,
        multiprocessors=props.multi_processor_count, memory_bytes=props.total_memory,
        shared_memory_per_block=smem)


@functools.lru_cache(maxsize=None)
def devices() -> tuple[DeviceInfo, ...]:
    """Every device torch can use here, the CPU first."""
    import os

    found = [DeviceInfo(name="cpu", vendor="cpu", arch="cpu", model=platform.processor() or platform.machine(),
                        cores=os.cpu_count())]
    if torch.cuda.is_available():
        found += [_cuda_device_info(i) for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append(DeviceInfo(name="mps", vendor="apple", arch="mps", model="Apple GPU"))
    return tuple(found)


def package_version(name: str) -> Optional[str]:
    """Installed version of a distribution, or None, without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def has_module(name: str) -> bool:
    """True when `import name` would find a module (it is not imported)."""
    return importlib.util.find_spec(name) is not None


def cupy_version() -> Optional[str]:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy-rocm-6-0", "cupy-rocm-5-0", "cupy"):
        version = package_version(dist)
        if version:
            return f"{version} ({dist})"
    return None


@dataclass(frozen=True)
class MachineInfo:
    python: str
    platform: str
    versions: dict = field(default_factory=dict)
    devices: tuple = ()

    def as_dict(self) -> dict:
        return {"python": self.python, "platform": self.platform, "versions": self.versions,
                "devices": [d.as_dict() for d in self.devices]}


def probe() -> MachineInfo:
    """Everything the doctor reports about this machine."""
    from . import __version__

    versions = {
        "attnx": __version__,
        "torch": torch.__version__,
        "cuda runtime": torch.version.cuda,
        "hip runtime": torch.version.hip,
        "triton": package_version("triton") or package_version("pytorch-triton-rocm"),
        "cupy": cupy_version(),
        "numpy": package_version("numpy"),
    }
    return MachineInfo(python=platform.python_version(), platform=platform.platform(),
                       versions=versions, devices=devices())
