"""One training example as the model saw it: the first document of the first packed row of the
prepared dataset, decoded, with the tokens the loss trains on (label != -100) marked.

It reads the Arrow file `datasets` saved (`<dataset>/train/*.arrow`, an IPC stream) with pyarrow,
first record batch only, so a large dataset costs one batch; and the tokenizer the run saved in
final/ (else the one the manifest names, when it is a local directory). A packed row holds
several documents; `position_ids` restart at 0 where the next one begins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from trainer.data.show import segments
from trainer.data.template import IGNORE_INDEX

log = logging.getLogger(__name__)

MAX_TOKENS = 2048  # a page, not a book: longer documents are cut with a note


@dataclass(frozen=True)
class Piece:
    text: str
    trained: bool


@dataclass(frozen=True)
class Example:
    pieces: list[Piece]
    tokens: int
    trained_tokens: int
    cut: bool


def first_row(dataset_dir: str) -> dict[str, list[int]] | None:
    """input_ids, labels and position_ids of the first packed row, or None when there is no train split."""
    import pyarrow as pa

    fs, path = fsspec.core.url_to_fs(dataset_dir)
    files = sorted(fs.glob(f"{path}/train/*.arrow"))
    if not files:
        return None
    with fs.open(files[0], "rb") as f:
        batch = pa.ipc.open_stream(f).read_next_batch()
    if batch.num_rows == 0:
        return None
    row = batch.slice(0, 1).to_pylist()[0]
    return {k: list(row[k]) for k in ("input_ids", "labels", "position_ids") if k in row}


def first_document(row: dict[str, list[int]]) -> tuple[list[int], list[int]]:
    """The ids and labels of the row's first document (up to where position_ids restart)."""
    ids, labels = row["input_ids"], row["labels"]
    positions = row.get("position_ids")
    end = len(ids)
    if positions:
        end = next((i for i in range(1, len(positions)) if positions[i] == 0), len(ids))
    return ids[:end], labels[:end]


def render(ids: list[int], labels: list[int], tokenizer: Any) -> Example:
    """Runs of tokens with the same trained flag decoded together, as `spotune inspect --show`
    marks them (a multi-byte character split over two tokens decodes whole)."""
    cut = len(ids) > MAX_TOKENS
    ids, labels = ids[:MAX_TOKENS], labels[:MAX_TOKENS]
    pieces = [Piece(text, trained) for text, trained in segments(tokenizer, ids, labels)]
    return Example(pieces, len(ids), sum(1 for x in labels if x != IGNORE_INDEX), cut)


def training_example(dataset_dir: str | None, tokenizer_dirs: list[str], notes: list[str]) -> Example | None:
    """The example for the page, or None with a note saying why there is none."""
    if dataset_dir is None:
        return None
    tokenizer_dir = next((d for d in tokenizer_dirs if (Path(d) / "tokenizer_config.json").is_file()), None)
    if tokenizer_dir is None:
        notes.append("no local tokenizer (final/ or the prepared data's): the training example is not shown")
        return None
    try:
        row = first_row(dataset_dir)
        if row is None or "labels" not in row:
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        return render(*first_document(row), tokenizer)
    except (OSError, ValueError, KeyError) as e:  # a dataset being rewritten, a foreign layout
        notes.append(f"the training example could not be read ({type(e).__name__}: {e})")
        return None
