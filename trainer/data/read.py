"""Read raw examples from JSONL, JSON arrays, Parquet, CSV or a saved `datasets` directory.

Every reader returns a `datasets.Dataset` of raw rows; nothing here knows about templates
or tokenizers. JSON and JSONL are parsed line by line here rather than by datasets' json
builder, because a bad line must be reported with its file and line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pandas as pd
import pyarrow.parquet as pq

DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow")
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
"""Compressions a text file (JSONL, JSON, CSV) may carry, as hub datasets often ship them (`.jsonl.gz`)."""
DATA_ENDINGS = (*DATA_SUFFIXES, *(t + c for t in (".jsonl", ".ndjson", ".json", ".csv") for c in COMPRESSED))
"""Every file name ending read as data."""
SUPPORTED = (
    *DATA_SUFFIXES,
    "JSONL/JSON/CSV compressed (.gz, .bz2, .xz, .zst)",
    "a directory written by datasets' save_to_disk",
    "a folder of such files",
)


def data_suffix(p: Path | str) -> str | None:
    """The data format's suffix of a file name (`.jsonl` for `x.jsonl.gz`), None when it is not data."""
    name = str(p).lower()
    ending = next((e for e in DATA_ENDINGS if name.endswith(e)), None)
    if ending is None:
        return None
    return next(s for s in DATA_SUFFIXES if ending.startswith(s))


class DataError(ValueError):
    """Bad input data or data settings; the message names the file, line or config key to fix."""


def check_source(path: str | Path, *, key: str = "data.path") -> Path:
    """Fail fast (before hashing) on a missing path or an unsupported file extension."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{key}: {p} does not exist; point {key} at a data file or a saved datasets directory.")
    if p.is_file() and data_suffix(p) is None:
        raise DataError(
            f"{key}: unknown data format {p.suffix or '(no extension)'!r} for {p}; supported: {', '.join(SUPPORTED)}."
        )
    return p


def is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()


def read_rows(path: str | Path, *, key: str = "data.path", split: str = "train") -> datasets.Dataset:
    """All rows of the file or saved dataset at `path` (`split` of a saved DatasetDict); `key`
    names the config key in errors."""
    p = check_source(path, key=key)
    if p.is_dir():
        ds = _read_saved(p, key, split)
    else:
        suffix = data_suffix(p)
        if suffix in (".jsonl", ".ndjson"):
            ds = _from_records(_read_jsonl(p), p, key)
        elif suffix == ".json":
            ds = _from_records(_read_json(p), p, key)
        elif suffix == ".parquet":
            # Read straight through pyarrow/pandas (what datasets' builders use underneath) so that
            # nothing is written to the user's HF cache: the only artifact is our own cache dir.
            ds = datasets.Dataset(pq.read_table(p))
        elif suffix == ".csv":
            # keep_default_na=False: an empty CSV cell is the empty string (an alpaca `input`),
            # not NaN, which would reach the template as a float.
            with _open_text(p) as f:
                frame = pd.read_csv(f, keep_default_na=False, dtype=str)
            ds = datasets.Dataset.from_pandas(frame, preserve_index=False)
        elif suffix == ".arrow":  # a shard of a saved dataset (datasets' Arrow stream), as some hub repos hold
            ds = datasets.Dataset.from_file(str(p), in_memory=True)
        else:
            raise DataError(
                f"{key}: unknown data format {p.suffix or '(no extension)'!r} for {p}; "
                f"supported: {', '.join(SUPPORTED)}."
            )
    assert isinstance(ds, datasets.Dataset)
    if len(ds) == 0:
        raise DataError(f"{key}: {p} holds no examples; give a file with at least one row.")
    return ds


def _open_text(p: Path) -> Any:
    """`p` as text, decompressed by its ending (fsspec's codecs; `.zst` needs the zstandard package)."""
    import fsspec

    try:
        return fsspec.open(str(p), "rt", encoding="utf-8", compression="infer").open()
    except (ImportError, ValueError) as e:
        raise DataError(f"{p}: cannot decompress it ({e}); pip install zstandard for .zst, or decompress it.") from None


def _read_jsonl(p: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with _open_text(p) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not examples
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{p}:{lineno}: malformed JSON line ({e.msg} at column {e.colno}); fix or remove that line."
                ) from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(row).__name__}.")
            rows.append(row)
    return rows


def _read_json(p: Path) -> list[dict[str, Any]]:
    with _open_text(p) as f:
        text = f.read()
    if not text.lstrip().startswith("["):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON document: read it as JSON Lines, with line numbers on errors
        if isinstance(whole, dict) and len(text.strip().splitlines()) > 1:
            raise DataError(
                f"{p}: expected a JSON array of objects or JSON Lines, got one JSON object "
                f"(keys: {', '.join(list(whole)[:10])}); extract the list of examples into its own file."
            )
        return _read_jsonl(p)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}).") from None
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{p}: item {i} of the JSON array is a {type(row).__name__}, expected an object.")
    return data


def _from_records(rows: list[dict[str, Any]], p: Path, key: str) -> datasets.Dataset:
    if not rows:
        raise DataError(f"{key}: {p} holds no examples; give a file with at least one row.")
    try:
        return datasets.Dataset.from_list(rows)
    except Exception as e:  # pyarrow type conflicts between rows, e.g. a field that is a string here and a list there
        raise DataError(f"{p}: rows do not share one schema ({type(e).__name__}: {e}).") from None


def _read_saved(p: Path, key: str, split: str) -> datasets.Dataset:
    if not is_saved_dataset(p):
        raise DataError(
            f"{key}: {p} is a directory but not one written by datasets' save_to_disk; "
            f"supported: {', '.join(SUPPORTED)}."
        )
    loaded = datasets.load_from_disk(str(p), keep_in_memory=True)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"{key}: {p} is a DatasetDict without a {split!r} split (splits: {', '.join(loaded)}); "
                "set the split to one of them."
            )
        loaded = loaded[split]
    return loaded


def require_fields(found: list[str], fields: dict[str, str], source: str | Path) -> None:
    """Raise if a required column is absent; `fields` maps the config key that names it -> column name."""
    for key, name in fields.items():
        if name not in found:
            raise DataError(
                f"{source}: field {name!r} not found (fields found: {', '.join(found) or 'none'}); "
                f"set {key} to the field that holds it."
            )
