"""Every row a prepare drops, findable: its file, its line (or row number) and why.

The whole list is `dropped.jsonl` in the prepared data's directory (beside manifest.json, one JSON
object per dropped row); the manifest keeps the first few of each split, which the summary of
`prepare`, `inspect` and `train` prints with the list's path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where rows are read: a run on prepared data never needs it (trainer/data/packed.py)
    import datasets

from trainer.data.read import LINE_COLUMN, numbered_by_line
from trainer.data.sources import FILE_COLUMN, Located

FILE = "dropped.jsonl"
SHOWN = 5
"""Dropped rows the manifest (and so every summary) shows per split."""


def entries(split: str, loc: Located, raw: datasets.Dataset, status: np.ndarray, detail: list[str]) -> list[dict]:
    """One entry per dropped row of `raw` (a source's rows, tokenised into `status`/`detail` in order)."""
    at = np.flatnonzero(status != "")
    if at.size == 0:
        return []
    picked = raw.select_columns([FILE_COLUMN, LINE_COLUMN]).select(at)
    out = []
    for i, file_index, line in zip(at.tolist(), picked[FILE_COLUMN], picked[LINE_COLUMN], strict=True):
        path = loc.files[file_index]
        where = "line" if numbered_by_line(path) else "row"
        out.append(
            {
                "split": split,
                "source": loc.source.key,
                "file": str(path),
                where: int(line),
                "reason": str(status[i]),
                "detail": detail[i],
            }
        )
    return out


def write(directory: Path, dropped: list[dict[str, Any]]) -> None:
    """The whole list, written into the prepared data's directory (committed with it)."""
    with open(directory / FILE, "w") as f:
        for entry in dropped:
            f.write(json.dumps(entry) + "\n")


def place(path: Path | str, number: int) -> str:
    """Where a raw row is: `file:line` (JSONL, JSON, CSV), or `file row N` (Parquet, Arrow)."""
    return f"{path}:{number}" if numbered_by_line(path) else f"{path} row {number}"


def where(entry: dict[str, Any]) -> str:
    """`file:line: reason (detail)` of a dropped row."""
    detail = f" ({entry['detail']})" if entry.get("detail") else ""
    return f"{place(entry['file'], entry.get('line', entry.get('row', 0)))}: {entry['reason']}{detail}"


def summary_lines(split: dict[str, Any], directory: str) -> list[str]:
    """The first dropped rows of a split and where the whole list is, for the prepare summary."""
    shown = split.get("dropped_rows") or []
    total = sum(split.get("dropped", {}).values())
    if not total or not shown:
        return []
    head = f"  dropped rows ({len(shown)} of {total:,} shown; every one in {Path(directory) / FILE}):"
    return [head, *(f"    {where(e)}" for e in shown)]
