"""The raw rows one prepare tokenises: each located source read, cut to its share (`rows` /
`fraction`), and split into training and held-out rows; `prepare` and `spotune inspect --show` read
them here, so what inspect shows is what trains.

Every row carries where it came from (`sources.FILE_COLUMN`, `read.LINE_COLUMN`) and its index in
its source (`template.ROW_COLUMN`), so a dropped row can be named by file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.config import DataConfig
from trainer.data import formats, unpaired
from trainer.data.formats import FORMAT_FIELDS
from trainer.data.pairs import TokenizePairs, tokenize_pairs_for
from trainer.data.read import DataError, data_columns, require_fields, unpacked
from trainer.data.sources import Located, Source, choose
from trainer.data.sources import read as read_source
from trainer.data.template import HEAD_ROWS, ROW_COLUMN, Tokenize, tokenize_for

if TYPE_CHECKING:  # imported where rows are read: a run on prepared data never needs it (trainer/data/packed.py)
    import datasets

Parts = list[tuple[Located, "datasets.Dataset"]]
"""Each source's rows of one split, in source order."""


@dataclass(frozen=True)
class Read:
    """The rows of one prepare, and what each training source gave."""

    train: Parts
    eval: Parts
    mix: list[dict[str, Any]]
    """Per training source: its key and label, the commit it was read at, its rows and those chosen."""


def read_all(cfg: DataConfig, train: list[Located], held_out: list[Located], seed: int) -> Read:
    """Each training source's rows cut to its share, then split into train and eval parts (by
    `data.eval_fraction`, unless `held_out` sources give the eval rows)."""
    read = read_training(cfg, train, bool(held_out), seed)
    if not held_out:
        return read
    return Read(read.train, [(loc, read_numbered(loc)) for loc in held_out], read.mix)


def read_training(cfg: DataConfig, train: list[Located], held_out: bool, seed: int) -> Read:
    """The training sources' rows, each cut to its share; without `held_out` sources, a
    `data.eval_fraction` of each goes to the eval parts."""
    parts: Parts = []
    evals: Parts = []
    mix: list[dict[str, Any]] = []
    for i, loc in enumerate(train):
        raw = read_numbered(loc)
        chosen = choose(raw, loc.source, seed, i)
        mix.append(
            {"key": loc.source.key, "source": loc.label, "commit": loc.commit, "rows": len(raw), "chosen": len(chosen)}
        )
        if not held_out and cfg.eval_fraction > 0:
            kept, held = _split(chosen, cfg.eval_fraction, seed, loc.source.key)
            parts.append((loc, kept))
            evals.append((loc, held))
        else:
            parts.append((loc, chosen))
    return Read(parts, evals, mix)


def read_numbered(loc: Located) -> datasets.Dataset:
    """Every raw row of `loc`, with its index in the source."""
    ds = read_source(loc)
    return ds.add_column(ROW_COLUMN, np.arange(len(ds), dtype=np.int64))


def check_fields(ds: datasets.Dataset, src: Source, source: str) -> None:
    """Raise naming the key to set when a required column of `src`'s format is absent."""

    def key(cfg_key: str, role: str) -> str:  # the key a user sets to fix it
        return f"{src.key}.fields.{role}" if src.key.startswith("data.sources[") else f"data.{cfg_key}"

    need = {key(k, role): src.fields[role] for k, role, required in FORMAT_FIELDS[src.fmt] if required}
    require_fields(data_columns(ds), need, source)


def tokenize_source(
    loc: Located,
    cfg: DataConfig,
    ds: datasets.Dataset,
    first: list[dict[str, Any]],
    tokenizer: Any,
    tokenizer_path: str,
    pairs: bool,
) -> tuple[Tokenize | TokenizePairs | unpaired.TokenizeUnpaired, Tokenize]:
    """How one source's rows are tokenised, by `prepare` and `spotune inspect --show` alike: a mix entry of
    a set format has its required columns checked (naming data.sources[i].fields.<role>, the key to fix),
    then its own DataConfig (format, columns) is settled on its columns and `first` rows. Returns the
    function to map over the rows (TokenizePairs for preference `pairs`, TokenizeUnpaired for KTO's unpaired
    rows: trainer/data/unpaired.py) and its Tokenize."""
    src = loc.source
    if src.key.startswith("data.sources[") and src.fmt != "auto":
        check_fields(ds, src, loc.label)
    source_cfg = src.data_config(cfg, FORMAT_FIELDS)
    if pairs and unpaired.is_unpaired(src.fmt, data_columns(ds), formats.fields_of(source_cfg.format, source_cfg)):
        kto = unpaired.tokenize_unpaired_for(source_cfg, tokenizer, loc.label).settle(
            data_columns(ds), first, tokenizer_path
        )
        return kto, kto.tok
    if pairs:
        mapped = tokenize_pairs_for(source_cfg, tokenizer, loc.label).settle(data_columns(ds), first, tokenizer_path)
        return mapped, mapped.tok
    tok = tokenize_for(source_cfg, tokenizer, source=loc.label).settle(data_columns(ds), first, tokenizer_path)
    return tok, tok


def head(ds: datasets.Dataset, n: int = HEAD_ROWS) -> list[dict[str, Any]]:
    """The first rows, which `format: auto` and the format checks look at."""
    return [unpacked(r) for r in ds.select(range(min(n, len(ds))))]


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
