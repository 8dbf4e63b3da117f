"""How much work a recipe is: packed rows and tokens, exact from a prepared manifest or
extrapolated from a sample run through the same preparation pipeline.

A manifest is used when one under the recipe's data cache matches its source file and
every packing setting; otherwise up to `sample_size` examples are prepared in a scratch
directory (same templates, tokenizer, truncation and packing) and the counts are scaled
by total examples / sampled examples. The result says which it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import DataConfig
from trainer.progress import datasets_bars


@dataclass(frozen=True)
class Workload:
    """Per-epoch counts of the training split (and the eval split when there is one)."""

    source: str
    """`manifest` (exact), `sample` (extrapolated) or `given` (`--tokens N`, from_tokens)."""
    rows: float
    real_tokens: float
    trainable_tokens: float
    examples: int
    doc_len_sq_sum: float
    """Sum over documents of length**2: exact from a manifest that records it (scaled, from a sample), else
    from the length histogram."""
    eval_rows: float = 0.0
    eval_real_tokens: float = 0.0
    sampled_examples: int | None = None
    manifest_path: str | None = None
    prepare_seconds: float | None = None
    """How long preparing this data took when its manifest was written (None: not prepared)."""
    truncation: dict[str, Any] | None = None
    """What seq_len loses, counted in the manifest or the sample (trainer/data/stats.py `truncation`,
    with the p99 length under `p99`); None: not known (`--tokens`, or a manifest from before it)."""
    pairs: float | None = None
    """Preference pairs per epoch (packed a varying number per row); None for SFT rows."""

    @property
    def exact(self) -> bool:
        return self.source == "manifest"

    @property
    def real_tokens_per_row(self) -> float:
        return self.real_tokens / self.rows if self.rows else 0.0


def from_tokens(tokens: float, seq_len: int) -> Workload:
    """The work of `tokens` real tokens per epoch, given on the command line (`--tokens N`) for data
    not at hand: rows packed full (seq_len tokens each), every token trained, and one document per
    row, which makes the attention FLOPs an upper bound (shorter documents attend to less)."""
    rows = math.ceil(tokens / seq_len)
    return Workload(
        source="given",
        rows=float(rows),
        real_tokens=float(tokens),
        trainable_tokens=float(tokens),
        examples=rows,
        doc_len_sq_sum=float(rows) * seq_len**2,
    )


def find_manifest(
    data: DataConfig, resolved_path: str, cache_root: Path, pairs: bool = False
) -> tuple[dict[str, Any], Path] | None:
    """The newest complete manifest under `cache_root` built from this source with these settings.

    Matching is on the source path and the packing settings, not the content hash: if the
    file changed since, `spotune train` re-prepares and this estimate was of the old data.
    """
    if not cache_root.is_dir():
        return None
    want = {"seq_len": data.seq_len, "packing": data.packing, "format": data.format, "overlong": data.overlong}
    best: tuple[str, dict[str, Any], Path] | None = None
    for path in cache_root.glob("*/manifest.json"):
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        settings = m.get("settings", {})
        if any(settings.get(k) != v for k, v in want.items()) or bool(settings.get("pairs")) != pairs:
            continue
        if str(m.get("sources", {}).get("train")) != str(Path(resolved_path)):
            continue
        if not m.get("train"):
            continue
        created = str(m.get("created_utc", ""))
        if best is None or created > best[0]:
            best = (created, m, path)
    return (best[1], best[2]) if best else None


def from_manifest(manifest: dict[str, Any], path: Path | None = None) -> Workload:
    train = manifest["train"]
    ev = manifest.get("eval") or {}
    return Workload(
        source="manifest",
        rows=float(train["rows"]),
        real_tokens=float(train["real_tokens"]),
        trainable_tokens=float(train["trainable_tokens"]),
        examples=int(train["examples_out"]),
        doc_len_sq_sum=doc_len_sq(train, manifest["settings"]["seq_len"]),
        eval_rows=float(ev.get("rows", 0)),
        eval_real_tokens=float(ev.get("real_tokens", 0)),
        manifest_path=str(path) if path else None,
        prepare_seconds=float(manifest["seconds"]) if manifest.get("seconds") is not None else None,
        truncation=_truncation(train),
        pairs=float(train["pairs"]) if train.get("pairs") is not None else None,
    )


def _truncation(split: dict[str, Any]) -> dict[str, Any] | None:
    """A manifest split's `truncation` record with its p99 length, or None when it has none."""
    tr = split.get("truncation")
    if tr is None:
        return None
    lengths = split.get("lengths") or {}
    return {**tr, "p99": lengths.get("p99") if lengths.get("count") else None}


def doc_len_sq(split: dict[str, Any], seq_len: int) -> float:
    """Sum of squared document lengths of a manifest split: exact as packed (`doc_len_sq`, each of a pair's
    answers a document, as the meter counts them), else, from a manifest before it, from its histogram."""
    if split.get("doc_len_sq") is not None:
        return float(split["doc_len_sq"])
    return doc_len_sq_from_lengths(split.get("lengths", {}), seq_len, int(split["examples_out"]))


def doc_len_sq_from_lengths(lengths: dict[str, Any], seq_len: int, documents: int) -> float:
    """Sum of squared document lengths from the manifest's histogram (bin midpoints, capped
    at seq_len since longer examples are truncated or dropped); scaled to `documents`."""
    hist = lengths.get("histogram") if lengths else None
    if not hist or not hist.get("counts"):
        mean = float(lengths.get("mean", seq_len)) if lengths else float(seq_len)
        return documents * min(mean, seq_len) ** 2
    edges, counts = hist["edges"], hist["counts"]
    total = sum(counts)
    sq = sum(c * min((lo + hi) / 2.0, seq_len) ** 2 for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=False))
    return sq * (documents / total) if total else 0.0


def from_sample(
    data: DataConfig,
    resolved_path: str,
    tokenizer_path: str,
    *,
    sample_size: int = 2000,
    seed: int = 0,
    pairs: bool = False,
) -> Workload:
    """Prepare the first `sample_size` examples (pairs, for a preference objective) in a scratch directory and extrapolate."""
    from trainer.data import prepare
    from trainer.data.prepare import FORMAT_FIELDS
    from trainer.data.sources import write_sample

    # No datasets bars: a sample is quick, and the estimate's output is a table (maybe a log file's).
    with tempfile.TemporaryDirectory(prefix="spotune-estimate-") as tmp, datasets_bars(False):
        # Every source of a mix in its share, local or on the hub (trainer/data/sources.py).
        resolved = dataclasses.replace(data, path=resolved_path)
        sample_cfg, total, n = write_sample(resolved, FORMAT_FIELDS, Path(tmp), sample_size, seed)
        # An eval_fraction split applies to the sample as to the whole; a separate eval source is
        # not sampled (its evaluation time shows once the data is prepared).
        if data.eval_path is not None or data.eval_split is not None:
            sample_cfg = dataclasses.replace(sample_cfg, eval_path=None, eval_split=None, eval_fraction=0.0)
        prepared = prepare(sample_cfg, tokenizer_path, Path(tmp) / "cache", progress=False, seed=seed, pairs=pairs)
        m = prepared.manifest
    scale = total / n if n else 0.0
    train = m["train"]
    ev = m.get("eval") or {}
    # Packing gets a little tighter with more documents to choose from: rows scale at most linearly.
    rows = math.ceil(train["rows"] * scale)
    return Workload(
        source="sample",
        rows=float(rows),
        real_tokens=train["real_tokens"] * scale,
        trainable_tokens=train["trainable_tokens"] * scale,
        examples=round(train["examples_out"] * scale),
        doc_len_sq_sum=doc_len_sq(train, data.seq_len) * scale,
        eval_rows=float(ev.get("rows", 0)) * scale,
        eval_real_tokens=float(ev.get("real_tokens", 0)) * scale,
        sampled_examples=n,
        truncation=_truncation(train),  # shares of the sample: not scaled
        pairs=train["pairs"] * scale if train.get("pairs") is not None else None,
    )
