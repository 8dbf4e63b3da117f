"""Length statistics for the manifest, what `data.seq_len` loses, and the human-readable summary
built from a manifest.

Two rules are defined here once, for `prepare`, `inspect`, `estimate` and `train` alike:
- the suggested `seq_len` (`suggest_seq_len`, described by `SEQ_LEN_RULE`, the text printed with it);
- what `seq_len` loses (`truncation`): examples longer than it are cut (`overlong: truncate`) or
  dropped (`overlong: drop`, or no trained token left after the cut), counted in what the model
  learns (trained tokens cut, answers that lose their end of turn), and a warning naming the
  `seq_len` that fixes it is printed when more than `WARN_SHARE` of those are lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.data import dropped
from trainer.data.template import NO_TRAINABLE_AFTER_TRUNCATION, OVERLONG

CANDIDATE_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
HIST_BINS = 20
BASELINE_BATCH = 8  # batch size of the "pad each batch to its longest" baseline in the manifest
SEQ_LEN_MULTIPLE = 64
"""Suggested seq_lens are multiples of this (attention kernels tile by 64 and more)."""
SEQ_LEN_RULE = f"the smallest multiple of {SEQ_LEN_MULTIPLE} holding p99"
"""What `suggest_seq_len` computes, in the words printed beside its result."""
WARN_SHARE = 0.01
"""Warn when more than this share of the trained tokens (or of the answers' ends of turn; of the examples
where those were not counted) is lost at the seq_len in use (p99 holds 99%)."""
LOST_TO_SEQ_LEN = ("", OVERLONG, NO_TRAINABLE_AFTER_TRUNCATION)
"""Statuses of the examples `truncation` counts: kept, or dropped only because of seq_len."""


def suggest_seq_len(p99: int) -> int:
    """`SEQ_LEN_RULE`: the smallest multiple of `SEQ_LEN_MULTIPLE` that holds the p99 example."""
    return max(1, -(-int(p99) // SEQ_LEN_MULTIPLE)) * SEQ_LEN_MULTIPLE


def truncation(
    lengths: np.ndarray,
    status: np.ndarray,
    seq_len: int,
    held: np.ndarray | None = None,
    answers: np.ndarray | None = None,
) -> dict[str, Any]:
    """What `seq_len` costs the data: the examples that lose tokens to it and the tokens lost, and,
    with `answers`, what the model would learn from them: the trained tokens cut and the answers
    that lose their end of turn (so never learn to stop).

    `lengths` are token lengths before truncation, `status` each example's drop reason ("" kept).
    An example longer than `seq_len` loses its tokens past `seq_len` when it is kept (truncated),
    and all of them when it is dropped for its length (`overlong`) or for having no trained
    token left after the cut. Examples dropped for other reasons never met `seq_len`.

    Preference pairs pass `held`, the tokens each pair keeps: each answer is capped apart (data.max_length and
    its kin, as in TRL) before the pair must fit a row, so a pair is truncated when it keeps fewer tokens than
    it has, and every length drop counts; the record then says `"unit": "pairs"`.
    `answers`: each example's `ANSWERS_CUT` row (trainer/data/template.py), [trained tokens, of them
    cut, answers, of them cut before their end of turn].
    """
    lens = np.asarray(lengths, dtype=np.int64)
    st = np.asarray(status, dtype=object)
    met = np.isin(st, LOST_TO_SEQ_LEN)
    kept, over = st == "", lens > seq_len
    if held is not None:
        over = np.asarray(held, dtype=np.int64) < lens
        cut = int((lens - np.asarray(held, dtype=np.int64))[kept & over].sum())
        over |= ~kept  # a pair dropped for its length (by any cap) lost all of it
    else:
        cut = int(np.maximum(lens[kept & over] - seq_len, 0).sum())
    whole = int(lens[met & ~kept & over].sum())
    out = {
        "seq_len": int(seq_len),
        "examples": int(met.sum()),
        "tokens": int(lens[met].sum()),
        "truncated": int((kept & over).sum()),
        "dropped": int((met & ~kept & over).sum()),
        "tokens_lost": cut + whole,
        **({"unit": "pairs"} if held is not None else {}),
        "max": int(lens[met].max()) if met.any() else 0,
    }
    if answers is not None:
        met_answers = np.asarray(answers, dtype=np.int64).reshape(-1, 4)[met]
        trained, trained_lost, n_answers, ends_lost = (int(v) for v in met_answers.sum(axis=0))
        out.update(trained=trained, trained_lost=trained_lost, answers=n_answers, ends_lost=ends_lost)
    return out


def truncation_lines(tr: dict[str, Any], p99: int | None, where: str = "") -> list[str]:
    """The share of examples, of tokens and (where counted) of trained tokens `seq_len` loses, and the
    answers that lose their end of turn; a warning when more than `WARN_SHARE` of the examples or of the
    trained tokens are lost, or an answer loses its end, naming the seq_len that holds p99
    (`SEQ_LEN_RULE`), or every example when p99 fits already. `where`: the figures' source, when not exact."""
    n, tokens = tr["examples"], tr["tokens"]
    hit = tr["truncated"] + tr["dropped"]
    share = hit / n if n else 0.0
    token_share = tr["tokens_lost"] / tokens if tokens else 0.0
    how = ", ".join(
        part
        for part in (
            f"{tr['truncated']:,} truncated" if tr["truncated"] else "",
            f"{tr['dropped']:,} dropped" if tr["dropped"] else "",
        )
        if part
    )
    unit = tr.get("unit", "examples")
    at = f"at seq_len {tr['seq_len']} (in use)"
    if tr.get("max_length"):  # preference pairs capped per answer, as TRL's max_length
        at = f"at max_length {tr['max_length']} per answer, in rows of seq_len {tr['seq_len']}"
    head = f"{at}: {hit:,} of {n:,} {unit} lose tokens ({share:.1%}" + (f": {how}" if how else "")
    trained = tr.get("trained")
    if trained is None:  # a manifest from before the trained tokens were counted, or preference pairs
        lines = [f"{head}), {tr['tokens_lost']:,} of {tokens:,} tokens lost ({token_share:.1%}){where}"]
        warn = share > WARN_SHARE
        learnt_share, ends = 0.0, 0
    else:
        learnt_share = tr["trained_lost"] / trained if trained else 0.0
        ends = tr["ends_lost"]
        lines = [
            f"{head}): {tr['trained_lost']:,} of {trained:,} trained tokens cut ({learnt_share:.1%}), "
            f"{ends:,} of {tr['answers']:,} answers lose their end of turn; {tr['tokens_lost']:,} of {tokens:,} "
            f"tokens in all ({token_share:.1%}){where}"
        ]
        # what the model learns decides: a cut prompt costs context, a cut answer its ending
        warn = learnt_share > WARN_SHARE or ends > WARN_SHARE * tr["answers"]
    if warn:
        lines.append(_warning(tr, share, learnt_share, ends, p99))
    return lines


def _warning(tr: dict[str, Any], share: float, learnt_share: float, ends: int, p99: int | None) -> str:
    """The warning line: what is lost, and the seq_len that fixes it (always named)."""
    seq_len = tr["seq_len"]
    if tr.get("trained") is not None:
        what = f"{learnt_share:.1%} of the trained tokens are cut at seq_len {seq_len}" + (
            f" and {ends:,} answers lose their end of turn, so the model does not learn where to stop" if ends else ""
        )
    else:
        what = f"{share:.1%} of the examples lose tokens at seq_len {seq_len} (more than {WARN_SHARE:.0%})"
    if p99 is not None and p99 > seq_len:
        fix = f"data.seq_len={suggest_seq_len(p99)} holds p99 ({p99:,} tokens; {SEQ_LEN_RULE})"
    else:  # p99 fits: only the tail is cut, and only a seq_len holding the longest keeps all of it
        longest = int(tr.get("max") or 0)
        fix = (
            f"data.seq_len={suggest_seq_len(longest)} holds every example (the longest: {longest:,} tokens)"
            if longest > seq_len
            else ""
        )
    return f"WARNING: {what}" + (f"; {fix}" if fix else "")


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
    caps = s.get("pair_lengths")
    if caps:  # preference pairs: each answer capped apart, as TRL reads these keys
        said = " ".join(f"{k}={v}" for k, v in caps.items() if v is not None)
        lines.append(f"  each answer's sequence (prompt + answer): {said}; a row of {s['seq_len']} holds the pair")
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
    p99 = ls.get("p99") if ls.get("count") else None
    out.extend("  " + line for line in seq_len_lines(st, seq_len, p99))
    if not ls.get("count"):
        return out
    out.append(
        f"  {unit[:-1]} length in tokens (with EOS, before truncation): p50 {ls['p50']}  p90 {ls['p90']}  "
        f"p99 {ls['p99']}  max {ls['max']}  mean {ls['mean']:.0f}"
    )
    out.extend("  " + line for line in ascii_histogram(ls["histogram"]))
    action = "dropped" if overlong == "drop" else "truncated"
    out.append(f"  suggested seq_len: {suggest_seq_len(ls['p99'])} ({SEQ_LEN_RULE})")
    shares = {c["seq_len"]: c["share_over"] for c in ls["candidates"]}
    tr = st.get("truncation")
    if tr and tr["examples"]:
        shares[seq_len] = (tr["truncated"] + tr["dropped"]) / tr["examples"]
    out.append(f"  share of examples that would be {action} at seq_len:")
    out.append(
        "    "
        + "  ".join(f"{n}: {share:.1%}{' (in use)' if n == seq_len else ''}" for n, share in sorted(shares.items()))
    )
    return out


def seq_len_lines(st: dict[str, Any], seq_len: int, p99: int | None) -> list[str]:
    """A split's truncation lines from its manifest entry (`truncation`; a manifest written before
    it was recorded has the count of truncated examples only)."""
    tr = st.get("truncation")
    if tr is None:
        kept = st.get("examples_out") or 0
        share = st.get("truncated", 0) / kept if kept else 0.0
        return [
            f"at seq_len {seq_len} (in use): {st.get('truncated', 0):,} of {kept:,} kept examples truncated "
            f"({share:.1%}); tokens lost not recorded (prepared by an earlier spotune)"
        ]
    return truncation_lines(tr, p99)


def brief_summary(manifest: dict[str, Any], reused: bool, where: str) -> str:
    """What `train` prints of its data when it reused a prepared dataset (the full report is
    `spotune inspect`'s): the counts, and what seq_len loses."""
    s, st = manifest["settings"], manifest["train"]
    verb = "reused cached dataset" if reused else "built dataset"
    drops = sum(st["dropped"].values())
    lines = [
        f"spotune prepare: {verb} {manifest['fingerprint']} at {where}: {st['examples_out']:,} examples "
        f"({drops:,} dropped), {st['real_tokens']:,} real tokens in {st['rows']:,} rows of {s['seq_len']}",
    ]
    ls = st["lengths"]
    lines += ["  " + line for line in seq_len_lines(st, s["seq_len"], ls.get("p99") if ls.get("count") else None)]
    return "\n".join(lines)


def ascii_histogram(hist: dict[str, list[int]], width: int = 40) -> list[str]:
    edges, counts = hist["edges"], hist["counts"]
    top = max(counts) if counts else 0
    w = len(str(edges[-1])) if edges else 1
    lines = []
    for lo, hi, n in zip(edges[:-1], edges[1:], counts, strict=False):
        bar = "#" * (round(width * n / top) if top else 0)
        lines.append(f"{lo:>{w}}-{hi - 1:<{w}} |{bar:<{width}} {n}")
    return lines
