"""Results as JSON, a markdown report, and a short console table."""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

MODE_NAMES = {"fwd": "forward", "fwd+bwd": "forward + backward"}
SHORT_STATUS = {"skipped": "skip", "oom": "oom", "error": "err", "unsupported": "n/a"}


def write_json(path: Path, meta: dict, rows: list[dict], checks: list[dict], picks: list[dict],
               extra: dict = None) -> None:
    """The whole record; `extra` adds top-level sections (e.g. the paper runner's kernel reports)."""
    path.write_text(json.dumps({"meta": meta, "rows": rows, "dispatch": checks, "picks": picks, **(extra or {})},
                               indent=1, default=str) + "\n")


def dict_table(rows: list[dict]) -> list[str]:
    """Markdown lines of a table with one column per key of the rows (first row's order first)."""
    if not rows:
        return ["(none)", ""]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows] + [""]


def groups(rows: list[dict]) -> "OrderedDict[tuple, list[dict]]":
    """Rows by (setting, dtype, head_dim, causal, mode, measure), in run order."""
    out: OrderedDict = OrderedDict()
    for row in rows:
        key = (row["setting"], row["dtype"], row["head_dim"], row["causal"], row["mode"], row["measure"])
        out.setdefault(key, []).append(row)
    return out


def peer_names(rows: list[dict]) -> list[str]:
    """Peers in run order, leaving out those that never produced a number."""
    names = list(OrderedDict.fromkeys(r["peer"] for r in rows))
    return [n for n in names if any(r["peer"] == n and r["status"] == "ok" for r in rows)] or names


def _cell(row: dict, measure: str, setting: str) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return SHORT_STATUS.get(row["status"], row["status"])
    if measure == "memory":
        return f"{row['extra_bytes'] / 2**20:,.1f}"
    if setting == "decode":
        return f"{row['ms'] * 1e3:,.0f} µs"
    tflops = row["tflops"]
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3f}"


def group_title(key: tuple, first: dict) -> str:
    setting, dtype, head_dim, causal, mode, measure = key
    heads = (f"H={first['heads_q']}" if first["heads_q"] == first["heads_kv"]
             else f"Hq={first['heads_q']}, Hkv={first['heads_kv']}")
    what = {"memory": "peak extra memory, MiB", "time": "µs per call" if setting == "decode" else "TFLOP/s"}[measure]
    shape = (f"B={first['batch']}, Sq=1" if setting == "decode"
             else f"B x S = {first['batch'] * first['seqlen_k']:,} tokens" if setting != "memory"
             else f"B={first['batch']}")
    return (f"{setting}: {MODE_NAMES[mode]}, head dim {head_dim}, {'causal' if causal else 'not causal'}, "
            f"{dtype}, {heads}, {shape} — {what}")


def markdown(meta: dict, rows: list[dict], checks: list[dict], picks: list[dict], plots: list[str]) -> str:
    lines = [f"# attnx benchmarks — {meta['device_name']} — {meta['date']}", "",
             f"Command: `{meta['command']}`  ", f"Versions: {meta['versions']}  ",
             f"Backends available: {', '.join(meta['attnx_backends'])}  ",
             f"Statistic: {meta['statistic']}. TFLOP/s = 4·B·H·Sq·Sk·D / time "
             "(halved for causal, x3.5 for forward + backward). "
             "Cells: skip = not run (see notes), n/a = the method refuses the problem, oom = out of memory, "
             "err = failed (see notes).", ""]
    pick_of = {tuple(sorted((k, v) for k, v in p.items() if k != "picked")): p["picked"] for p in picks}
    check_of = {tuple(sorted((k, v) for k, v in c.items() if k in _point_fields(c))): c for c in checks}
    for key, group in groups(rows).items():
        names = peer_names(group)
        lines += [f"### {group_title(key, group[0])}", ""]
        seq_col = "Sk" if key[0] == "decode" else "S"
        header = [seq_col] + names + ["attnx pick"] + (["pick vs best attnx"] if key[5] == "time" else [])
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        by_point = OrderedDict()
        for row in group:
            by_point.setdefault(_point_key(row), {})[row["peer"]] = row
        for pkey, cells in by_point.items():
            first = next(iter(cells.values()))
            values = [str(first["seqlen_k"])] + [_cell(cells.get(n), key[5], key[0]) for n in names]
            values.append(pick_of.get(pkey) or "none")
            if key[5] == "time":
                check = check_of.get(pkey)
                values.append(_slowdown_text(check))
            lines.append("| " + " | ".join(values) + " |")
        notes = OrderedDict()
        for row in group:
            if row["status"] != "ok":
                notes.setdefault((row["peer"], row["status"], row.get("note", "")), []).append(str(row["seqlen_k"]))
        if notes:
            lines.append("")
            for (peer, status, note), seqs in notes.items():
                lines.append(f"- {peer} {status} at {seq_col}={','.join(seqs)}: {note}")
        lines.append("")
    lines += dispatch_section(checks)
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines)


def _point_fields(d: dict) -> set:
    from .settings import Point

    return set(Point.__dataclass_fields__)


def _point_key(row: dict) -> tuple:
    fields = _point_fields(row)
    return tuple(sorted((k, v) for k, v in row.items() if k in fields))


def _slowdown_text(check) -> str:
    if check is None:
        return ""
    if check["slowdown"] is None:
        return check["note"] or "—"
    text = "best" if check["slowdown"] <= 0 else f"+{check['slowdown'] * 100:.0f}% vs {check['best']}"
    return text + (" **SLOW PICK**" if check["flag"] else "")


def dispatch_section(checks: list[dict]) -> list[str]:
    """The dispatcher check: which backend attnx picked and how far it is from the fastest attnx backend."""
    measured = [c for c in checks if c["slowdown"] is not None]
    flagged = [c for c in measured if c["flag"]]
    lines = ["## Dispatcher check", "",
             f"{len(measured)} timed points with an attnx pick; {len(measured) - len(flagged)} picks within 5% "
             f"of the fastest attnx backend; {len(flagged)} flagged (a pick more than 5% slower than the best "
             "is a dispatcher bug to report)."]
    unmeasured = [c for c in checks if c["slowdown"] is None and c["note"]]
    if flagged or unmeasured:
        lines += ["", "| setting | point | picked | best attnx | slowdown |", "|---|---|---|---|---|"]
        for c in flagged + unmeasured:
            slow = f"+{c['slowdown'] * 100:.0f}%" if c["slowdown"] is not None else c["note"]
            lines.append(f"| {c['setting']} | {_check_label(c)} | {c['picked']} | {c['best']} | {slow} |")
    return lines + [""]


def _check_label(c: dict) -> str:
    return (f"{c['dtype']} B={c['batch']} H={c['heads_q']} S={c['seqlen_k']} D={c['head_dim']}"
            f"{' causal' if c['causal'] else ''} {c['mode']}")


def console_table(rows: list[dict], checks: list[dict]) -> str:
    """A short table: the largest sequence length each peer measured, per group."""
    out = []
    for key, group in groups(rows).items():
        names = peer_names(group)
        largest = max(r["seqlen_k"] for r in group)
        at_largest = {r["peer"]: r for r in group if r["seqlen_k"] == largest}
        cells = "  ".join(f"{n}={_cell(at_largest.get(n), key[5], key[0])}" for n in names)
        unit = {"memory": "MiB", "time": "µs" if key[0] == "decode" else "TFLOP/s"}[key[5]]
        out.append(f"{key[0]:6s} {key[1]} d{key[2]} {'causal' if key[3] else 'full  '} {key[4]:7s} "
                   f"S={largest} [{unit}] {cells}")
    measured = [c for c in checks if c["slowdown"] is not None]
    flagged = [c for c in measured if c["flag"]]
    line = f"dispatcher check: {len(measured) - len(flagged)}/{len(measured)} picks within 5% of the best attnx backend"
    if flagged:
        line += "; FLAGGED: " + "; ".join(f"{_check_label(c)} picked {c['picked']}, best {c['best']} "
                                          f"(+{c['slowdown'] * 100:.0f}%)" for c in flagged[:8])
    out.append(line)
    return "\n".join(out)
