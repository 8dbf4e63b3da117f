"""Read raw examples from JSONL, JSON arrays, Parquet, CSV or a saved `datasets` directory.

Every reader returns a `datasets.Dataset` of raw rows with every column any row has (a key that
one row lacks is None there, never dropped for all rows), plus `LINE_COLUMN`: where each row
starts in its file (the line of JSONL, JSON and CSV; the row number of Parquet and Arrow), so a
row that is dropped can be found. Nothing here knows about templates or tokenizers.

A JSON/JSONL/CSV column that Arrow cannot hold as the file has it (nested values: messages, tool-call
arguments; values whose types differ between rows; text that is not UTF-8, such as a lone surrogate)
is stored as each row's own JSON (`PACKED`), and `unpacked` gives the row back as the file has it: key
order and JSON nulls kept, no merged schema, and a bad row is one row's problem (a counted drop), never
the whole file's.

JSON, JSONL and CSV are parsed here rather than by datasets' builders because a bad line must be
reported with its file and line number, and every kept row must know its line; reading writes
nothing to the user's HF cache (the only artifact is spotune's own cache directory).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import datasets

from trainer.exit_codes import EXIT_BAD_INPUT

DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".arrow")
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
"""Compressions a text file (JSONL, JSON, CSV) may carry, as hub datasets often ship them (`.jsonl.gz`)."""
DATA_ENDINGS = (*DATA_SUFFIXES, *(t + c for t in (".jsonl", ".ndjson", ".json", ".csv") for c in COMPRESSED))
"""Every file name ending read as data."""
INTERNAL = "__spotune_"
"""Columns spotune adds to raw rows start with this; they are never data."""
LINE_COLUMN = INTERNAL + "line"
"""Where a row starts in its file: its line (JSONL, JSON, CSV) or its row number (Parquet, Arrow), from 1."""
PACKED = "\x00spotune-json\x00"
"""Prefix of a raw value stored as its own JSON text (see the module docstring; `unpacked` reads it back)."""
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

    exit_code = EXIT_BAD_INPUT


def check_source(path: str | Path, *, key: str = "data.path") -> Path:
    """Fail fast (before hashing) on a missing path or an unsupported file extension."""
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"{key}: {p} does not exist (no such file or folder: {p.absolute()}); point {key} at a data file or a "
            "saved datasets directory."
        )
    if p.is_file() and data_suffix(p) is None:
        raise DataError(
            f"{key}: unknown data format {p.suffix or '(no extension)'!r} for {p}; supported: {', '.join(SUPPORTED)}."
        )
    return p


def is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()


def read_rows(
    path: str | Path, *, key: str = "data.path", split: str = "train", as_text: tuple[str, ...] = ()
) -> datasets.Dataset:
    """All rows of the file or saved dataset at `path` (`split` of a saved DatasetDict), each with
    its `LINE_COLUMN`; `key` names the config key in errors. JSON values of the `as_text` columns
    (a conversation's tools) are kept as JSON text: Arrow would merge every row's schemas into one
    struct of all their keys, reordered and null-filled."""
    import datasets  # here, not at the top: a run on prepared data never reads raw rows (trainer/data/packed.py)

    p = check_source(path, key=key)
    if p.is_dir():
        ds = _numbered(_read_saved(p, key, split))
    else:
        suffix = data_suffix(p)
        if suffix in (".jsonl", ".ndjson"):
            ds = _from_records(_read_jsonl(p), p, key, as_text)
        elif suffix == ".json":
            ds = _from_records(_read_json(p), p, key, as_text)
        elif suffix == ".csv":
            ds = _from_records(_read_csv(p), p, key, as_text)
        elif suffix == ".parquet":
            # Read straight through pyarrow (what datasets' builders use underneath) so that
            # nothing is written to the user's HF cache: the only artifact is our own cache dir.
            import pyarrow.parquet as pq

            ds = _numbered(datasets.Dataset(pq.read_table(p)))
        elif suffix == ".arrow":  # a shard of a saved dataset (datasets' Arrow stream), as some hub repos hold
            ds = _numbered(datasets.Dataset.from_file(str(p), in_memory=True))
        else:
            raise DataError(
                f"{key}: unknown data format {p.suffix or '(no extension)'!r} for {p}; "
                f"supported: {', '.join(SUPPORTED)}."
            )
    assert isinstance(ds, datasets.Dataset)
    if len(ds) == 0:
        raise DataError(f"{key}: {p} holds no examples; give a file with at least one row.")
    return ds


def data_columns(ds: datasets.Dataset) -> list[str]:
    """The columns of raw rows that hold data (not those spotune adds: where a row came from)."""
    return [c for c in ds.column_names if not c.startswith(INTERNAL)]


def numbered_by_line(p: Path | str) -> bool:
    """Whether `LINE_COLUMN` of a file's rows is a line number (text formats) rather than a row number."""
    return data_suffix(p) in (".jsonl", ".ndjson", ".json", ".csv")


def _numbered(ds: datasets.Dataset) -> datasets.Dataset:
    """A table's rows numbered from 1 (Parquet and Arrow have rows, not lines)."""
    return ds.add_column(LINE_COLUMN, np.arange(1, len(ds) + 1, dtype=np.int64))


def _open_text(p: Path, encoding: str = "utf-8") -> Any:
    """`p` as text, decompressed by its ending (fsspec's codecs; `.zst` needs the zstandard package)."""
    import fsspec

    try:
        return fsspec.open(str(p), "rt", encoding=encoding, compression="infer", newline="").open()
    except (ImportError, ValueError) as e:
        raise DataError(f"{p}: cannot decompress it ({e}); pip install zstandard for .zst, or decompress it.") from None


Numbered = list[tuple[int, dict[str, Any]]]
"""(line, row) pairs, in file order."""


def _read_jsonl(p: Path) -> Numbered:
    rows: Numbered = []
    with _open_text(p) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not examples
            try:
                row = json.loads(line.rstrip("\r\n"))  # an error at the line's end is in it, not on line 2
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: malformed JSON line ({_at(e)}); fix or remove that line.") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(row).__name__}.")
            rows.append((lineno, row))
    return rows


def _read_json(p: Path) -> Numbered:
    with _open_text(p) as f:
        text = f.read()
    if not text.lstrip().startswith("["):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            whole = None  # not one JSON document: read it as JSON Lines, with line numbers on errors
            if not _first_line_parses(text):  # nor JSON Lines: one document over many lines, as the parser says
                raise DataError(f"{p}:{e.lineno}: malformed JSON ({_at(e)}); fix that line.") from None
        if isinstance(whole, dict) and len(text.strip().splitlines()) > 1:
            raise DataError(
                f"{p}: expected a JSON array of objects or JSON Lines, got one JSON object "
                f"(keys: {', '.join(list(whole)[:10])}); extract the list of examples into its own file."
            )
        return _read_jsonl(p)
    try:
        items = list(_array_items(text))
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: malformed JSON ({_at(e)}).") from None
    for i, (line, row) in enumerate(items):
        if not isinstance(row, dict):
            raise DataError(f"{p}:{line}: item {i} of the JSON array is a {type(row).__name__}, expected an object.")
    return items


def _at(e: json.JSONDecodeError) -> str:
    """The parser's message and column as one phrase (`Invalid control character at` ends in "at" already)."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def _first_line_parses(text: str) -> bool:
    """Whether the first non-blank line of `text` is a JSON value of its own (JSON Lines), not the
    opening of a document written over several lines."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        json.loads(first)
    except json.JSONDecodeError:
        return len(text.strip().splitlines()) <= 1  # one line: its error is the line's own
    return True


def _array_items(text: str) -> Iterator[tuple[int, Any]]:
    """Each item of the JSON array `text` with the line it starts on (json.loads keeps no positions)."""
    decoder = json.JSONDecoder()
    ws = " \t\n\r"
    at = text.index("[") + 1
    line, counted = 1, 0
    while True:
        while at < len(text) and text[at] in ws:
            at += 1
        if text.startswith("]", at):
            tail = text[at + 1 :].strip()
            if tail:
                raise json.JSONDecodeError("Extra data", text, at + 1 + text[at + 1 :].index(tail[0]))
            return
        item, end = decoder.raw_decode(text, at)
        line += text.count("\n", counted, at)
        counted = at
        yield line, item
        at = end
        while at < len(text) and text[at] in ws:
            at += 1
        if text.startswith(",", at):
            at += 1
        elif not text.startswith("]", at):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)


def _read_csv(p: Path) -> Numbered:
    """CSV rows as strings: an empty cell is the empty string (an alpaca `input`), never NaN; a row
    with fewer cells than the header lacks the last columns. Each row's line is where it starts (a
    quoted cell may span lines; blank lines are skipped but counted)."""
    rows: Numbered = []
    with _open_text(p, encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark is not a column name
        reader = csv.reader(f)
        header = next(reader, [])
        done = reader.line_num  # the last line read so far
        for cells in reader:
            start, done = done + 1, reader.line_num
            if not cells:
                continue
            if len(cells) > len(header):
                raise DataError(
                    f"{p}:{start}: {len(cells)} cells but the header has {len(header)} columns "
                    f"({', '.join(header)}); quote cells that hold commas."
                )
            rows.append((start, dict(zip(header, cells, strict=False))))
    return rows


def _from_records(rows: Numbered, p: Path, key: str, as_text: tuple[str, ...]) -> datasets.Dataset:
    """A dataset with every key any row has (datasets.Dataset.from_list takes the first row's keys
    only, silently dropping a column the first row lacks), and each row's line."""
    if not rows:
        raise DataError(f"{key}: {p} holds no examples; give a file with at least one row.")
    columns = list(dict.fromkeys(k for _, row in rows for k in row))
    table = {c: [row.get(c) for _, row in rows] for c in columns}
    for c in set(as_text) & set(table):
        table[c] = [json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v for v in table[c]]
    for c in set(table) - set(as_text):
        if _needs_packing(table[c]):
            table[c] = [None if v is None else PACKED + json.dumps(v, ensure_ascii=True) for v in table[c]]
    table[LINE_COLUMN] = [line for line, _ in rows]
    import datasets

    try:
        return datasets.Dataset.from_dict(table)
    except Exception as e:  # pyarrow type conflicts between rows, e.g. a field that is a string here and a list there
        raise DataError(f"{p}: rows do not share one schema ({type(e).__name__}: {e}).") from None


def _needs_packing(values: list[Any]) -> bool:
    """Whether Arrow would change or refuse the column `values` (module docstring): nested values, types
    that differ between rows (ints with floats excepted), or text that UTF-8 cannot encode."""
    types = {type(v) for v in values if v is not None}
    if types & {dict, list} or (len(types) > 1 and not types <= {int, float}):
        return True
    return str in types and not all(_utf8(v) for v in values if isinstance(v, str))


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unpacked(row: dict[str, Any]) -> dict[str, Any]:
    """A raw row as its file has it: every `PACKED` value read back; in a nested value Arrow holds (Parquet, a
    saved dataset), the None fillers Arrow adds (every struct of a column gets the keys any of them has) removed,
    so a turn, a call's arguments or a schema holds only its own keys."""
    return {
        k: json.loads(v[len(PACKED) :]) if isinstance(v, str) and v.startswith(PACKED) else _unfilled(v)
        for k, v in row.items()
    }


def _unfilled(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _unfilled(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_unfilled(v) for v in value]
    return value


def _read_saved(p: Path, key: str, split: str) -> datasets.Dataset:
    if not is_saved_dataset(p):
        raise DataError(
            f"{key}: {p} is a directory but not one written by datasets' save_to_disk; "
            f"supported: {', '.join(SUPPORTED)}."
        )
    import datasets

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
