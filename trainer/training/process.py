"""The training process's resources, opened in order and closed on every exit path.

`start` builds the accelerator (device, autocast, process group), chooses DDP or FSDP, connects
the run's store (a fresh machine fetches the run's history before writing anything), and
installs the stop paths (signals, the cloud notice watcher, and under torchrun the watch on the
launcher: trainer/restart/signals/launcher.py). Each registers its close on the
caller's `ExitStack`, so an exception anywhere in `train()` closes the same things as a clean end.
It reads the few settings it needs (`Settings`), never the whole run config (training/run.py builds them).
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config import CheckpointConfig, ConfigError
from trainer.model import distributed
from trainer.restart.books.ledger import timed
from trainer.restart.remote import new_run
from trainer.restart.remote.run import RemoteRun
from trainer.restart.signals import launcher, notice, preemption
from trainer.training import gpu_probe


@dataclass(frozen=True)
class Settings:
    """What the process's resources are built from (trainer/training/run.py `process_settings`)."""

    output_dir: str
    checkpoint: CheckpointConfig
    """The store, the resume request, the stop paths' notice settings."""
    mixed_precision: str
    """train.mixed_precision (`auto`: bf16 where this GPU computes it natively)."""
    distributed: str
    """train.distributed: DDP or FSDP."""
    fsdp_cpu_offload: bool
    trackers: tuple[str, ...] = ()
    """metrics.trackers: checked installed before the model loads."""


@dataclass
class Process:
    accelerator: Any
    sharding: distributed.Sharding
    remote: RemoteRun
    stop: preemption.Preemption
    out: Path

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    @property
    def world(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)


def start(settings: Settings, phases: dict[str, float], closing: contextlib.ExitStack, fence: Any = None) -> Process:
    """`fence`: the run's lease (trainer/restart/ownership/lease.py), which every write to the store asks first."""
    accelerator = make_accelerator(settings)
    ck = settings.checkpoint
    # DDP, or FSDP from the recipe or an accelerate FSDP config; refuses DeepSpeed and the like.
    sharding = distributed.choose(settings.distributed, settings.fsdp_cpu_offload, accelerator)
    out = Path(settings.output_dir)
    remote = RemoteRun(
        ck.remote,
        ck.storage_options,
        out,
        keep_last=ck.keep_last,
        is_main=accelerator.is_main_process,
        is_local_main=accelerator.is_local_main_process,
        retry_seconds=ck.store_retry_seconds,
        outage_seconds=ck.store_outage_seconds,
    )
    closing.callback(remote.stop)
    if fence is not None:
        remote.fence = fence
    # checkpoint.resume=never: a new run. The old run's files and checkpoints go aside before anything reads
    # them, and only once the store answered (trainer/restart/remote/new_run.py `apply`): one step, never half of it.
    request = new_run.Request.of(ck.resume)

    def set_aside_here(folder: str) -> None:  # rank 0's folder name on every node: one name per new run
        unbooked = fence.new_run() if fence is not None and accelerator.is_main_process else []
        moved, retired = new_run.set_aside(out, folder, unbooked)
        if moved:
            print(
                f"spotune: checkpoint.resume=never: a new run; the old run's files are set aside in "
                f"{out / folder} ({', '.join(moved)}): kept, never read by this run",
                flush=True,
            )
        if retired:
            print(f"spotune: checkpoint.resume=never: the old run's checkpoints are kept as {', '.join(retired)}")

    with timed(
        phases, "store"
    ):  # first: a fresh machine fetches the run's config, ledger and metrics before writing any
        # Every node sets its own disk aside (rank 0's decides, trainer/restart/remote/run.py `connect`); a request
        # applied already (a rerun of the same command after a preemption) is not applied again.
        here = set_aside_here if request.folder is not None and accelerator.is_local_main_process else None
        remote.connect(request, here)
    stop = preemption.Preemption().install()
    closing.callback(stop.uninstall)
    # A store that refused the uploader or the lease for good (credentials, permissions, full...): save locally,
    # exit with its code (2: a setting to fix), never retried as a blip for ever (trainer/faults.py).
    remote.on_refused = lambda why, code: stop.request(why, f" (exit {code})")
    if fence is not None:  # a store gone past checkpoint.store_outage_seconds: save locally, exit 143
        fence.on_outage = stop.request
        fence.keeper.on_refused = remote.refuse
        if fence.keeper.refused is not None:  # refused before this was wired
            remote.refuse(fence.keeper.refused)
    # A store found ahead of the step this attempt resumed from (it started cut off, on a stale disk):
    # nothing is written there; save locally, exit 143 (trainer/restart/store/safety.py).
    remote.floor.on_ahead = lambda why: stop.request(f"spotune: {why}", " (exit 143)")
    # A store write the rule refused (a bug): save locally, exit 1 (RemoteRun.exit_code), not train on uncopied.
    remote.on_violation = lambda why: stop.request(f"spotune: {why}", " (exit 1)")
    # A cloud notice sets the same flag as SIGTERM; one poller per machine.
    watcher = notice.NoticeWatcher(ck.preemption_notice, stop.request, ck.notice_endpoint, ck.notice_poll_seconds)
    if accelerator.is_local_main_process:
        watcher.start()
        closing.callback(watcher.stop)
    if launcher.launched():  # torchrun's ranks outlive a killed launcher: they save and exit instead
        deadline = max(ck.notice_seconds, launcher.MIN_DEADLINE_SECONDS)
        closing.callback(launcher.LauncherWatch(stop.request, deadline).start().stop)
    return Process(accelerator, sharding, remote, stop, out)


def make_accelerator(settings: Settings) -> Any:
    """Accelerate owns device placement, autocast (+ fp16 grad scaler) and DDP wrapping; FSDP
    sharding is ours (trainer/model/distributed.py says why).

    Gradient accumulation stays ours (loop.py counts tokens over the whole step), so the
    accelerator runs with gradient_accumulation_steps=1. Under `torchrun` on a CPU-only
    machine, `cpu=True` still gives one gloo rank per process.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    unusable = gpu_probe.unusable_gpu_reason()
    if unusable:
        raise ConfigError([unusable])
    if settings.mixed_precision == "fp16" and not cuda:
        raise ConfigError(["train.mixed_precision: fp16 needs a CUDA GPU; use bf16 or no on CPU"])
    precision = settings.mixed_precision
    if precision == "auto":  # bf16 where this GPU computes it natively (every rank of a job has the same GPUs)
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    trackers = list(settings.trackers)
    missing = [t for t in trackers if importlib.util.find_spec(t) is None]
    if missing:  # said before the model loads, not at the first metrics row (trainer/training/trackers.py)
        raise ConfigError(
            [
                f"metrics.trackers: {', '.join(missing)} is not installed; pip install {' '.join(missing)} "
                "(or pip install 'spotune[trackers]'), or remove it from metrics.trackers"
            ]
        )
    backend = distributed.process_group_backend(settings.distributed, settings.fsdp_cpu_offload, cuda)
    return Accelerator(
        cpu=not cuda,
        mixed_precision=precision,
        project_dir=settings.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else None,
    )
