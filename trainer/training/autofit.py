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
the result and a resume do not depend on the GPU. Nothing is tried and retried: when even the
most frugal candidate does not fit, the choice says so with the figures and what to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.plan.memory import GIB, MemoryEstimate

HEADROOM_SHARE = 0.05
"""Of the device's memory kept free beyond the estimate: the estimate's own error (the issue's
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


def resolve(
    cfg: Any, shape: Any, free_bytes: float, device_bytes: float, world: int, shards: int = 1
) -> tuple[Any, list[str]]:
    """`cfg` (a RunConfig) with its `auto` memory settings replaced by the choice, and the
    lines to log; unchanged, with no lines, when nothing is `auto`."""
    m, t = cfg.model, cfg.train
    if "auto" not in (t.micro_batch_size, m.gradient_checkpointing, m.activation_offload, m.tiled_mlp):
        return cfg, [OFFLOAD_ON] if m.activation_offload == "on" else []
    rows = -(-(t.global_batch_size or 1) // world) if t.micro_batch_size == "auto" else 1
    settings = candidates(t.micro_batch_size, m.gradient_checkpointing, m.activation_offload, rows, m.tiled_mlp)

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
    lines = [f"auto memory settings: {choice.reason}"]
    if t.micro_batch_size == "auto":
        split_note = f"global batch stays {t.global_batch_size} rows"
        lines.append(f"auto micro-batch: {split_note}, {-(-rows // s.micro_batch_size)} micro-step(s) per device")
    if s.activation_offload:
        lines.append(f"{OFFLOAD_ON} ({choice.estimate.offloaded / GIB:.1f} GiB per micro-batch by the estimate)")
    return resolved, lines


def resolve_for_device(cfg: Any, name_or_path: str, device: Any, world: int, fsdp: bool) -> tuple[Any, list[str]]:
    """`resolve` with the model's shape read from its config and the memory of `device`: free
    and total CUDA memory (torch.cuda.mem_get_info), or available and total host memory on CPU."""
    m, t = cfg.model, cfg.train
    if "auto" not in (t.micro_batch_size, m.gradient_checkpointing, m.activation_offload, m.tiled_mlp):
        return cfg, []
    import os

    import torch
    from transformers import AutoConfig

    from trainer.model import flops

    hf = AutoConfig.from_pretrained(name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code)
    shape = flops.model_shape(hf.get_text_config())
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        free, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    return resolve(cfg, shape, float(free), float(total), world, shards=world if fsdp else 1)


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
