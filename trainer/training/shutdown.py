"""Ending a training process on every path: nothing of spotune's may keep it alive.

A run that fails on a rented GPU must exit at once with its code, or it bills until somebody
notices and its supervisor (SLURM, Kubernetes, SkyPilot) never sees the exit it acts on.
What can hold the interpreter open:

- DataLoader workers. They ignore the stop signals (`batches._ignore_stop_signals`: the main
  process finishes the step and saves; SLURM signals every process of the job). torch shuts
  them down from the iterator's `__del__`, but an exception's traceback keeps the iterator
  alive until interpreter exit, where `multiprocessing`'s exit handler SIGTERMs its daemonic
  children and joins them: a worker that ignores SIGTERM is joined forever (seen on an H100).
  So the iterator is closed explicitly (`close_loader`) and, last of all, any child still
  alive is killed (`end_child_processes`), with SIGKILL, which no worker can ignore.
- Threads: the upload and notice threads are daemons and are stopped in train()'s teardown.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from typing import Any

import torch

from trainer.exit_codes import EXIT_OUT_OF_MEMORY


def close_loader(iterator: Any) -> None:
    """Shut the workers of a DataLoader iterator down now (a no-op without workers).

    `_shutdown_workers` is what the iterator's own `__del__` calls: it tells each worker to
    end, joins it with a timeout and stops watching its pid. Should a torch release rename
    it, `end_child_processes` still ends the workers before exit.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def end_child_processes(grace_seconds: float = 2.0, keep: frozenset[int] = frozenset()) -> list[int]:
    """Kill every `multiprocessing` child still alive after `grace_seconds`, but those in `keep`
    (children the caller had before the command began); returns the pids killed.

    Called last on the way out, after everything that owned a child closed it. torch's SIGCHLD
    handler would report a killed worker as an error in the middle of this, so it is reset first.
    """

    def ours() -> list[Any]:
        return [c for c in multiprocessing.active_children() if c.pid not in keep]  # also reaps the ended

    children = ours()
    deadline = time.monotonic() + grace_seconds
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = ours()
    if not children:
        return []
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5.0)
    return [c.pid for c in children if c.pid is not None]


def release_memory() -> None:
    """Hand what an ended attempt held back to the device, before another attempt in this process."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class OutOfMemory(RuntimeError):
    """The device ran out of memory at a known place of the loop (raised from the OOM error)."""

    def __init__(self, step: int, micro_step: int | None, micro_steps: int, rows: int, seq_len: int) -> None:
        """`step` and `micro_step` are the loop's 0-based indices."""
        self.step, self.micro_step, self.micro_steps = step, micro_step, micro_steps
        self.rows, self.seq_len = rows, seq_len
        where = "in the optimizer step" if micro_step is None else f"in micro-batch {micro_step + 1} of {micro_steps}"
        # Numbered as the metrics log numbers steps (1 = the first), so the two can be read side by side.
        super().__init__(f"out of memory at step {step + 1}, {where} ({rows} rows x {seq_len} tokens per micro-batch)")


OOM_ERRORS: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)
"""What the device raises when an allocation fails (`torch.OutOfMemoryError` is the same class)."""


def out_of_memory_message(
    err: OutOfMemory,
    *,
    device_name: str,
    device_gib: float | None,
    reserved_gib: float | None,
    predicted_gib: float | None,
    micro_batch_size: int,
    gradient_checkpointing: bool,
    activation_offload: bool,
    method: str,
    retried: bool = False,
) -> str:
    """The one message of an out-of-memory stop: where, the figures, and what to change."""
    figures = []
    if predicted_gib is not None:
        figures.append(f"`spotune estimate` predicts a peak of {predicted_gib:.1f} GiB for this run")
    if reserved_gib is not None:
        figures.append(f"torch had {reserved_gib:.1f} GiB reserved")
    card = f"{device_name}" + (f" ({device_gib:.1f} GiB)" if device_gib is not None else "")
    fixes = []
    if micro_batch_size > 1:
        fixes.append(
            f"lower train.micro_batch_size (now {micro_batch_size}; the global batch stays, accumulation takes the rest)"
        )
    if not gradient_checkpointing:
        fixes.append("set model.gradient_checkpointing=true")
    if not activation_offload:
        fixes.append("set model.activation_offload=on (checkpointed activations in host memory)")
    fixes.append(f"lower data.seq_len (now {err.seq_len}; the data is prepared again)")
    if method != "qlora":
        fixes.append("use adapter.method=qlora (4-bit base weights)")
    fixes.append(
        "or set these memory settings to auto, or pick a larger GPU (`spotune estimate` lists the ones that fit)"
    )
    if retried:
        figures.append("the `auto` choice already ran out once and this is its smaller retry")
    return (
        f"spotune: CUDA {err} on {card}"
        + (f"; {', '.join(figures)}" if figures else "")
        + ".\nTo fit: "
        + "; ".join(fixes)
        + f".\nNot a transient error: exit {EXIT_OUT_OF_MEMORY} tells the launch templates not to restart it unchanged."
    )
