"""Fencing by generation: every object a lease holder writes carries the lease's `generation`, so
a late write of a fenced holder (a request already in flight when it was cut off) changes nothing
a reader sees. Two rules, applied by every reader (resume, `spotune report`):

- A run file (metrics.jsonl, ledger.jsonl, config.yaml, ...) is written to `<name>.gen-<generation>`
  and read from the copy of the highest generation; the plain `<name>` (a run written before
  generations, or without a lease) counts as generation 0. A holder deletes the copies of older
  generations once it has written its own (a late write may recreate one: it is still ignored).
- A checkpoint manifest records the `generation` that uploaded it. Of the manifests of older
  generations than the newest one, those above the newest generation's highest step are late
  writes and count as absent (a newer holder resumed below them).

The second rule cannot tell a late manifest below that step from a live one: a reader reaches it
only when every newer checkpoint fails verification, and exact resume makes the same step's state
the same on either side.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

GEN = ".gen-"
"""Between a run file's name and the generation that wrote it."""


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
