"""The packed rows `spotune prepare` saved, read with pyarrow alone: what training, evaluation and the
checks before them read.

The folder is the one `datasets.Dataset.save_to_disk` writes (state.json lists its Arrow stream files, in
order). Reading it here rather than with `datasets.load_from_disk` keeps `datasets` and pandas out of every
process whose data is prepared already: a `spotune train` on a cached dataset (every restart, every rank)
started 1.2 s of CPU later for them. The files are memory-mapped, so ranks and loader workers share the
page cache, and a pickled `PackedRows` (a DataLoader worker's copy) is its folder and column names.

Columns come back as numpy arrays, integers as int64: a fixed-length list column (input_ids, labels,
position_ids) as [rows, seq_len], a scalar one as [rows], a list column of varying length (KTO's
`desirable`) as an object array of row arrays: what `datasets`' numpy format gives, so the batches built
from them are the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainer.data.read import DataError

STATE = "state.json"
"""`save_to_disk`'s index of the folder: `_data_files`, the Arrow stream files in row order."""


class PackedRows:
    """Rows of a prepared folder (or of an Arrow table: tests build small ones), restricted to `columns`."""

    def __init__(self, path: Path | str | None = None, *, table: pa.Table | None = None) -> None:
        if (path is None) == (table is None):
            raise TypeError("PackedRows takes a prepared folder or a table, one of them")
        self.path = None if path is None else Path(path)
        self._table = table if table is not None else _read(Path(path))  # type: ignore[arg-type]

    @classmethod
    def of(cls, columns: Mapping[str, Sequence[Any]]) -> PackedRows:
        """Rows from plain column lists (`{"input_ids": [[...], ...], "num_pairs": [...]}`)."""
        return cls(table=pa.table(dict(columns)))

    @property
    def column_names(self) -> list[str]:
        return list(self._table.column_names)

    def __len__(self) -> int:
        return self._table.num_rows

    def select(self, columns: Sequence[str]) -> PackedRows:
        """These columns only (each read is then of them alone); a KeyError names a missing one."""
        missing = [c for c in columns if c not in self._table.column_names]
        if missing:
            raise KeyError(f"{self.path or 'rows'} have no column {missing[0]!r} (columns: {self.column_names})")
        view = PackedRows(table=self._table.select(list(columns)))
        view.path = self.path
        return view

    def take(self, rows: Sequence[int] | slice) -> dict[str, np.ndarray]:
        """The rows at these indices (a slice: a contiguous range, read without a copy of the rest), by column."""
        if isinstance(rows, slice):
            start, stop, step = rows.indices(len(self))
            if step != 1:
                raise ValueError("PackedRows.take: a slice of step 1")
            part = self._table.slice(start, max(0, stop - start))
        else:
            part = self._table.take(_index(rows))
        return {name: _numpy(name, part.column(name)) for name in part.column_names}

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:  # an in-memory table (tests): pickled whole
            return {"path": None, "table": self._table, "columns": None}
        return {"path": str(self.path), "table": None, "columns": self.column_names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = None if state["path"] is None else Path(state["path"])
        if state["table"] is not None:
            self._table = state["table"]
        else:  # mapped again in this process (a DataLoader worker): the pages are shared, not copied
            self._table = _read(Path(state["path"])).select(state["columns"])


def _read(folder: Path) -> pa.Table:
    """The folder's Arrow files, memory-mapped, as one table; a DataError naming the folder and the fix when
    it is not a prepared folder (a cache entry is complete when its manifest is, so this is a damaged disk)."""
    fix = "delete the folder and run again: `spotune prepare` rebuilds it"
    try:
        state = json.loads((folder / STATE).read_text())
        files = [folder / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{folder}: not a prepared dataset ({STATE}: {e}); {fix}") from e
    tables = []
    for file in files:
        try:
            with pa.memory_map(str(file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{file}: unreadable prepared rows ({e}); {fix}") from e
    if not tables:
        raise DataError(f"{folder}: {STATE} lists no data file; {fix}")
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:  # files of different schemas
        raise DataError(f"{folder}: its data files disagree ({e}); {fix}") from e


def _numpy(name: str, column: pa.ChunkedArray) -> np.ndarray:
    array = column.combine_chunks()
    if array.null_count:
        raise DataError(f"prepared rows hold {array.null_count} empty value(s) in column {name!r}; prepare them again")
    if pa.types.is_fixed_size_list(array.type):  # flatten() honours a slice's offset, .values would not
        return _ints(name, array.flatten()).reshape(len(array), array.type.list_size)
    if pa.types.is_list(array.type):
        offsets, values = _ints(name, array.offsets), _ints(name, array.values)  # offsets index .values
        rows = [values[offsets[i] : offsets[i + 1]] for i in range(len(array))]
        if rows and len({len(r) for r in rows}) == 1:  # all one length: [rows, length], as datasets gives
            return np.stack(rows)
        out = np.empty(len(rows), dtype=object)
        out[:] = rows
        return out
    return _ints(name, array)


def _index(rows: Sequence[int]) -> pa.Array:
    """Row indices as an Arrow array, built on their buffer: `pa.array` imports pandas (see `_ints`)."""
    values = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])


def _ints(name: str, array: pa.Array) -> np.ndarray:
    """An integer array's values as int64 (what datasets' numpy format gives: the int32 on disk would
    overflow a sum of squared document lengths past 46,341 tokens), read from its buffer: pyarrow's
    to_numpy imports pandas, 0.5 s of CPU at every start, for nothing a packed row holds."""
    if not pa.types.is_integer(array.type) or array.null_count:
        raise DataError(f"prepared rows: column {name!r} holds {array.type}, not integers; prepare them again")
    dtype = np.dtype(str(array.type))
    values = np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset : array.offset + len(array)]
    return values.astype(np.int64)
