"""Generate the backend support matrix in docs/backends.md from the backends' own declarations.

    python docs/gen_backends.py          # rewrite the generated part of docs/backends.md
    python docs/gen_backends.py --check  # exit 1 if the committed page is out of date

Only the part between the BEGIN/END markers is generated; the prose around it is
hand-written. Every built-in backend is imported for its declarations even when its
optional packages (triton, cupy) are missing: declarations never need them.
Nothing machine-dependent (availability, devices present) goes into the page.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "backends.md"
BEGIN = "<!-- BEGIN GENERATED: python docs/gen_backends.py -->"
END = "<!-- END GENERATED -->"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def builtin_backends() -> list:
    """Instances of the built-in backends present in this checkout, in `backends.BUILTIN` order."""
    import attnx.backends

    return list(attnx.backends.builtin_backends())


def _names(values) -> str:
    return ", ".join(sorted(str(v).replace("torch.", "") for v in values))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _capability(backend) -> str:
    parts = []
    if backend.vendors is not None:
        parts.append(_names(backend.vendors))
    if backend.min_capability is not None:
        parts.append(f"sm >= {backend.min_capability[0]}.{backend.min_capability[1]}")
    if backend.max_capability is not None:
        parts.append(f"sm <= {backend.max_capability[0]}.{backend.max_capability[1]}")
    if backend.amd_archs is not None:
        parts.append("AMD " + _names(backend.amd_archs))
    return "; ".join(parts) or "any"


def _head_dims(backend) -> str:
    if backend.head_dims is not None:
        return ", ".join(str(d) for d in sorted(backend.head_dims))
    if backend.max_head_dim is not None:
        return f"1 .. {backend.max_head_dim}"
    return "any"


def _extra_limits(backend) -> str:
    from attnx.backend import Backend

    method = type(getattr(backend, "backend", backend)).extra_reasons  # a `Declarations` view: its backend's
    if method is Backend.extra_reasons:
        return "none"
    doc = (method.__doc__ or "").strip().splitlines()
    return doc[0].rstrip(".") if doc else f"in code (`{type(backend).__name__}.extra_reasons`)"


def _needs(backend) -> str:
    if not backend.required_modules:
        return "torch only"
    text = ", ".join(f"`{m}`" for m in backend.required_modules)
    return text + (f" (`{backend.install_hint}`)" if backend.install_hint else "")


ROWS = (
    ("devices", lambda b: _names(b.device_types)),
    ("vendors / architectures", _capability),
    ("dtypes", lambda b: _names(b.dtypes)),
    ("head dims", _head_dims),
    ("head dim multiple of", lambda b: str(b.head_dim_multiple) if b.head_dim_multiple else "any"),
    ("head_dim_v != head_dim", lambda b: _yes(b.supports_dv_differs)),
    ("GQA / MQA", lambda b: _yes(b.supports_gqa)),
    ("causal", lambda b: _yes(b.supports_causal) + (" (Sq == Sk only)" if b.causal_needs_equal_lengths else "")),
    ("sliding window", lambda b: _yes(b.supports_window)),
    ("mask tensor", lambda b: _names(b.mask_kinds) or "no"),
    ("mask gradient", lambda b: _yes(b.supports_mask_grad)),
    ("ALiBi", lambda b: _yes(b.supports_alibi)),
    ("softcap", lambda b: _yes(b.supports_softcap)),
    ("explicit offset", lambda b: _yes(b.supports_offset)),
    ("attention sinks", lambda b: _yes(b.supports_sinks)),
    ("formats (q / k,v)", lambda b: ", ".join(f"{q}/{kv}" for q, kv in sorted(b.formats))),
    ("backward", lambda b: _yes(b.supports_backward) + (
        " (" + ", ".join(f"{q}/{kv}" for q, kv in sorted(b.backward_formats)) + " only)"
        if b.supports_backward and b.backward_formats is not None else "")),
    ("deterministic", lambda b: _yes(b.deterministic)),
    ("priority", lambda b: ", ".join(f"{cls} {rank}" for cls, rank in b.priority.items())),
    ("other limits", _extra_limits),
    ("needs", _needs),
)


def _priority_line(backends) -> str:
    from attnx.backend import Backend

    rules = [f"`{b.name}`: {(type(b).rank.__doc__ or '').strip().splitlines()[0].rstrip('.')}"
             for b in backends if type(b).rank is not Backend.rank]
    text = ("Dispatcher order (`attnx/dispatch.py`): the accepting backend with the highest priority for the "
            "problem's device class runs; the most specific entry of a backend's table counts (`cuda:sm_90`, "
            "then `cuda:nvidia`, `cuda`, `*`)")
    return text + ("; size rules: " + "; ".join(rules) if rules else "") + "."


def columns(backends) -> list[tuple[str, object]]:
    """(heading, declarations) per column: each backend, then one column per device class whose
    declarations differ (`Backend.device_declarations`), e.g. "`torch` on cuda"."""
    found = []
    for b in backends:
        found.append((f"`{b.name}`", b))
        for device_class in b.device_declarations:
            classes = tuple(dict.fromkeys((device_class, device_class.split(":")[0], "*")))
            found.append((f"`{b.name}` on {device_class}", b.declarations(classes)))
    return found


def render(backends=None) -> str:
    """The generated markdown: the support matrix and each backend's description."""
    backends = builtin_backends() if backends is None else backends
    cols = columns(backends)
    header = "| | " + " | ".join(heading for heading, _ in cols) + " |"
    lines = [BEGIN, "", header, "|---|" + "---|" * len(cols)]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(d).replace("|", "\\|") for _, d in cols) + " |")
    lines.append("")
    for b in backends:
        lines.append(f"- **{b.name}**: {b.description}")
    lines += ["", _priority_line(backends), "", END]
    return "\n".join(lines)


def splice(page: str, generated: str) -> str:
    """`page` with the text between the markers replaced by `generated` (markers included)."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < 0:
        raise SystemExit(f"{PAGE} lacks the markers {BEGIN!r} ... {END!r}")
    return page[:start] + generated + page[end + len(END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/backends.md is out of date")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    updated = splice(page, render())
    if args.check:
        if updated != page:
            print("docs/backends.md is out of date: run `python docs/gen_backends.py`")
            return 1
        print("docs/backends.md is up to date")
        return 0
    if updated != page:
        PAGE.write_text(updated)
        print(f"updated {PAGE}")
    else:
        print(f"{PAGE} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
