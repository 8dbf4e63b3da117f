"""Ranks that decide together: rank 0's answer on every rank, and a failure raised alike on every rank.

Several ranks of one attempt must end with one exit code (trainer/exit_codes.py merges them, the most
specific first), so an error one rank meets at start travels to the others as (kind, message) and each
raises the same class: a store fault of the moment is 143 on every rank, a refused credential 2 on every
rank, never 143 on one and 2 ("bad input") on the others.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from trainer.restart.checkpoint import CheckpointError
from trainer.restart.storage import StoreDenied, StoreError, StoreUnreachable, _short

T = TypeVar("T")

Failure = tuple[str, str]
"""(kind, message) of an error to raise on every rank."""

_KINDS: dict[str, type[Exception]] = {
    "unreachable": StoreUnreachable,  # 143: restart
    "denied": StoreDenied,  # 2: a setting to fix
    "checkpoint": CheckpointError,  # 2: no checkpoint can be resumed as asked
    "error": RuntimeError,  # 1: a bug; look at rank 0's traceback
}


def failure(e: BaseException) -> Failure:
    """What to tell the other ranks of `e`. A store error that is neither refused nor the store being
    down (a transfer that came out wrong, a checkpoint another node cannot match) is a fault of the
    moment too: a restart tries again."""
    if isinstance(e, StoreDenied):
        kind = "denied"
    elif isinstance(e, StoreError):
        kind = "unreachable"
    elif isinstance(e, CheckpointError):
        kind = "checkpoint"
    else:
        kind = "error"
    return kind, str(e) if kind != "error" else f"{type(e).__name__}: {_short(e)}"


def raise_failure(failures: list[Failure | None], prefix: str = "") -> None:
    """Raise the most telling of the ranks' failures, if any (a refusal names what to fix, a bug beats a
    fault of the moment), its message after `prefix`."""
    found = [f for f in failures if f is not None]
    if not found:
        return
    order = ("denied", "checkpoint", "error", "unreachable")
    kind, text = min(found, key=lambda f: order.index(f[0]))
    raise _KINDS[kind](prefix + text)


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def broadcast(value: T) -> T:
    """Rank 0's `value` on every rank (the resume step must be the same everywhere)."""
    if not distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out
