"""PNG plots in the style of the FlashAttention README: grouped bars of TFLOP/s against
sequence length (one panel per head dim), and peak extra memory against sequence length.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from .report import MODE_NAMES, groups, peer_names

# attnx backends in warm colours, torch's methods in cool ones, stable across plots
COLORS = {"attnx.cuda": "#d62728", "attnx.triton": "#ff7f0e", "attnx.blocked": "#bcbd22", "attnx.naive": "#8c564b",
          "torch.sdpa.flash": "#1f77b4", "torch.sdpa.cudnn": "#17becf", "torch.sdpa.efficient": "#9467bd",
          "torch.sdpa.math": "#7f7f7f", "torch.flex": "#2ca02c", "torch.sdpa": "#1f77b4", "torch.formula": "#7f7f7f"}
FALLBACK = ["#e377c2", "#aec7e8", "#98df8a", "#ffbb78"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(name: str, index: int) -> str:
    return COLORS.get(name, FALLBACK[index % len(FALLBACK)])


def _seq_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _bars(ax, rows, names, value, fmt):
    seqs = sorted({r["seqlen_k"] for r in rows})
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ok = {r["seqlen_k"]: value(r) for r in rows if r["peer"] == name and r["status"] == "ok"}
        xs = [j + (i - (len(names) - 1) / 2) * width for j, s in enumerate(seqs) if s in ok]
        ys = [ok[s] for s in seqs if s in ok]
        bars = ax.bar(xs, ys, width, label=name, color=_color(name, i))
        if len(seqs) * len(names) <= 48:
            for bar, y in zip(bars, ys):
                ax.annotate(fmt(y), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=6, rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(seqs)), [_seq_label(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.grid(axis="y", alpha=0.3)


def speed_plots(rows: list[dict], out_dir: Path, device_name: str) -> list[Path]:
    """One PNG per (setting, dtype, mode, causal): TFLOP/s bars, one panel per head dim."""
    plt = _pyplot()
    figures: OrderedDict = OrderedDict()
    for key, group in groups(rows).items():
        setting, dtype, head_dim, causal, mode, measure = key
        measured = any(r.get("status") == "ok" for r in group)  # a panel of skips only says nothing
        if measure == "time" and measured:
            figures.setdefault((setting, dtype, mode, causal), []).append((head_dim, group))
    paths = []
    for (setting, dtype, mode, causal), panels in figures.items():
        panels.sort(key=lambda panel: panel[0])
        fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
        for ax, (head_dim, group) in zip(axes[0], panels):
            names = peer_names(group)
            if setting == "decode":
                _bars(ax, group, names, lambda r: r["gbps"], lambda y: f"{y:.0f}")
                ax.set_ylabel("K/V read bandwidth (GB/s)")
            else:
                _bars(ax, group, names, lambda r: r["tflops"], lambda y: f"{y:.0f}" if y >= 10 else f"{y:.2g}")
                ax.set_ylabel("speed (TFLOP/s)")
            ax.set_title(f"{MODE_NAMES[mode].capitalize()}, {'causal' if causal else 'without causal mask'}, "
                         f"head dim {head_dim}", fontsize=10)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.suptitle(f"attnx {setting} benchmark, {dtype} — {device_name}", fontsize=11)
        fig.tight_layout()
        path = out_dir / f"{setting}_{dtype}_{mode.replace('+', '_')}_{'causal' if causal else 'full'}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def memory_plot(rows: list[dict], out_dir: Path, device_name: str) -> list[Path]:
    """Peak extra memory against S, log-log, one panel per mode."""
    memory_groups = [(k, g) for k, g in groups(rows).items() if k[5] == "memory"]
    if not memory_groups:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(memory_groups), figsize=(6 * len(memory_groups), 4.2), squeeze=False)
    for ax, (key, group) in zip(axes[0], memory_groups):
        for i, name in enumerate(peer_names(group)):
            ok = sorted((r["seqlen_k"], r["extra_bytes"] / 2**20) for r in group
                        if r["peer"] == name and r["status"] == "ok" and r["extra_bytes"] > 0)
            if ok:
                ax.plot(*zip(*ok), marker="o", label=name, color=_color(name, i))
        first = group[0]
        ax.set_xscale("log", base=2)
        seqs = sorted({r["seqlen_k"] for r in group})
        ax.set_xticks(seqs, [_seq_label(s) for s in seqs])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("peak extra memory (MiB)")
        ax.set_title(f"{MODE_NAMES[key[4]].capitalize()}, {key[1]}, B={first['batch']} H={first['heads_q']} "
                     f"D={key[2]}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"attnx memory sweep — {device_name}", fontsize=11)
    fig.tight_layout()
    path = out_dir / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def make_plots(rows: list[dict], out_dir: Path, device_name: str) -> list[Path]:
    """Every plot for these rows; an empty list (and a message) when matplotlib is missing."""
    try:
        _pyplot()
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    return speed_plots(rows, out_dir, device_name) + memory_plot(rows, out_dir, device_name)
