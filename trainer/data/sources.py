"""Where a run's examples come from: `data.path` or the `data.sources` mix, local or on the hub.

A source is located (its files, and for a hub dataset the commit it resolved to), read into raw
rows, and cut to its `rows` / `fraction` by a seeded choice. Each source keeps its own format and
field mapping: prepare.py tokenises each with its own `Tokenize` and concatenates the tokenised
rows before packing, so sources in different formats mix without a shared normaliser.

A hub dataset is pinned: `pin_revisions` turns a branch or tag into the commit it names, once, on
the run's first start; the run's config.yaml (in the run directory, uploaded with its checkpoints
and fetched first on a fresh machine) keeps that commit, and every later start reads it back, so a
dataset updated mid-run never changes what a resume trains on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.config import DataConfig, SourceConfig
from trainer.data import hub, layout
from trainer.data.read import INTERNAL, DataError, check_source, data_columns, is_saved_dataset, read_rows

if TYPE_CHECKING:  # imported where rows are read: a run on prepared data never needs it (trainer/data/packed.py)
    import datasets

FILE_COLUMN = INTERNAL + "file"
"""Which of a located source's files a raw row came from (an index into `Located.files`)."""

# (config key, role, required) per format: prepare.FORMAT_FIELDS, passed in (prepare imports this module).
FormatFields = Mapping[str, tuple[tuple[str, str, bool], ...]]


@dataclass(frozen=True)
class Source:
    """One configured source, with its format and role -> column mapping settled."""

    key: str
    """The config key that names it in messages: `data.path`, `data.eval_path` or `data.sources[i]`."""
    path: str
    subset: str | None
    split: str
    revision: str | None
    fmt: str
    fields: dict[str, str]
    rows: int | None = None
    fraction: float | None = None

    def data_config(self, cfg: DataConfig, format_fields: FormatFields) -> DataConfig:
        """`cfg` as this source alone would set it: its format, and each role's data.*_field its column."""
        columns = {key: self.fields[role] for key, role, _ in format_fields[self.fmt] if role in self.fields}
        return dataclasses.replace(cfg, format=self.fmt, sources=(), **columns)  # type: ignore[arg-type]  # fmt is a key of format_fields


@dataclass(frozen=True)
class Located:
    source: Source
    files: tuple[Path, ...]
    """Data files in reading order, or one saved `datasets` folder."""
    commit: str | None
    """The hub commit the files were read from; None for a local source."""
    label: str
    """How the manifest and messages show it: the local path, or hf://datasets/org/name@commit."""

    def describe(self) -> dict[str, Any]:
        """What identifies the rows (for the fingerprint and the manifest); a local source's bytes are hashed apart."""
        s = self.source
        return {
            "source": self.label if self.commit else "local",
            "subset": s.subset,
            "split": s.split,
            "format": s.fmt,
            "fields": s.fields,
            "rows": s.rows,
            "fraction": s.fraction,
            "files": [f.name for f in self.files] if self.commit else len(self.files),
        }


def sources_of(cfg: DataConfig, format_fields: FormatFields) -> list[Source]:
    """The configured training sources: `data.sources`, else `data.path` alone."""
    if not cfg.sources:
        return [_source("data.path", cfg.path, cfg.subset, cfg.split, cfg.revision, cfg.format, {}, cfg, format_fields)]
    out = []
    for i, s in enumerate(cfg.sources):
        fmt = s.format or cfg.format
        src = _source(f"data.sources[{i}]", s.path, s.subset, s.split, s.revision, fmt, s.fields, cfg, format_fields)
        out.append(dataclasses.replace(src, rows=s.rows, fraction=s.fraction))
    return out


def eval_sources(cfg: DataConfig, format_fields: FormatFields) -> list[Source]:
    """What the eval split reads: `data.eval_path` (its `data.eval_split`, default train), else the
    training sources' `data.eval_split` (the same commits, all its rows); none: eval_fraction or no eval."""
    if cfg.eval_path is not None:
        split = cfg.eval_split or "train"
        return [_source("data.eval_path", cfg.eval_path, None, split, None, cfg.format, {}, cfg, format_fields)]
    if cfg.eval_split is None:
        return []
    return [
        dataclasses.replace(s, split=cfg.eval_split, rows=None, fraction=None) for s in sources_of(cfg, format_fields)
    ]


def _source(
    key: str,
    path: str,
    subset: str | None,
    split: str,
    revision: str | None,
    fmt: str,
    given: Mapping[str, str],
    cfg: DataConfig,
    format_fields: FormatFields,
) -> Source:
    if fmt not in format_fields:
        raise DataError(f"{key}.format: unknown format {fmt!r}; use one of {', '.join(format_fields)}.")
    roles = {role: getattr(cfg, cfg_key) for cfg_key, role, _ in format_fields[fmt]}
    unknown = sorted(set(given) - set(roles))
    if unknown:
        raise DataError(
            f"{key}.fields: {', '.join(map(repr, unknown))} is not a field of format {fmt!r} "
            f"(its fields: {', '.join(roles)}); map those roles to your columns."
        )
    return Source(key, path, subset, split, revision, fmt, {**roles, **given})


# ---------------------------------------------------------------------------- locating


def locate(src: Source) -> Located:
    """The files of `src`, resolved as `datasets.load_dataset` resolves them (layout.py); a hub
    dataset's split files are downloaded into the HF cache, and only those."""
    hub_id = hub.parse(src.path)
    if hub_id is None:
        path = check_source(src.path, key=_path_key(src.key))
        if path.is_file() or is_saved_dataset(path):
            return Located(src, (path,), None, str(path))
        files = layout.split_files(path, src.subset, src.split, _path_key(src.key))
        return Located(src, tuple(files), None, str(path))
    revision = src.revision or hub_id.revision
    key = _path_key(src.key)
    # First the card alone: it resolves the commit and may name the split's files (its configs:).
    folder, commit = hub.download(hub_id, revision, list(layout.METADATA), key)
    where = hub_id.url(commit)
    listed = hub.listing(hub_id, commit, folder, key)
    wanted = layout.split_files_listed(listed, folder, src.subset, src.split, key, where)
    folder, commit = hub.download(hub_id, commit, hub.exactly([*layout.METADATA, *wanted]), key)
    missing = [rel for rel in wanted if not (folder / rel).is_file()]
    if missing:
        raise DataError(
            f"{key}: {where}: {', '.join(missing[:3])} did not arrive; with HF_HUB_OFFLINE=1 the cache may lack them: "
            "run once online."
        )
    return Located(src, tuple(folder / rel for rel in wanted), commit, where)


def _path_key(key: str) -> str:
    return key if key in ("data.path", "data.eval_path") else f"{key}.path"


def local_files(located: list[Located]) -> list[Path]:
    """The local files whose bytes the fingerprint hashes (a hub source is identified by its commit)."""
    return [f for loc in located if loc.commit is None for f in loc.files]


# ---------------------------------------------------------------------------- reading and choosing


def read(loc: Located) -> datasets.Dataset:
    """Every raw row of `loc`, its files concatenated in order, with every column any file has and,
    per row, its file (`FILE_COLUMN`, an index into `loc.files`) and line (`read.LINE_COLUMN`)."""
    from datasets.utils import tqdm

    key = _path_key(loc.source.key)
    # datasets' tqdm follows its global progress switch (prepare's `progress`): a bar on a terminal.
    files = tqdm(loc.files, desc=f"read {loc.source.key}", unit="file", disable=len(loc.files) < 2)
    as_text = tuple(c for role, c in loc.source.fields.items() if role == "tools")
    parts = []
    for i, f in enumerate(files):
        rows = read_rows(f, key=key, split=loc.source.split, as_text=as_text)
        parts.append(rows.add_column(FILE_COLUMN, np.full(len(rows), i, dtype=np.int32)))
    return parts[0] if len(parts) == 1 else _concatenate(parts, loc, key)


def _concatenate(parts: list[datasets.Dataset], loc: Located, key: str) -> datasets.Dataset:
    """The files' rows as one table: a column some file lacks is None in its rows, and files of one
    layout that differ in storage types (Parquet's large_string, JSON's string) take the first's."""
    import datasets

    union: dict[str, Any] = {}
    for p in parts:
        for name, feature in p.features.items():
            union.setdefault(name, feature)
    features = datasets.Features(union)
    try:
        whole = []
        for p in parts:
            for name in union.keys() - set(p.column_names):
                p = p.add_column(name, [None] * len(p), feature=union[name])
            p = p.select_columns(list(union))
            whole.append(p if p.features == features else p.cast(features))
        return datasets.concatenate_datasets(whole)
    except (ValueError, TypeError) as e:  # types that differ between files
        names = ", ".join(f.name for f in loc.files[:5])
        raise DataError(
            f"{key}: the files of {loc.label} ({names}...) do not share one schema ({e}); "
            "point the source at files of one layout."
        ) from None


def choose(ds: datasets.Dataset, src: Source, seed: int, index: int) -> datasets.Dataset:
    """`src.rows` rows or `src.fraction` of `ds`: a seeded choice, in file order; all rows when neither is set."""
    n = len(ds)
    if src.rows is None and src.fraction is None:
        return ds
    want = src.rows if src.rows is not None else round(n * float(src.fraction or 0.0))
    if want > n:
        raise DataError(
            f"{src.key}.rows: asks for {want} rows but the source has {n}; lower rows to at most {n} (or use fraction)."
        )
    if want < 1:
        raise DataError(f"{src.key}.fraction: {src.fraction} of {n} rows is none; raise fraction or use rows.")
    # One stream per (seed, source index): adding a source never changes another's choice.
    pick = np.random.default_rng([seed, index]).permutation(n)[:want]
    return ds.select(np.sort(pick))


# ---------------------------------------------------------------------------- pinning


def pin_revisions(cfg: DataConfig, saved: DataConfig | None) -> tuple[DataConfig, list[str]]:
    """`cfg` with every hub source's revision turned into a commit: the one `saved` (the run's
    config.yaml from its first start) pinned for the same source, else the one the hub names now.

    An explicit commit in `cfg` is kept as given (when it differs from the pinned one, the data
    fingerprint tells the resume). `data.eval_path` is pinned by writing `@commit` into it.
    """
    notes: list[str] = []
    old_sources = saved.sources if saved is not None else ()
    if cfg.sources:
        new = []
        for i, s in enumerate(cfg.sources):
            prior = old_sources[i] if i < len(old_sources) else None
            kept = (
                prior.revision
                if prior and (prior.path, prior.subset, prior.split) == (s.path, s.subset, s.split)
                else None
            )
            new.append(dataclasses.replace(s, revision=_pin(f"data.sources[{i}]", s.path, s.revision, kept, notes)))
        cfg = dataclasses.replace(cfg, sources=tuple(new))
    else:
        same = saved is not None and (saved.path, saved.subset, saved.split) == (cfg.path, cfg.subset, cfg.split)
        kept = saved.revision if saved is not None and same else None
        cfg = dataclasses.replace(cfg, revision=_pin("data.path", cfg.path, cfg.revision, kept, notes))
    eval_id = hub.parse(cfg.eval_path) if cfg.eval_path else None
    if eval_id is not None and not (eval_id.revision and hub.COMMIT.match(eval_id.revision)):
        prior_id = hub.parse(saved.eval_path) if saved is not None and saved.eval_path else None
        kept = prior_id.revision if prior_id is not None and prior_id.repo_id == eval_id.repo_id else None
        cfg = dataclasses.replace(
            cfg, eval_path=eval_id.url(_pin("data.eval_path", cfg.eval_path or "", None, kept, notes))
        )
    return cfg, notes


def _pin(key: str, path: str, revision: str | None, pinned: str | None, notes: list[str]) -> str | None:
    """The commit `key`'s hub source reads; `revision` unchanged for a local source."""
    hub_id = hub.parse(path)
    if hub_id is None:
        return revision
    asked = revision or hub_id.revision
    if asked is not None and hub.COMMIT.match(asked):
        return asked
    if pinned is not None and hub.COMMIT.match(pinned):
        notes.append(
            f"{key}: {hub_id.repo_id} stays at commit {pinned[:12]}, pinned on this run's first start "
            "(the run's config.yaml); commits pushed since are not read by this run"
        )
        return pinned
    _, commit = hub.download(hub_id, asked, list(layout.METADATA), _path_key(key))
    notes.append(f"{key}: {hub_id.repo_id}@{asked or 'main'} is commit {commit[:12]}; this run reads that commit")
    return commit


def write_sample(
    cfg: DataConfig, format_fields: FormatFields, directory: Path, size: int, seed: int = 0
) -> tuple[DataConfig, int, int]:
    """A config that reads about `size` rows of `cfg`'s training set, each source in its share of
    the mix (its first chosen rows), from JSONL files written under `directory`; with the rows the
    whole set has and the rows sampled (planning extrapolates from the sample)."""
    located = [locate(s) for s in sources_of(cfg, format_fields)]
    tables = [choose(read(loc), loc.source, seed, i) for i, loc in enumerate(located)]
    total = sum(len(t) for t in tables)
    entries, sampled = [], 0
    for i, (loc, table) in enumerate(zip(located, tables, strict=True)):
        k = min(len(table), max(1, round(size * len(table) / total)))
        path = directory / f"sample-{i}.jsonl"
        sample = table.select(range(k))
        sample.select_columns(data_columns(sample)).to_json(str(path), lines=True)
        fmt: Any = loc.source.fmt  # a value of data.format: sources_of checked it against format_fields
        entries.append(SourceConfig(path=str(path), format=fmt, fields=dict(loc.source.fields)))
        sampled += k
    return dataclasses.replace(cfg, sources=tuple(entries), num_proc=1), total, sampled
