"""Length statistics for the manifest, and the human-readable summary built from a manifest."""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.data import dropped

CANDIDATE_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
HIST_BINS = 20
BASELINE_BATCH = 8  # batch size of the "pad each batch to its longest" baseline in the manifest


def suggest_seq_len(p99: int) -> int:
    """Smallest multiple of 64 of the form 2^k or 1.5 * 2^k that holds the p99 example."""
    steps = sorted({m for k in range(6, 20) for m in (2**k, 3 * 2 ** (k - 1)) if m % 64 == 0})
    return next(m for m in steps if m >= p99)


def _nice(width: float) -> int:
    """The smallest 1, 2 or 5 x 10^k at least `width` (bin widths a person reads at a glance)."""
    k = 10 ** max(0, int(np.floor(np.log10(max(width, 1.0)))))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= width)


def histogram_edges(lens: np.ndarray, bins: int = HIST_BINS) -> np.ndarray:
    """Integer bin edges that fit the data: from the shortest example, round widths, at most `bins` bins.

    Spanning [0, max] left most bins empty when every example carries a long prompt
    template. A long tail beyond p99 gets one last, wider bin (its right edge is max + 1),
    so a few outliers do not squeeze everyone else into two bars.
    """
    lo, hi = int(lens.min()), int(lens.max()) + 1
    top = min(hi, int(np.ceil(np.percentile(lens, 99))) + 1)
    body = bins - 1 if top < hi else bins
    width = _nice((top - lo) / body)
    start = lo - lo % width
    edges = list(range(start, top, width)) + [start + width * -(-(top - start) // width)]
    if edges[-1] < hi:
        edges.append(hi)
    return np.asarray(edges, dtype=np.int64)


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """Percentiles, histogram and the share over each candidate seq_len, for token lengths."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return {"count": 0}
    hi = int(lens.max())
    edges = histogram_edges(lens)
    counts, _ = np.histogram(lens, bins=edges)
    p50, p90, p99 = (int(np.ceil(np.percentile(lens, q))) for q in (50, 90, 99))
    candidates = []
    for c in CANDIDATE_SEQ_LENS:
        candidates.append({"seq_len": c, "share_over": float((lens > c).mean())})
        if c >= hi:
            break
    return {
        "count": int(lens.size),
        "min": int(lens.min()),
        "mean": float(lens.mean()),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": hi,
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "candidates": candidates,
        "suggested_seq_len": suggest_seq_len(p99),
    }


def format_summary(manifest: dict[str, Any], reused: bool, where: str) -> str:
    """The multi-line report printed by `spotune prepare`."""
    fp = manifest["fingerprint"]
    verb = "reused cached dataset" if reused else "built dataset"
    lines = [f"spotune prepare: {verb} {fp} at {where}"]
    s = manifest["settings"]
    lines.append(f"  format={s['format']} seq_len={s['seq_len']} packing={s['packing']} overlong={s['overlong']}")
    for m in manifest.get("sources", {}).get("mix", []):
        share = "all rows" if m["chosen"] == m["rows"] else f"{m['chosen']:,} chosen (seeded)"
        lines.append(f"  source {m['key']}: {m['source']}: {m['rows']:,} rows, {share}")
    for split in ("train", "eval"):
        st = manifest.get(split)
        if st:
            lines.extend(_split_lines(split, st, s["seq_len"], s["overlong"]))
            lines.extend(dropped.summary_lines(st, where))  # each dropped row's file and line
    return "\n".join(lines)


def _split_lines(name: str, st: dict[str, Any], seq_len: int, overlong: str) -> list[str]:
    dropped = st["dropped"]
    drops = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items()) if v) or "none"
    unit = "pairs" if "pairs" in st else "examples"  # preference rows count (and drop) whole pairs
    out = [
        f"{name}: {st['examples_in']:,} {unit} in -> {st['examples_out']:,} kept; dropped: {drops}; "
        f"truncated: {st['truncated']:,}",
        f"  read as {st.get('format')}, chat template: {st.get('chat_template') or 'none (raw text)'}",
        f"  tokens: {st['real_tokens']:,} real, {st['trainable_tokens']:,} trainable, in {st['rows']:,} rows of {seq_len}",
        f"  packing efficiency: {st['packing_efficiency']:.2%} (real tokens / rows x seq_len); "
        f"padding random batches of {st['baseline']['batch_size']} to their longest instead: "
        f"{st['baseline']['efficiency']:.2%}",
    ]
    per_source = st.get("sources", [])
    if len(per_source) > 1 or any(ps["examples_out"] < ps["examples_in"] or ps["truncated"] for ps in per_source):
        for ps in per_source:  # every row a source lost, and why: none goes silently
            lost = ", ".join(f"{k} {v}" for k, v in sorted(ps["dropped"].items()) if v) or "none"
            out.append(
                f"  from {ps['key']}: {ps['examples_in']:,} in -> {ps['examples_out']:,} kept; dropped: {lost}; "
                f"truncated: {ps['truncated']:,}"
            )
    ls = st["lengths"]
    if not ls.get("count"):
        return out
    out.append(
        f"  {unit[:-1]} length in tokens (with EOS, before truncation): p50 {ls['p50']}  p90 {ls['p90']}  "
        f"p99 {ls['p99']}  max {ls['max']}  mean {ls['mean']:.0f}"
    )
    out.extend("  " + line for line in ascii_histogram(ls["histogram"]))
    action = "dropped" if overlong == "drop" else "truncated"
    out.append(f"  suggested seq_len: {ls['suggested_seq_len']} (smallest multiple of 64 holding p99)")
    out.append(f"  share of examples that would be {action} at seq_len:")
    out.append("    " + "  ".join(f"{c['seq_len']}: {c['share_over']:.1%}" for c in ls["candidates"]))
    return out


def ascii_histogram(hist: dict[str, list[int]], width: int = 40) -> list[str]:
    edges, counts = hist["edges"], hist["counts"]
    top = max(counts) if counts else 0
    w = len(str(edges[-1])) if edges else 1
    lines = []
    for lo, hi, n in zip(edges[:-1], edges[1:], counts, strict=False):
        bar = "#" * (round(width * n / top) if top else 0)
        lines.append(f"{lo:>{w}}-{hi - 1:<{w}} |{bar:<{width}} {n}")
    return lines
