"""Length-distribution plot of a prepared dataset, lengths.png beside its manifest.

Drawn when `spotune inspect` asks for it, not while preparing: matplotlib costs a second or two
of CPU, which every `train` that builds its cache would pay for a picture nobody opened."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from trainer.atomic import write_bytes

LENGTHS_PNG = "lengths.png"


def lengths_plot(entry: Path, manifest: dict[str, Any]) -> Path | str:
    """`entry`/lengths.png, drawn now if an earlier call has not (written atomically: a cache entry
    is shared by every run on the machine); else why there is none."""
    png = entry / LENGTHS_PNG
    if png.is_file():
        return png
    try:
        data = plot_lengths(manifest)
    except ImportError:
        return "matplotlib is not installed"
    try:
        write_bytes(png, data)
    except OSError as e:  # a cache folder the user may read but not write (a shared, read-only data.cache_dir)
        return f"cannot write {png}: {e.strerror or e}"
    return png


def plot_lengths(manifest: dict[str, Any]) -> bytes:
    """Bar chart of example lengths per split, with p50/p90/p99 and seq_len marked, as PNG bytes."""
    from matplotlib.figure import Figure  # the object API: no pyplot state in the caller's process

    seq_len = manifest["settings"]["seq_len"]
    splits = [
        (s, manifest[s]["lengths"])
        for s in ("train", "eval")
        if manifest.get(s) and manifest[s]["lengths"].get("count")
    ]
    fig = Figure(figsize=(8, 3.2 * max(1, len(splits))), layout="tight")
    axes = fig.subplots(len(splits) or 1, 1, squeeze=False)
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
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
