"""Fencing by generation: every object a lease holder writes carries the lease's `generation`, so
a late write of a fenced holder (a request already in flight when it was cut off) never replaces
what a newer holder wrote. Two rules, applied by every reader (resume, `spotune report`):

- A run file (metrics.jsonl, ledger.jsonl, config.yaml, ...) is written to `<name>.gen-<generation>`;
  the plain `<name>` (a run written before generations, or without a lease) counts as generation 0.
  Nobody deletes another generation's copy. A replaceable file (config.yaml, the `auto` memory
  record, the heartbeat) is read from the copy of the highest generation. An append-only one
  (`APPEND_ONLY`: the ledger, the metrics) is the merge of every copy (`merged_rows`): each row
  once, in the order first seen, oldest generation first. So a row is never lost, whoever wrote it
  last: a holder that never saw an older copy (it started cut off from the store), a fenced
  holder's late write, a machine whose disk held rows the store lacked.
- A checkpoint manifest records the `generation` that uploaded it. Of the manifests of older
  generations than the newest one, those above the newest generation's highest step are late
  writes and count as absent (a newer holder resumed below them). This holds only because a holder
  never commits below a checkpoint it saw committed unless that one is corrupt or the user asked
  for a new timeline (the rule of trainer/restart/store/safety.py, asserted by every store write that
  could take one out of sight).

The second rule cannot tell a late manifest below that step from a live one: a reader reaches it
only when every newer checkpoint fails verification, and exact resume makes the same step's state
the same on either side.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from typing import Any

from trainer.restart.books.ledger import LEDGER_FILE

GEN = ".gen-"
"""Between a run file's name and the generation that wrote it."""
APPEND_ONLY = ("metrics.jsonl", LEDGER_FILE)
"""Run files whose rows only ever accumulate: read as the merge of every generation's copy."""


def run_file_key(path: str, generation: int) -> str:
    """Where a holder of `generation` writes the run file `path` (generation 0: the plain name)."""
    return f"{path}{GEN}{generation}" if generation > 0 else path


def run_file_copies(fs: Any, path: str) -> dict[int, str]:
    """generation -> the copy of run file `path` that generation wrote (0: the plain name)."""
    parent, name = posixpath.split(path)
    fs.invalidate_cache(parent)
    try:
        entries = fs.ls(parent, detail=False)
    except FileNotFoundError:
        return {}
    out = {}
    for entry in entries:
        base = posixpath.basename(entry.rstrip("/"))
        gen = 0 if base == name else _suffix(base, name)
        if gen is not None:
            out[gen] = posixpath.join(parent, base)
    return out


def newest_run_file(fs: Any, path: str) -> str | None:
    """The copy of run file `path` written by the highest generation, or None when there is none."""
    copies = run_file_copies(fs, path)
    return copies[max(copies)] if copies else None


def read_run_file(fs: Any, path: str) -> bytes | None:
    """What a reader sees of run file `path`: the merge of every copy for an append-only file, else
    the copy of the highest generation; None when there is none."""
    copies = run_file_copies(fs, path)
    if not copies:
        return None
    if posixpath.basename(path) not in APPEND_ONLY or len(copies) == 1:  # one copy: as it is, torn line and all
        return bytes(fs.cat_file(copies[max(copies)]))
    texts = []
    for gen in sorted(copies):
        try:
            texts.append(bytes(fs.cat_file(copies[gen])))
        except FileNotFoundError:  # listed, then gone (a store that lists stale entries)
            continue
    return merged_rows(texts)


def merged_rows(copies: Iterable[bytes]) -> bytes:
    """The JSON rows of every copy, each once, in the order first seen; a line that is not a JSON
    object (a torn write) is dropped. Rows that name one `attempt_id` are one attempt's ledger row:
    its own row wins over one a later attempt recovered for it (`end_is_last_heartbeat`)."""
    rows: dict[str, bytes] = {}
    recovered: set[str] = set()
    for text in copies:
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict):
                continue
            attempt = row.get("attempt_id") if "exit_reason" in row else None
            key = f"attempt {attempt}" if isinstance(attempt, str) else line.decode(errors="replace")
            mine = not row.get("end_is_last_heartbeat")
            if key not in rows or (key in recovered and mine):
                rows[key] = line
                recovered.discard(key)
                if not mine:
                    recovered.add(key)
    return b"".join(line + b"\n" for line in rows.values())


def _suffix(base: str, name: str) -> int | None:
    tail = base[len(name + GEN) :] if base.startswith(name + GEN) else ""
    return int(tail) if tail.isdigit() else None


def stamped(manifest: bytes, generation: int) -> bytes:
    """A checkpoint manifest as a holder of `generation` uploads it (unchanged for generation 0)."""
    if generation <= 0:
        return manifest
    return json.dumps({**json.loads(manifest), "generation": generation}, indent=2).encode()


def manifest_generation(raw: bytes) -> int:
    """The generation a remote manifest records; 0 when it records none (or cannot be read: its
    download then names what is wrong)."""
    try:
        gen = json.loads(raw).get("generation", 0)
        return int(gen) if isinstance(gen, int) else 0
    except (ValueError, AttributeError):
        return 0


def current_steps(generations: dict[int, int]) -> list[int]:
    """Of the committed steps (step -> the generation of its manifest), those a reader may use:
    none above the highest step committed by the newest generation. Oldest first."""
    if not generations:
        return []
    newest = max(generations.values())
    top = max(step for step, gen in generations.items() if gen == newest)
    return sorted(step for step in generations if step <= top)
