"""`prepare`: read -> template -> tokenise once -> pack -> Arrow dataset + manifest, cached by content hash.

With `pairs` (a preference objective) each row becomes a chosen and a rejected sequence packed as two
documents side by side in one row (trainer/data/pairs.py), and each packed row records its pairs. KTO's
unpaired rows (trainer/data/unpaired.py) are packed the same way, an answer and its KL sequence per unit,
and each packed row also lists its units' labels (`desirable`)."""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from trainer.config import DataConfig
from trainer.data import cache, dropped, rows, tokenizer, unpaired
from trainer.data import pairs as pair_data
from trainer.data.chat_templates import resolve_chat_template, template_name, uses_date
from trainer.data.formats import FORMAT_FIELDS
from trainer.data.pack import batch_pad_efficiency, build_rows, doc_len_sq, one_per_row, pack_lengths
from trainer.data.read import DataError
from trainer.data.rows import Parts
from trainer.data.sources import Located, eval_sources, local_files, locate, sources_of
from trainer.data.stats import (
    BASELINE_BATCH,
    SEQ_LEN_RULE,
    format_summary,
    length_stats,
    suggest_seq_len,
    truncation,
)
from trainer.data.template import ANSWERS_CUT, NO_TRAINABLE_AFTER_TRUNCATION, OVERLONG, Tokenize
from trainer.progress import datasets_bars

if TYPE_CHECKING:  # imported where data is built: a run whose data is in the cache never needs it (packed.py)
    import datasets


def _tokenized_features(kind: str) -> datasets.Features:
    """The columns of tokenised rows: every kind's, then a pair's chosen length (`pairs`), a KTO row's label
    before with_kl adds the KL side (`unpaired`), or what seq_len cuts of the answers (`sft`)."""
    from datasets import Features, Value

    try:
        from datasets import List  # datasets >= 4
    except ImportError:  # datasets 3.x spells a variable-length list `Sequence`
        from datasets import Sequence as List

    common = {
        "input_ids": List(Value("int32")),
        "labels": List(Value("int32")),
        "length": Value("int32"),
        "status": Value("string"),
        "detail": Value("string"),
    }
    extra = {
        "pairs": {"chosen_length": Value("int32")},
        "unpaired": {unpaired.DESIRABLE: Value("int8")},
        "sft": {ANSWERS_CUT: List(Value("int32"))},
    }[kind]
    return Features({**common, **extra})


@dataclass(frozen=True)
class Prepared:
    train_path: Path
    """Packed training rows; open with `PackedRows` (trainer/data/packed.py)."""
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

    cfg: DataConfig
    """The data settings, with `template_date` set when the chat template writes the day."""
    tokenizer_dir: str
    """The tokenizer's local folder (a hub tokenizer's files in the HF cache)."""
    train: list[Located]
    eval: list[Located]
    """`data.eval_path`, or the training sources' `data.eval_split`; none: eval_fraction or no eval."""
    settings: dict[str, Any]
    fingerprint: str


def prepare(
    cfg: DataConfig, tokenizer_path: str, cache_root: Path, *, progress: bool = True, seed: int = 0, pairs: bool = False
) -> Prepared:
    """Build (or reuse) the packed dataset for `cfg` under `cache_root/<fingerprint>/`; `pairs`: preference
    pairs for train.objective dpo/orpo/simpo."""
    cache_root = Path(cache_root)
    plan = _plan(cfg, tokenizer_path, seed, pairs)
    fp = plan.fingerprint
    cache.clean_stale(cache_root)
    manifest = cache.load_complete(cache_root, fp)
    reused = manifest is not None
    if manifest is None:
        with cache.atomic_build(cache_root, fp) as tmp, datasets_bars(progress):
            manifest = _build(tmp, plan, seed, pairs)
    final = cache_root / fp
    return Prepared(
        train_path=final / "train",
        eval_path=final / "eval" if manifest.get("eval") else None,
        manifest=manifest,
        reused=reused,
        fingerprint=fp,
    )


def data_fingerprint(cfg: DataConfig, tokenizer_path: str, seed: int = 0, pairs: bool = False) -> str:
    """The cache key of `cfg`'s prepared data: its content, tokenizer and output settings.

    `spotune estimate` asks it too, to know whether a target directory holds the data already."""
    return _plan(cfg, tokenizer_path, seed, pairs).fingerprint


def _plan(cfg: DataConfig, tokenizer_path: str, seed: int, pairs: bool) -> _Plan:
    tokenizer_dir = tokenizer.local_dir(tokenizer_path, cfg.tokenizer_revision)
    train = [locate(s) for s in sources_of(cfg, FORMAT_FIELDS)]
    ev = [locate(s) for s in eval_sources(cfg, FORMAT_FIELDS)]
    dated = _writes_date(cfg.chat_template, tokenizer_dir)
    if dated and cfg.template_date is None:  # outside a run (a run pins its first day: training/inputs.py)
        cfg = dataclasses.replace(cfg, template_date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    settings = _settings(cfg, seed, train, ev)
    settings["template_date"] = cfg.template_date if dated else None  # the day is data only where it is written
    if pairs:  # only then: SFT data keeps the fingerprints it always had
        settings["pairs"] = True
        caps = {"max_length": cfg.max_length, "max_prompt_length": cfg.max_prompt_length}
        caps |= {"max_completion_length": cfg.max_completion_length}
        if any(v is not None for v in caps.values()):  # pairs without caps keep their fingerprints
            settings["pair_lengths"] = {**caps, "truncation_mode": cfg.truncation_mode}
    # Local sources by their bytes; a hub source by its commit, which is in the settings.
    data: list[Path | None] = [*local_files(train), *(local_files(ev) if ev else [None])]
    return _Plan(cfg, tokenizer_dir, train, ev, settings, cache.fingerprint(data, tokenizer_dir, settings))


def _writes_date(setting: str | None, tokenizer_dir: str) -> bool:
    """Whether the chat template writes the day it renders (then the day is part of the data)."""
    if setting is not None:
        return uses_date(resolve_chat_template(setting, None))
    return any(b"strftime_now" in f.read_bytes() for f in tokenizer.file_names(Path(tokenizer_dir)))


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


def _build(tmp: Path, plan: _Plan, seed: int, pairs: bool) -> dict[str, Any]:
    started = time.perf_counter()
    cfg, tokenizer_path = plan.cfg, plan.tokenizer_dir
    tok = tokenizer.load_tokenizer(tokenizer_path)
    read = rows.read_all(cfg, plan.train, plan.eval, seed)

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
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
            "mix": read.mix,
        },
        "pad_id": int(pad_id),
        "train": None,
        "eval": None,
    }
    lost: list[dict[str, Any]] = []
    for name, parts in (("train", read.train), ("eval", read.eval)):
        if parts:
            job = _Job(tok, tokenizer_path, cfg, name, scratch, plan.fingerprint, pad_id, pairs)
            manifest[name] = _tokenize_pack_save(parts, job, tmp, seed, lost)
    shutil.rmtree(scratch, ignore_errors=True)
    dropped.write(tmp, lost)
    manifest["seconds"] = round(time.perf_counter() - started, 3)
    cache.write_manifest(tmp, manifest)  # last: its presence marks the entry complete
    return manifest


def _labels(located: list[Located]) -> str | list[str] | None:
    """One source's label (what a single-source manifest always held), a mix's list, or None."""
    labels = [loc.label for loc in located]
    return labels[0] if len(labels) == 1 else (labels or None)


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
    pairs: bool = False


def _tokenize(loc: Located, raw: datasets.Dataset, job: _Job, j: int) -> tuple[datasets.Dataset, Tokenize]:
    """One source's rows through its own template (format and fields)."""
    src = loc.source
    mapped, tok = rows.tokenize_source(loc, job.cfg, raw, rows.head(raw), job.tokenizer, job.tokenizer_path, job.pairs)
    cfg = src.data_config(job.cfg, FORMAT_FIELDS)
    tokenized = raw.map(
        mapped,
        batched=True,
        remove_columns=raw.column_names,
        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
        features=_tokenized_features(
            "unpaired" if isinstance(mapped, unpaired.TokenizeUnpaired) else "pairs" if job.pairs else "sft"
        ),
        cache_file_name=str(job.scratch / f"{job.name}-{j}.arrow"),
        new_fingerprint=f"{job.fp}-{job.name}-{j}",  # skips hashing the tokenizer-holding function
        desc=f"tokenize {job.name} ({src.key})",
    )
    if isinstance(mapped, unpaired.TokenizeUnpaired):  # KTO: each row's KL sequence beside it (needs the others)
        tokenized = unpaired.with_kl(tokenized, mapped.lengths, cfg.seq_len, cfg.overlong)
    return tokenized, tok


def _concatenated(pieces: list[datasets.Dataset]) -> datasets.Dataset:
    """The sources' tokenised rows as one table, in source order."""
    import datasets

    return pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)


def _how(tok: Tokenize) -> dict[str, Any]:
    """How a source was read: its format (and why, when `auto` chose it) and the chat template."""
    name = template_name(tok.chat_template) if tok.template is not None else None
    return {"format": tok.fmt, "format_reason": tok.reason, "chat_template": name}


def _tokenize_pack_save(
    parts: Parts, job: _Job, out_dir: Path, seed: int, lost: list[dict[str, Any]]
) -> dict[str, Any]:
    """Tokenise, pack and save one split; every row it drops is appended to `lost`."""
    cfg, name = job.cfg, job.name
    pieces, per_source, split_lost = [], [], []
    for j, (loc, raw) in enumerate(parts):
        piece, tok = _tokenize(loc, raw, job, j)
        st = np.asarray(piece["status"], dtype=object)
        split_lost += dropped.entries(name, loc, raw, st, piece["detail"])
        n_kept = int((st == "").sum())
        counts = Counter(s for s in st.tolist() if s)
        if n_kept == 0:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            raise DataError(
                f"{loc.label} ({loc.source.key}): no {name} example is left after templating ({reasons}); "
                + _no_example_fix(np.asarray(piece["length"], dtype=np.int64), st, cfg.seq_len, cfg.overlong)
            )
        lens = np.asarray(piece["length"], dtype=np.int64)
        cut = _truncated(piece, lens, cfg.seq_len, job.pairs) & (st == "")
        per_source.append(
            {
                "key": loc.source.key,
                "source": loc.label,
                **_how(tok),
                "examples_in": len(raw),
                "examples_out": n_kept,
                "dropped": dict(sorted(counts.items())),
                "truncated": int(cut.sum()),
            }
        )
        pieces.append(piece)
    tokenized = _concatenated(pieces)
    status = np.asarray(tokenized["status"], dtype=object)
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    ids_arr = tokenized.data.column("input_ids").combine_chunks()
    lab_arr = tokenized.data.column("labels").combine_chunks()
    offsets = ids_arr.offsets.to_numpy()
    if not np.array_equal(offsets, lab_arr.offsets.to_numpy()):
        raise RuntimeError("internal error: input_ids and labels disagree in length")
    kept = np.flatnonzero(status == "")
    drops = Counter(s for s in status.tolist() if s)
    lost += split_lost
    doc_lens = np.diff(offsets)[kept]  # a pair is one unit to pack: both its sequences go in one row
    if cfg.packing:
        bins_local, algorithm = pack_lengths(doc_lens, cfg.seq_len)
    else:
        bins_local, algorithm = one_per_row(doc_lens), "one_per_row"
    bins = [[int(kept[i]) for i in b] for b in bins_local]
    if job.pairs:
        offsets, bins = pair_data.documents(offsets, np.asarray(tokenized["chosen_length"], dtype=np.int64), bins)
    packed = build_rows(ids_arr.values.to_numpy(), lab_arr.values.to_numpy(), offsets, bins, cfg.seq_len, job.pad_id)
    if job.pairs:
        _add_unit_columns(packed, tokenized, bins)
    _save_rows(packed, cfg.seq_len, out_dir / name)

    n_rows, real = len(bins), int(packed["num_real"].sum())
    return {
        **{k: per_source[0][k] for k in ("format", "format_reason", "chat_template")},  # the first source's
        "examples_in": len(status),
        "examples_out": int(kept.size),
        "dropped": dict(sorted(drops.items())),
        "dropped_rows": split_lost[: dropped.SHOWN],
        "truncated": int(_truncated(tokenized, lengths, cfg.seq_len, job.pairs)[kept].sum()),
        **({"pairs": int(kept.size), **unpaired.counts(tokenized)} if job.pairs else {}),
        "truncation": _truncation(tokenized, lengths, status, cfg, job.pairs),  # what lengths lose (data/stats.py)
        "real_tokens": real,
        "trainable_tokens": int(packed["num_trainable"].sum()),
        "doc_len_sq": doc_len_sq(offsets, bins),
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


def _add_unit_columns(packed: dict[str, Any], tokenized: datasets.Dataset, bins: list[list[int]]) -> None:
    """Preference rows' own columns: each row's units (pairs, or KTO's answers), and KTO's unit labels in order."""
    packed["num_pairs"] = np.asarray([len(b) // 2 for b in bins], dtype=np.int32)
    kto = unpaired.row_labels(tokenized, bins)
    if kto is not None:
        packed[unpaired.DESIRABLE] = kto


def _held(tokenized: datasets.Dataset) -> np.ndarray:
    """The tokens each tokenised row keeps (both answers of a pair)."""
    return np.diff(tokenized.data.column("input_ids").combine_chunks().offsets.to_numpy()).astype(np.int64)


def _truncated(tokenized: datasets.Dataset, lengths: np.ndarray, seq_len: int, pairs: bool) -> np.ndarray:
    """Which rows lost tokens: a pair keeps fewer than it has (each answer is capped apart: data.max_length),
    an SFT example is longer than seq_len."""
    return _held(tokenized) < lengths if pairs else lengths > seq_len


def _truncation(
    tokenized: datasets.Dataset, lengths: np.ndarray, status: np.ndarray, cfg: DataConfig, pairs: bool
) -> dict[str, Any]:
    """What the length settings lose (stats.truncation): pairs by what each keeps, with data.max_length."""
    if not pairs:
        return truncation(lengths, status, cfg.seq_len, answers=_answers_cut(tokenized))
    return {**truncation(lengths, status, cfg.seq_len, _held(tokenized)), "max_length": cfg.max_length}


def _no_example_fix(lengths: np.ndarray, status: np.ndarray, seq_len: int, overlong: str) -> str:
    """The fix when a source keeps no example: a seq_len that holds its examples (named) when seq_len
    dropped them, `overlong=truncate` only where it is not set; else its format and fields."""
    lost = np.isin(status, (OVERLONG, NO_TRAINABLE_AFTER_TRUNCATION))
    if not lost.any():
        return "check its format and field settings."
    p99 = int(np.ceil(np.percentile(lengths[lost], 99)))
    fix = f"set data.seq_len={suggest_seq_len(p99)} ({SEQ_LEN_RULE} of these examples, {p99:,} tokens"
    fix += f"; data.seq_len is {seq_len})"
    if overlong == "drop" and (status == OVERLONG).any():
        fix += ", or data.overlong=truncate to keep each example's first tokens"
    return fix + "."


def _answers_cut(tokenized: datasets.Dataset) -> np.ndarray | None:
    """Each example's `ANSWERS_CUT` (trainer/data/template.py) as an (n, 4) array, or None without it."""
    if ANSWERS_CUT not in tokenized.column_names:
        return None
    cut = tokenized.data.column(ANSWERS_CUT).combine_chunks()
    return np.asarray(cut.flatten().to_numpy(zero_copy_only=False), dtype=np.int64).reshape(-1, 4)


def _save_rows(packed: dict[str, Any], seq_len: int, path: Path) -> None:
    cols = {}
    for k in ("input_ids", "labels", "position_ids"):
        flat = pa.array(packed[k].reshape(-1), type=pa.int32())
        cols[k] = pa.FixedSizeListArray.from_arrays(flat, seq_len)
    for k in ("num_real", "num_trainable", "num_pairs"):
        if k in packed:
            cols[k] = pa.array(packed[k], type=pa.int32())
    if unpaired.DESIRABLE in packed:  # KTO: per row, its units' labels
        cols[unpaired.DESIRABLE] = pa.array(packed[unpaired.DESIRABLE], type=pa.list_(pa.int8()))
    import datasets

    datasets.Dataset(pa.table(cols)).save_to_disk(str(path))  # read back by trainer/data/packed.py
