"""attnx's built-in backends (installed as ``attnx.backends``).

Each backend is one folder holding its declarations, its launcher and its kernels.
A backend module must import without its optional packages (triton, cupy): those
are imported only when it runs.
"""
import importlib

# Module names, best first is the dispatcher's business (attnx/dispatch.py), not this list's.
BUILTIN = ("naive", "blocked", "triton", "cuda", "torch")


def builtin_backends():
    """Instances of every built-in backend whose folder is present."""
    found = []
    for name in BUILTIN:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"{__name__}.{name}":
                continue  # that backend is not part of this build
            raise
        found.append(module.BACKEND)
    return found
