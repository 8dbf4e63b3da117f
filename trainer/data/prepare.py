"""`prepare`: read -> template -> tokenise once -> pack -> Arrow dataset + manifest, cached by content hash."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets import Features, Value

try:
    from datasets import List  # datasets >= 4
except ImportError:  # datasets 3.x spells a variable-length list `Sequence`
    from datasets import Sequence as List

from trainer.config import DataConfig
from trainer.data import cache
from trainer.data.chat_templates import template_name
from trainer.data.formats import FORMAT_FIELDS
from trainer.data.pack import batch_pad_efficiency, build_rows, one_per_row, pack_lengths
from trainer.data.read import DataError, check_source, read_rows
from trainer.data.stats import BASELINE_BATCH, format_summary, length_stats
from trainer.data.template import HEAD_ROWS, Tokenize, tokenize_for
from trainer.data.template import ROW_COLUMN as _ROW

_TOKENIZED = Features(
    {
        "input_ids": List(Value("int32")),
        "labels": List(Value("int32")),
        "length": Value("int32"),
        "status": Value("string"),
    }
)


@dataclass(frozen=True)
class Prepared:
    train_path: Path
    """Packed training rows; open with `datasets.load_from_disk`."""
    eval_path: Path | None
    manifest: dict[str, Any]
    reused: bool
    """True when an earlier prepare with identical inputs was found and reused."""
    fingerprint: str
    """Content hash of everything that determines the rows."""

    def summary(self) -> str:
        return format_summary(self.manifest, self.reused, str(self.train_path.parent))


def prepare(
    cfg: DataConfig, tokenizer_path: str, cache_root: Path, *, progress: bool = True, seed: int = 0
) -> Prepared:
    """Build (or reuse) the packed dataset for `cfg` under `cache_root/<fingerprint>/`."""
    cache_root = Path(cache_root)
    data_path = check_source(cfg.path, key="data.path")
    eval_src = check_source(cfg.eval_path, key="data.eval_path") if cfg.eval_path else None
    settings = _settings(cfg, seed)
    fp = data_fingerprint(cfg, tokenizer_path, seed)
    cache.clean_stale(cache_root)
    manifest = cache.load_complete(cache_root, fp)
    reused = manifest is not None
    if manifest is None:
        with cache.atomic_build(cache_root, fp) as tmp, _progress_bars(progress):
            manifest = _build(cfg, tokenizer_path, tmp, fp, settings, data_path, eval_src, seed)
    final = cache_root / fp
    return Prepared(
        train_path=final / "train",
        eval_path=final / "eval" if manifest.get("eval") else None,
        manifest=manifest,
        reused=reused,
        fingerprint=fp,
    )


def data_fingerprint(cfg: DataConfig, tokenizer_path: str, seed: int = 0) -> str:
    """The cache key of `cfg`'s prepared data: its content, tokenizer and output settings.

    `spotune estimate` asks it too, to know whether a target directory holds the data already."""
    data_path = check_source(cfg.path, key="data.path")
    eval_src = check_source(cfg.eval_path, key="data.eval_path") if cfg.eval_path else None
    return cache.fingerprint([data_path, eval_src], tokenizer_path, _settings(cfg, seed))


def _settings(cfg: DataConfig, seed: int) -> dict[str, Any]:
    """Every setting that changes the output rows (and nothing that does not, e.g. num_proc)."""
    fields = {key: getattr(cfg, key) for key, _, _ in FORMAT_FIELDS[cfg.format]}
    split: dict[str, Any] = {"eval_path": cfg.eval_path is not None}
    if cfg.eval_path is None and cfg.eval_fraction > 0:
        split.update(eval_fraction=cfg.eval_fraction, seed=seed)
    return {
        "format": cfg.format,
        "fields": fields,
        "chat_template": cfg.chat_template if cfg.format != "text" else None,
        "masking": {"train_on": cfg.train_on, "train_on_inputs": cfg.train_on_inputs},
        "sharegpt_roles": dict(sorted(cfg.sharegpt_roles.items())),
        "seq_len": cfg.seq_len,
        "packing": cfg.packing,
        "overlong": cfg.overlong,
        "eval": split,
        "pipeline_version": cache.PIPELINE_VERSION,
    }


def _build(
    cfg: DataConfig,
    tokenizer_path: str,
    tmp: Path,
    fp: str,
    settings: dict[str, Any],
    data_path: Path,
    eval_src: Path | None,
    seed: int,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot load a tokenizer from {tokenizer_path!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "set data.tokenizer (or model.name_or_path) to a directory holding tokenizer files."
        ) from None
    train_raw = _read(data_path, "data.path")
    eval_raw = _read(eval_src, "data.eval_path") if eval_src is not None else None
    if eval_raw is None and cfg.eval_fraction > 0:
        train_raw, eval_raw = _split(train_raw, cfg.eval_fraction, seed)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id  # pad tokens are never attended to by real tokens nor trained
    scratch = tmp / "scratch"
    scratch.mkdir()
    manifest: dict[str, Any] = {
        "fingerprint": fp,
        "pipeline_version": cache.PIPELINE_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": settings,
        "sources": {"train": str(data_path), "eval": str(eval_src) if eval_src else None, "tokenizer": tokenizer_path},
        "pad_id": int(pad_id),
        "train": None,
        "eval": None,
    }
    for name, raw in (("train", train_raw), ("eval", eval_raw)):
        if raw is None:
            continue
        tok = tokenize_for(cfg, tokenizer, source=str(eval_src if name == "eval" and eval_src else data_path))
        tok = tok.settle([c for c in raw.column_names if c != _ROW], _head(raw), tokenizer_path)
        manifest[name] = _tokenize_pack_save(raw, tok, cfg, name, tmp, scratch, fp, pad_id, seed)
    shutil.rmtree(scratch, ignore_errors=True)
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    _plot(manifest, tmp / "lengths.png")
    cache.write_manifest(tmp, manifest)  # last: its presence marks the entry complete
    return manifest


def _read(path: Path, key: str) -> datasets.Dataset:
    ds = read_rows(path, key=key)
    return ds.add_column(_ROW, np.arange(len(ds), dtype=np.int64))


def _head(ds: datasets.Dataset) -> list[dict[str, Any]]:
    """The first rows, which `format: auto` and the format checks look at."""
    return list(ds.select(range(min(HEAD_ROWS, len(ds)))))


def _split(ds: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic held-out split: a seeded permutation, the first share goes to eval."""
    n = len(ds)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise DataError(
            f"data.eval_fraction={fraction} leaves no training example out of {n}; lower data.eval_fraction or add data."
        )
    perm = np.random.default_rng(seed).permutation(n)
    return ds.select(np.sort(perm[n_eval:])), ds.select(np.sort(perm[:n_eval]))


def _tokenize_pack_save(
    raw: datasets.Dataset,
    tok: Tokenize,
    cfg: DataConfig,
    name: str,
    out_dir: Path,
    scratch: Path,
    fp: str,
    pad_id: int,
    seed: int,
) -> dict[str, Any]:
    tokenized = raw.map(
        tok,
        batched=True,
        remove_columns=raw.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        features=_TOKENIZED,
        cache_file_name=str(scratch / f"{name}.arrow"),
        new_fingerprint=f"{fp}-{name}",  # skips hashing the tokenizer-holding function
        desc=f"tokenize {name}",
    )
    status = np.asarray(tokenized["status"], dtype=object)
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    ids_arr = tokenized.data.column("input_ids").combine_chunks()
    lab_arr = tokenized.data.column("labels").combine_chunks()
    offsets = ids_arr.offsets.to_numpy()
    if not np.array_equal(offsets, lab_arr.offsets.to_numpy()):
        raise RuntimeError("internal error: input_ids and labels disagree in length")
    kept = np.flatnonzero(status == "")
    dropped = Counter(s for s in status.tolist() if s)
    if kept.size == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items()))
        raise DataError(
            f"{tok.source}: no {name} example is left after templating ({reasons}); "
            "check data.format and the field settings, or raise data.seq_len / set data.overlong=truncate."
        )
    doc_lens = np.diff(offsets)[kept]
    if cfg.packing:
        bins_local, algorithm = pack_lengths(doc_lens, cfg.seq_len)
    else:
        bins_local, algorithm = one_per_row(doc_lens), "one_per_row"
    bins = [[int(kept[i]) for i in b] for b in bins_local]
    rows = build_rows(ids_arr.values.to_numpy(), lab_arr.values.to_numpy(), offsets, bins, cfg.seq_len, pad_id)
    _save_rows(rows, cfg.seq_len, out_dir / name)

    n_rows, real = len(bins), int(rows["num_real"].sum())
    return {
        "format": tok.fmt,
        "format_reason": tok.reason,
        "chat_template": template_name(tok.chat_template) if tok.template is not None else None,
        "examples_in": len(raw),
        "examples_out": int(kept.size),
        "dropped": dict(sorted(dropped.items())),
        "truncated": int((lengths[kept] > cfg.seq_len).sum()),
        "real_tokens": real,
        "trainable_tokens": int(rows["num_trainable"].sum()),
        "rows": n_rows,
        "packing_efficiency": real / (n_rows * cfg.seq_len),
        "packing_algorithm": algorithm,
        "baseline": {
            "batch_size": BASELINE_BATCH,
            "efficiency": batch_pad_efficiency(doc_lens, BASELINE_BATCH, seed),
            "what": "random batches padded to their longest example",
        },
        "lengths": length_stats(lengths[lengths > 0]),
    }


def _save_rows(rows: dict[str, np.ndarray], seq_len: int, path: Path) -> None:
    cols = {}
    for k in ("input_ids", "labels", "position_ids"):
        flat = pa.array(rows[k].reshape(-1), type=pa.int32())
        cols[k] = pa.FixedSizeListArray.from_arrays(flat, seq_len)
    cols["num_real"] = pa.array(rows["num_real"], type=pa.int32())
    cols["num_trainable"] = pa.array(rows["num_trainable"], type=pa.int32())
    datasets.Dataset(pa.table(cols)).save_to_disk(str(path))


def _plot(manifest: dict[str, Any], png: Path) -> None:
    try:
        from trainer.data.report import plot_lengths

        plot_lengths(manifest, png)
    except ImportError:
        print("spotune prepare: matplotlib is not installed; skipping lengths.png", file=sys.stderr)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """datasets' progress bars follow a global switch: set it for this call, then restore it."""
    was = datasets.utils.logging.is_progress_bar_enabled()
    (datasets.utils.logging.enable_progress_bar if enabled else datasets.utils.logging.disable_progress_bar)()
    try:
        yield
    finally:
        (datasets.utils.logging.enable_progress_bar if was else datasets.utils.logging.disable_progress_bar)()
