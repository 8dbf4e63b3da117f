"""Ranks that decide together: rank 0's answer on every rank, and a failure ended alike on every rank.

Several ranks of one attempt must end with one exit code (trainer/exit_codes.py merges them, the most
specific first). So an error one rank meets at start travels to the others as (exit code, message):
the code is `exit_codes.code_for`'s, the one classifier the command line uses too, so the rank that
met the error (which raises its own exception) and every other rank (which raises `Agreed`, carrying
that code) exit alike: a fault of the moment 143 on every rank, a setting to fix 2 on every rank.

`broadcast` is the one way a value of rank 0's reaches the others; `on_rank0` wraps a decision rank 0
makes alone (its disk, its store, the hub) so that its answer, or its failure, reaches every rank and
no rank is left waiting in a collective for one that gave up.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

from trainer.exit_codes import EXIT_ERROR, EXIT_PREEMPTED, PRIORITY, code_for
from trainer.urls import one_line

T = TypeVar("T")

Failure = tuple[int, str]
"""(exit code, message) of an error to raise on every rank."""


class Agreed(Exception):
    """Another rank's failure, raised here with its exit code (`exit_codes.code_for` returns it)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def failure(e: BaseException) -> Failure:
    """What to tell the other ranks of `e`: its exit code and its message (a bug's with its class)."""
    code = code_for(e)
    return code, str(e) if code != EXIT_ERROR else f"{type(e).__name__}: {one_line(e)}"


def _telling(failed: Failure) -> tuple[bool, int]:
    """A failure's rank among several: a fault of the moment last (a setting to fix names what to do, a
    bug's traceback is on the rank that met it), the others in the exit file's PRIORITY."""
    code = failed[0]
    return code == EXIT_PREEMPTED, PRIORITY.index(code) if code in PRIORITY else PRIORITY.index(EXIT_ERROR)


def raise_failure(failures: list[Failure | None], prefix: str = "") -> None:
    """Raise the most telling of the ranks' failures, if any, its message after `prefix`."""
    found = [f for f in failures if f is not None]
    if not found:
        return
    code, text = min(found, key=_telling)
    raise Agreed(prefix + text, code)


def distributed() -> bool:
    """Whether a process group is up. None can be where torch.distributed was never imported: `spotune
    prepare` and `inspect` decide here without importing torch (2 s of CPU)."""
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    if not distributed():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def broadcast(value: T) -> T:
    """Rank 0's `value` on every rank (the resume step must be the same everywhere)."""
    if not distributed():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(decide: Callable[[], T], is_main: bool, what: str) -> T:
    """`decide()` run on rank 0 only, its answer on every rank. When it raises, rank 0 raises its own
    exception and every other rank `Agreed` with the same exit code, its message after "rank 0 could not
    `what`: " (none waits in a collective for rank 0, which gave up)."""
    if is_main:
        try:
            value = decide()
        except Exception as e:
            broadcast((failure(e), None))  # the other ranks wait in the broadcast below
            raise
        broadcast((None, value))
        return value
    nothing: tuple[Failure | None, Any] = (None, None)
    failed, answer = broadcast(nothing)
    raise_failure([failed], prefix=f"rank 0 could not {what}: ")
    return cast(T, answer)  # rank 0's value of type T, as broadcast


def gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    if not distributed():
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
