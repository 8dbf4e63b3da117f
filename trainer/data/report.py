"""Length-distribution plot of a prepared dataset (written beside its manifest as lengths.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_lengths(manifest: dict[str, Any], png_path: Path) -> None:
    """Bar chart of example lengths per split, with p50/p90/p99 and seq_len marked."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    seq_len = manifest["settings"]["seq_len"]
    splits = [
        (s, manifest[s]["lengths"])
        for s in ("train", "eval")
        if manifest.get(s) and manifest[s]["lengths"].get("count")
    ]
    fig, axes = plt.subplots(len(splits) or 1, 1, figsize=(8, 3.2 * max(1, len(splits))), squeeze=False)
    for ax, (name, ls) in zip(axes[:, 0], splits, strict=False):
        edges, counts = ls["histogram"]["edges"], ls["histogram"]["counts"]
        widths = [hi - lo for lo, hi in zip(edges[:-1], edges[1:], strict=False)]
        ax.bar(edges[:-1], counts, width=widths, align="edge", color="#4c72b0", edgecolor="white")
        for q, style in (("p50", ":"), ("p90", "--"), ("p99", "-.")):
            ax.axvline(ls[q], color="#333333", linestyle=style, label=f"{q} = {ls[q]}")
        ax.axvline(seq_len, color="#c44e52", label=f"seq_len = {seq_len}")
        ax.set_title(f"{name}: {ls['count']:,} examples, max {ls['max']} tokens")
        ax.set_xlabel("tokens per example (with EOS, before truncation)")
        ax.set_ylabel("examples")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
