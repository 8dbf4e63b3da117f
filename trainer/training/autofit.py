"""`auto` memory settings: micro-batch size, gradient checkpointing, activation offloading and
MLP tiling chosen from the memory estimate (trainer/plan/memory.py) and the device in hand.

`choose` is a pure function: candidates, the estimate of each, the device's free bytes and a
stated headroom in; the fastest candidate that fits and a sentence saying why out. Fastest,
in this order, each step costing more time than the next one gains:
1. no gradient checkpointing (recomputing every layer adds a forward: about a third more compute);
2. no activation offloading (its copies overlap the compute but still share memory bandwidth,
   and a layer's backward waits when a copy is late);
3. no MLP tiling (`model.tiled_mlp`: one more MLP forward per layer in the backward);
4. the largest micro-batch (fewer, larger kernel launches), among the sizes that split the
   rows per device evenly, so no micro-batch runs part-empty.
The global batch never changes: accumulation absorbs the micro-batch (config.batch_split), so
the result and a resume do not depend on the GPU. When even the most frugal candidate does not
fit, the choice says so with the figures and what to change.

Ranks choose together (`resolve_for_device`): the smallest free memory of all ranks decides, so
every rank runs the same setting. An `auto` choice that still runs out of memory (the estimate
is an estimate) is recorded in the run directory (`RAN_OUT_FILE`) and retried once with the
next smaller setting (trainer/training/run.py: in the same process when it is the only rank,
else by the restart that exit 143 asks for); a retried setting that runs out exits 5.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.plan.memory import CUDA_OVERHEAD_BYTES, GIB, MemoryEstimate
from trainer.restart.remote import uploader

HEADROOM_SHARE = 0.05
"""Of the device's memory kept free beyond the estimate: the estimate's own error (the planner's
target is within 10%, measured +3% on the 8B rows, trainer/plan/memory.py) and allocations the
step does not make (another process, NCCL buffers)."""
MAX_MICRO_BATCH = 64
OFFLOAD_ON = (
    "activation offloading on: checkpointed layer inputs go to pinned host memory during the forward "
    "and come back ahead of the backward; it costs tokens/s (copies share the GPU's memory bandwidth): "
    "compare tokens/s with a run without it, or see benchmarks/gpu_memory.py"
)


@dataclass(frozen=True)
class Setting:
    micro_batch_size: int
    gradient_checkpointing: bool
    activation_offload: bool
    tiled_mlp: bool = False

    def describe(self) -> str:
        return (
            f"micro_batch_size={self.micro_batch_size}, gradient_checkpointing="
            f"{str(self.gradient_checkpointing).lower()}, activation_offload={'on' if self.activation_offload else 'off'}"
            + (", tiled_mlp=on" if self.tiled_mlp else "")
        )


@dataclass(frozen=True)
class Choice:
    setting: Setting
    estimate: MemoryEstimate
    budget: float
    """Bytes the step may reserve: free memory less the headroom."""
    fits: bool
    reason: str


def candidates(
    micro: int | str, checkpointing: bool | str, offload: str, rows_per_device: int, tiled: str = "off"
) -> list[Setting]:
    """Every setting the recipe allows, fastest first (see the module docstring)."""
    micros = (
        [m for m in range(min(rows_per_device, MAX_MICRO_BATCH), 0, -1) if rows_per_device % m == 0]
        if micro == "auto"
        else [int(micro)]
    )
    ckpts = [False, True] if checkpointing == "auto" else [bool(checkpointing)]
    offloads = {"auto": [False, True], "on": [True], "off": [False]}[offload]
    tilings = {"auto": [False, True], "on": [True], "off": [False]}[tiled]
    out = []
    for ckpt in ckpts:
        for off in offloads:
            if off and not ckpt and checkpointing == "auto":
                continue  # `auto` offloads the checkpointed layer inputs, what it was made for
            out += [Setting(m, ckpt, off, tile) for tile in tilings for m in micros]
    return out


def choose(
    settings: Sequence[Setting],
    estimate: Callable[[Setting], MemoryEstimate],
    free_bytes: float,
    device_bytes: float,
    headroom_share: float = HEADROOM_SHARE,
) -> Choice:
    """The first of `settings` (fastest first) whose estimated reserved memory fits in
    `free_bytes` less `headroom_share` of `device_bytes`; else the smallest, marked as not fitting."""
    budget = free_bytes - headroom_share * device_bytes
    have = f"{free_bytes / GIB:.1f} GiB free less {headroom_share:.0%} headroom = {budget / GIB:.1f} GiB"
    estimates = [(s, estimate(s)) for s in settings]
    for i, (s, e) in enumerate(estimates):
        if e.reserved <= budget:
            faster = [f"{t.describe()} needs {f.reserved / GIB:.1f} GiB" for t, f in estimates[:i]]
            why = f"; faster settings do not fit: {'; '.join(faster[-2:])}" if faster else ""
            return Choice(s, e, budget, True, f"{s.describe()}: estimated {e.reserved / GIB:.1f} GiB of {have}{why}")
    s, e = min(estimates, key=lambda se: se[1].reserved)
    return Choice(
        s,
        e,
        budget,
        False,
        f"nothing fits: the most frugal setting ({s.describe()}) is estimated at {e.reserved / GIB:.1f} GiB, "
        f"{have}; use adapter.method=qlora, a shorter data.seq_len, train.distributed=fsdp over more GPUs, "
        "or a GPU with more memory (`spotune estimate` lists them)",
    )


def estimate(cfg: Any, shape: Any, s: Setting, shards: int = 1) -> MemoryEstimate:
    """The memory estimate of the run `cfg` (a RunConfig) with setting `s`, per device."""
    from trainer.plan.job import Job

    m = dataclasses.replace(
        cfg.model,
        gradient_checkpointing=s.gradient_checkpointing,
        activation_offload="on" if s.activation_offload else "off",
        tiled_mlp="on" if s.tiled_mlp else "off",
    )
    t = dataclasses.replace(cfg.train, micro_batch_size=s.micro_batch_size)
    job = Job(m.name_or_path, shape, "", m, cfg.adapter, t, cfg.checkpoint, cfg.data.seq_len)
    return job.memory(shards)


def choice_on(cfg: Any, shape: Any, device_bytes: float, world: int = 1, shards: int = 1) -> Choice | None:
    """What `auto` would choose on a fresh device of `device_bytes` (all of it free but the CUDA context),
    for the planner (`spotune estimate` names it per GPU); None when no memory setting is `auto`."""
    if not _is_auto(cfg):
        return None
    free = device_bytes - CUDA_OVERHEAD_BYTES
    return choose(_settings(cfg, world), lambda s: estimate(cfg, shape, s, shards), free, device_bytes)


RAN_OUT_FILE = uploader.RAN_OUT_FILE
"""In the run directory (and the store, with the run files): the `auto` setting that ran out of memory.
Every later choice of the run takes only settings after it (slower) whose estimate is smaller; one
retry, then exit 5."""


@dataclass(frozen=True)
class Auto:
    """What `auto` chose from: what an out-of-memory stop needs to try the next smaller setting."""

    chosen: Setting
    smaller: tuple[Setting, ...]
    """Later candidates (slower) with a smaller estimate than `chosen`, fastest first."""
    retried: bool
    """`chosen` was taken because a faster setting ran out of memory in an earlier attempt."""

    def next_setting(self) -> Setting | None:
        """The setting to retry with after `chosen` runs out; None after the one retry or when none is left."""
        return None if self.retried or not self.smaller else self.smaller[0]


def _settings(cfg: Any, world: int) -> list[Setting]:
    m, t = cfg.model, cfg.train
    rows = -(-(t.global_batch_size or 1) // world) if t.micro_batch_size == "auto" else 1
    return candidates(t.micro_batch_size, m.gradient_checkpointing, m.activation_offload, rows, m.tiled_mlp)


def _is_auto(cfg: Any) -> bool:
    m = cfg.model
    return "auto" in (cfg.train.micro_batch_size, m.gradient_checkpointing, m.activation_offload, m.tiled_mlp)


def resolve(
    cfg: Any, shape: Any, free_bytes: float, device_bytes: float, world: int, shards: int = 1
) -> tuple[Any, list[str]]:
    """`cfg` (a RunConfig) with its `auto` memory settings replaced by the choice, and the
    lines to log; unchanged, with no lines, when nothing is `auto`."""
    resolved, lines, _ = resolve_auto(cfg, shape, free_bytes, device_bytes, world, shards)
    return resolved, lines


def resolve_auto(
    cfg: Any,
    shape: Any,
    free_bytes: float,
    device_bytes: float,
    world: int,
    shards: int = 1,
    ran_out: Setting | None = None,
) -> tuple[Any, list[str], Auto | None]:
    """`resolve`, and what an out-of-memory stop needs (None when nothing is `auto`). `ran_out`:
    a setting that ran out of memory in an earlier attempt; only smaller, slower ones are taken."""
    m, t = cfg.model, cfg.train
    if not _is_auto(cfg):
        return cfg, [OFFLOAD_ON] if m.activation_offload == "on" else [], None
    settings = _settings(cfg, world)
    reserved = {s: estimate(cfg, shape, s, shards).reserved for s in settings}
    lines = []
    if ran_out in reserved:
        assert ran_out is not None
        settings = [s for s in settings[settings.index(ran_out) + 1 :] if reserved[s] < reserved[ran_out]]
        lines.append(
            f"auto memory settings: {ran_out.describe()} ran out of memory in an earlier attempt ({RAN_OUT_FILE} "
            "in the run directory; delete it to try it again): taking the next smaller setting"
        )
        if not settings:  # recorded only when a smaller one existed; a changed recipe may leave none
            settings = [min(reserved, key=lambda s: reserved[s])]
    choice = choose(settings, lambda s: estimate(cfg, shape, s, shards), free_bytes, device_bytes)
    s = choice.setting
    resolved = cfg.replace(
        **{
            "train.micro_batch_size": s.micro_batch_size,
            "model.gradient_checkpointing": s.gradient_checkpointing,
            "model.activation_offload": "on" if s.activation_offload else "off",
            "model.tiled_mlp": "on" if s.tiled_mlp else "off",
        }
    )
    lines.append(f"auto memory settings: {choice.reason}")
    if t.micro_batch_size == "auto":
        rows = -(-(t.global_batch_size or 1) // world)
        split_note = f"global batch stays {t.global_batch_size} rows"
        lines.append(f"auto micro-batch: {split_note}, {-(-rows // s.micro_batch_size)} micro-step(s) per device")
    if s.activation_offload:
        lines.append(f"{OFFLOAD_ON} ({choice.estimate.offloaded / GIB:.1f} GiB per micro-batch by the estimate)")
    later = settings[settings.index(s) + 1 :]
    smaller = tuple(x for x in later if reserved[x] < reserved[s])
    return resolved, lines, Auto(s, smaller, retried=ran_out in reserved)


def device_memory(device: Any) -> tuple[float, float]:
    """Free and total bytes of `device`: CUDA's (torch.cuda.mem_get_info), or available and total host memory."""
    import os

    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        free, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    return float(free), float(total)


def resolve_for_device(
    cfg: Any, name_or_path: str, device: Any, world: int, fsdp: bool, run_dir: Path | None = None
) -> tuple[Any, list[str], Auto | None]:
    """`resolve_auto` with the model's shape read from its config and the memory of `device`,
    decided together: every rank takes the smallest free and total memory of all ranks, and skips
    what ran out in any rank's earlier attempt, so all ranks choose the same (under FSDP their
    collectives must match). Only the main rank's lines are logged."""
    if not _is_auto(cfg):
        return cfg, [OFFLOAD_ON] if cfg.model.activation_offload == "on" else [], None
    from transformers import AutoConfig

    from trainer.model import distributed, flops

    m = cfg.model
    hf = AutoConfig.from_pretrained(name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code)
    shape = flops.model_shape(hf.get_text_config())
    settings = _settings(cfg, world)
    ran_out = read_ran_out(run_dir) if run_dir is not None else None
    index = settings.index(ran_out) + 1 if ran_out in settings else 0
    free, total = device_memory(device)
    low_free, low_total, neg_index = distributed.min_over_ranks([free, total, -index], device)
    index = int(-neg_index)
    return resolve_auto(
        cfg,
        shape,
        low_free,
        low_total,
        world,
        shards=world if fsdp else 1,
        ran_out=settings[index - 1] if index else None,
    )


def read_ran_out(run_dir: Path) -> Setting | None:
    """The setting an earlier attempt recorded as out of memory (`RAN_OUT_FILE`), if any."""
    try:
        raw = json.loads((run_dir / RAN_OUT_FILE).read_text())
        return Setting(
            int(raw["micro_batch_size"]),
            bool(raw["gradient_checkpointing"]),
            bool(raw["activation_offload"]),
            bool(raw.get("tiled_mlp", False)),  # written before MLP tiling existed: untiled
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_ran_out(run_dir: Path, setting: Setting, step: int, rank: int) -> None:
    """Write `RAN_OUT_FILE` for the next choice (each rank writes its own machine's copy)."""
    from trainer.atomic import write_text

    row = {**dataclasses.asdict(setting), "step": step, "rank": rank}
    write_text(run_dir / RAN_OUT_FILE, json.dumps(row) + "\n")


def out_of_memory_figures(cfg: Any, hf_config: Any, accelerator: Any) -> dict[str, Any]:
    """What an out-of-memory stop reports (`shutdown.out_of_memory_message`): this GPU, what torch
    held, and the estimate's reserved peak for the setting that ran out."""
    import torch

    from trainer.model import flops

    device, m, t = accelerator.device, cfg.model, cfg.train
    cuda = device.type == "cuda"
    setting = Setting(
        int(t.micro_batch_size), bool(m.gradient_checkpointing), m.activation_offload == "on", m.tiled_mlp == "on"
    )
    predicted = None
    try:
        shards = accelerator.num_processes if t.distributed == "fsdp" else 1
        predicted = estimate(cfg, flops.model_shape(hf_config), setting, shards).reserved / GIB
    except (ValueError, KeyError):
        pass  # an architecture the estimate does not know: the message goes without its figure
    return {
        "device_name": torch.cuda.get_device_name(device) if cuda else str(device),
        "device_gib": torch.cuda.get_device_properties(device).total_memory / GIB if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
        "predicted_gib": predicted,
        "micro_batch_size": setting.micro_batch_size,
        "gradient_checkpointing": setting.gradient_checkpointing,
        "activation_offload": setting.activation_offload,
        "method": cfg.adapter.method,
    }


def after_out_of_memory(
    err: Any, cfg: Any, hf_config: Any, accelerator: Any, auto: Auto | None, run_dir: Path
) -> tuple[int, bool]:
    """The exit code after `err` (shutdown.OutOfMemory), and whether to retry in this process.

    An `auto` choice not yet retried is recorded (`RAN_OUT_FILE`) and retried with the next smaller
    setting: in this process when it is the only rank (True), else by the restart that exit 143
    asks for (the other ranks are stuck in a collective this rank will never join). Anything else
    (a setting the recipe fixed, a retry that ran out too) exits 5 with the figures."""
    import sys

    from trainer.exit_codes import EXIT_OUT_OF_MEMORY, EXIT_PREEMPTED
    from trainer.training.shutdown import out_of_memory_message

    smaller = auto.next_setting() if auto is not None else None
    if auto is not None and smaller is not None:
        record_ran_out(run_dir, auto.chosen, err.step, int(accelerator.process_index))
        alone = int(accelerator.num_processes) == 1
        then = "now, from the last checkpoint" if alone else f"on the next attempt (exit {EXIT_PREEMPTED}: rerun it)"
        print(
            f"spotune: CUDA {err}: the `auto` choice {auto.chosen.describe()} ran out of memory "
            f"(the estimate fell short); retrying with {smaller.describe()} {then}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED, alone
    figures = out_of_memory_figures(cfg, hf_config, accelerator)
    print(out_of_memory_message(err, **figures, retried=auto is not None and auto.retried), file=sys.stderr, flush=True)
    return EXIT_OUT_OF_MEMORY, False
