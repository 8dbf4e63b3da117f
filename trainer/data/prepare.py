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
from trainer.data.read import DataError, require_fields
from trainer.data.sources import Located, Source, choose, eval_sources, local_files, locate, sources_of
from trainer.data.sources import read as read_source
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


@dataclass(frozen=True)
class _Plan:
    """The located sources of one prepare and what identifies its output."""

    train: list[Located]
    eval: list[Located]
    """`data.eval_path`, or the training sources' `data.eval_split`; none: eval_fraction or no eval."""
    settings: dict[str, Any]
    fingerprint: str


def prepare(
    cfg: DataConfig, tokenizer_path: str, cache_root: Path, *, progress: bool = True, seed: int = 0
) -> Prepared:
    """Build (or reuse) the packed dataset for `cfg` under `cache_root/<fingerprint>/`."""
    cache_root = Path(cache_root)
    plan = _plan(cfg, tokenizer_path, seed)
    fp = plan.fingerprint
    cache.clean_stale(cache_root)
    manifest = cache.load_complete(cache_root, fp)
    reused = manifest is not None
    if manifest is None:
        with cache.atomic_build(cache_root, fp) as tmp, _progress_bars(progress):
            manifest = _build(cfg, tokenizer_path, tmp, plan, seed)
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
    return _plan(cfg, tokenizer_path, seed).fingerprint


def _plan(cfg: DataConfig, tokenizer_path: str, seed: int) -> _Plan:
    train = [locate(s) for s in sources_of(cfg, FORMAT_FIELDS)]
    ev = [locate(s) for s in eval_sources(cfg, FORMAT_FIELDS)]
    settings = _settings(cfg, seed, train, ev)
    # Local sources by their bytes; a hub source by its commit, which is in the settings.
    data: list[Path | None] = [*local_files(train), *(local_files(ev) if ev else [None])]
    return _Plan(train, ev, settings, cache.fingerprint(data, tokenizer_path, settings))


def _settings(cfg: DataConfig, seed: int, train: list[Located], ev: list[Located]) -> dict[str, Any]:
    """Every setting that changes the output rows (and nothing that does not, e.g. num_proc)."""
    split: dict[str, Any] = {"eval_sources": [loc.describe() for loc in ev] or None}
    if not ev and cfg.eval_fraction > 0:
        split.update(eval_fraction=cfg.eval_fraction, seed=seed)
    mixed = any(loc.source.rows is not None or loc.source.fraction is not None for loc in train)
    chat = any(loc.source.fmt != "text" for loc in train)  # only raw text never meets a chat template
    return {
        "format": cfg.format,
        "sources": [loc.describe() for loc in train],
        "mix_seed": seed if mixed else None,
        "chat_template": cfg.chat_template if chat else None,
        "masking": {"train_on": cfg.train_on, "train_on_inputs": cfg.train_on_inputs},
        "sharegpt_roles": dict(sorted(cfg.sharegpt_roles.items())),
        "seq_len": cfg.seq_len,
        "packing": cfg.packing,
        "overlong": cfg.overlong,
        "eval": split,
        "pipeline_version": cache.PIPELINE_VERSION,
    }


def _build(cfg: DataConfig, tokenizer_path: str, tmp: Path, plan: _Plan, seed: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot load a tokenizer from {tokenizer_path!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "set data.tokenizer (or model.name_or_path) to a directory holding tokenizer files."
        ) from e  # the cause tells a hub that does not answer (exit 143) from a wrong path (exit 2)
    train_parts, eval_parts, mix = _read_sources(cfg, plan, seed)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else pad_id  # pad tokens are never attended to by real tokens nor trained
    scratch = tmp / "scratch"
    scratch.mkdir()
    manifest: dict[str, Any] = {
        "fingerprint": plan.fingerprint,
        "pipeline_version": cache.PIPELINE_VERSION,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": plan.settings,
        "sources": {
            "train": _labels(plan.train),
            "eval": _labels(plan.eval),
            "tokenizer": tokenizer_path,
            "mix": mix,
        },
        "pad_id": int(pad_id),
        "train": None,
        "eval": None,
    }
    for name, parts in (("train", train_parts), ("eval", eval_parts)):
        if parts:
            job = _Job(tokenizer, tokenizer_path, cfg, name, scratch, plan.fingerprint, pad_id)
            manifest[name] = _tokenize_pack_save(parts, job, tmp, seed)
    shutil.rmtree(scratch, ignore_errors=True)
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    _plot(manifest, tmp / "lengths.png")
    cache.write_manifest(tmp, manifest)  # last: its presence marks the entry complete
    return manifest


Parts = list[tuple[Located, datasets.Dataset]]


def _labels(located: list[Located]) -> str | list[str] | None:
    """One source's label (what a single-source manifest always held), a mix's list, or None."""
    labels = [loc.label for loc in located]
    return labels[0] if len(labels) == 1 else (labels or None)


def _read_sources(cfg: DataConfig, plan: _Plan, seed: int) -> tuple[Parts, Parts, list[dict[str, Any]]]:
    """Each source's raw rows, cut to its share, then split into train and eval parts."""
    train: Parts = []
    evals: Parts = []
    mix: list[dict[str, Any]] = []
    for i, loc in enumerate(plan.train):
        raw = _read(loc)
        chosen = choose(raw, loc.source, seed, i)
        mix.append(
            {"key": loc.source.key, "source": loc.label, "commit": loc.commit, "rows": len(raw), "chosen": len(chosen)}
        )
        if not plan.eval and cfg.eval_fraction > 0:
            kept, held = _split(chosen, cfg.eval_fraction, seed, loc.source.key)
            train.append((loc, kept))
            evals.append((loc, held))
        else:
            train.append((loc, chosen))
    if plan.eval:
        evals = [(loc, _read(loc)) for loc in plan.eval]
    return train, evals, mix


def _read(loc: Located) -> datasets.Dataset:
    ds = read_source(loc)
    return ds.add_column(_ROW, np.arange(len(ds), dtype=np.int64))


def _check_fields(ds: datasets.Dataset, src: Source, source: str) -> None:
    def key(cfg_key: str, role: str) -> str:  # the key a user sets to fix it
        return f"{src.key}.fields.{role}" if src.key.startswith("data.sources[") else f"data.{cfg_key}"

    need = {key(k, role): src.fields[role] for k, role, required in FORMAT_FIELDS[src.fmt] if required}
    require_fields([c for c in ds.column_names if c != _ROW], need, source)


def _head(ds: datasets.Dataset) -> list[dict[str, Any]]:
    """The first rows, which `format: auto` and the format checks look at."""
    return list(ds.select(range(min(HEAD_ROWS, len(ds)))))


def _split(ds: datasets.Dataset, fraction: float, seed: int, key: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic held-out split: a seeded permutation, the first share goes to eval."""
    n = len(ds)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise DataError(
            f"data.eval_fraction={fraction} leaves no training example of {key} out of {n}; "
            "lower data.eval_fraction or add data."
        )
    perm = np.random.default_rng(seed).permutation(n)
    return ds.select(np.sort(perm[n_eval:])), ds.select(np.sort(perm[:n_eval]))


@dataclass(frozen=True)
class _Job:
    """What tokenising one split needs besides its parts."""

    tokenizer: Any
    tokenizer_path: str
    cfg: DataConfig
    name: str
    scratch: Path
    fp: str
    pad_id: int


def _tokenize(loc: Located, raw: datasets.Dataset, job: _Job, j: int) -> tuple[datasets.Dataset, Tokenize]:
    """One source's rows through its own template (format and fields)."""
    src = loc.source
    if src.key.startswith("data.sources[") and src.fmt != "auto":
        _check_fields(raw, src, loc.label)  # names data.sources[i].fields.<role>, the key to fix
    # The source's own DataConfig (its format and columns): built like a single-source prepare's.
    cfg = src.data_config(job.cfg, FORMAT_FIELDS)
    tok = tokenize_for(cfg, job.tokenizer, source=loc.label)
    tok = tok.settle([c for c in raw.column_names if c != _ROW], _head(raw), job.tokenizer_path)
    tokenized = raw.map(
        tok,
        batched=True,
        remove_columns=raw.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        features=_TOKENIZED,
        cache_file_name=str(job.scratch / f"{job.name}-{j}.arrow"),
        new_fingerprint=f"{job.fp}-{job.name}-{j}",  # skips hashing the tokenizer-holding function
        desc=f"tokenize {job.name} ({src.key})",
    )
    return tokenized, tok


def _how(tok: Tokenize) -> dict[str, Any]:
    """How a source was read: its format (and why, when `auto` chose it) and the chat template."""
    name = template_name(tok.chat_template) if tok.template is not None else None
    return {"format": tok.fmt, "format_reason": tok.reason, "chat_template": name}


def _tokenize_pack_save(parts: Parts, job: _Job, out_dir: Path, seed: int) -> dict[str, Any]:
    cfg, name = job.cfg, job.name
    pieces, per_source = [], []
    for j, (loc, raw) in enumerate(parts):
        piece, tok = _tokenize(loc, raw, job, j)
        st = np.asarray(piece["status"], dtype=object)
        n_kept = int((st == "").sum())
        counts = Counter(s for s in st.tolist() if s)
        if n_kept == 0:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            raise DataError(
                f"{loc.label} ({loc.source.key}): no {name} example is left after templating ({reasons}); "
                "check its format and field settings, or raise data.seq_len / set data.overlong=truncate."
            )
        lens = np.asarray(piece["length"], dtype=np.int64)
        per_source.append(
            {
                "key": loc.source.key,
                "source": loc.label,
                **_how(tok),
                "examples_in": len(raw),
                "examples_out": n_kept,
                "dropped": dict(sorted(counts.items())),
                "truncated": int(((lens > cfg.seq_len) & (st == "")).sum()),
            }
        )
        pieces.append(piece)
    tokenized = pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)
    status = np.asarray(tokenized["status"], dtype=object)
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    ids_arr = tokenized.data.column("input_ids").combine_chunks()
    lab_arr = tokenized.data.column("labels").combine_chunks()
    offsets = ids_arr.offsets.to_numpy()
    if not np.array_equal(offsets, lab_arr.offsets.to_numpy()):
        raise RuntimeError("internal error: input_ids and labels disagree in length")
    kept = np.flatnonzero(status == "")
    dropped = Counter(s for s in status.tolist() if s)
    doc_lens = np.diff(offsets)[kept]
    if cfg.packing:
        bins_local, algorithm = pack_lengths(doc_lens, cfg.seq_len)
    else:
        bins_local, algorithm = one_per_row(doc_lens), "one_per_row"
    bins = [[int(kept[i]) for i in b] for b in bins_local]
    rows = build_rows(ids_arr.values.to_numpy(), lab_arr.values.to_numpy(), offsets, bins, cfg.seq_len, job.pad_id)
    _save_rows(rows, cfg.seq_len, out_dir / name)

    n_rows, real = len(bins), int(rows["num_real"].sum())
    return {
        **{k: per_source[0][k] for k in ("format", "format_reason", "chat_template")},  # the first source's
        "examples_in": len(status),
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
        "sources": per_source,
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
