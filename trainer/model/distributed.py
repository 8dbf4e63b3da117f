"""How several processes share the model: DDP (accelerate wraps it) or FSDP2 (spotune shards it).

`train.distributed=fsdp`, or an `accelerate launch` FSDP config, shards the model with FSDP2's
`fully_shard`: once per decoder layer, then at the root (embeddings, final norm, head). Each
device then holds 1/N of the frozen base, of the adapter and of its optimizer state, and a
layer's weights are all-gathered only while that layer runs.

Why spotune calls `fully_shard` itself rather than leaving it to accelerate: accelerate turns
FSDP on only on accelerators (a torchrun launch on CPU stays MULTI_CPU, i.e. DDP), so sharding
here is the one code path that both the CPU tests (gloo) and a GPU run take. The sharded model
then goes through `accelerator.prepare_model(..., evaluation_mode=True)`, which applies only
accelerate's autocast wrapper. Its training-mode preparation is exactly what must not happen
(accelerate 1.15, `Accelerator.prepare_model`): on MULTI_CPU / MULTI_GPU it would wrap the model
in DDP, and refuses a model with DTensor parameters; on an FSDP accelerator it refuses FSDP2
outside `prepare()`, whose FSDP2 path re-reads its own plugin (wrap policy, mixed precision).

The rest of what the loop and the checkpoints must do differently lives here too: `no_sync`
(no gradient reduce-scatter on all but the last micro-batch), `clip_grad_norm_` (a plain norm
out of DTensor gradients), `full_tensor` / `shard_like` (checkpoints hold full tensors whatever
the sharding, so they resume on any world size, under FSDP or DDP).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import ConfigError

log = logging.getLogger(__name__)

FSDP_MIN_TORCH = (2, 6)
"""`torch.distributed.fsdp.fully_shard` (FSDP2) is public from torch 2.6."""


@dataclass(frozen=True)
class Sharding:
    """What this run does with its model across processes."""

    fsdp: bool = False
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    """Asked for by an accelerate FSDP config (the recipe's own key is model.gradient_checkpointing)."""
    notes: tuple[str, ...] = ()


def require_fsdp_torch(version: str = torch.__version__) -> None:
    """Refuse FSDP on a torch without public FSDP2, naming the version needed."""
    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])
    if (major, minor) < FSDP_MIN_TORCH:
        raise ConfigError(
            [
                f"train.distributed: fsdp needs torch>={FSDP_MIN_TORCH[0]}.{FSDP_MIN_TORCH[1]} (FSDP2's fully_shard); "
                f"this is torch {version}: pip install 'torch>=2.6', or use train.distributed=ddp"
            ]
        )


def process_group_backend(distributed: str, cpu_offload: bool, cuda: bool) -> str | None:
    """The backend to ask accelerate for, when the default will not do.

    With CPU offload the sharded gradients and optimizer state live in CPU memory, and the
    gradient norm and the checkpoint gather run collectives on them: NCCL takes CUDA tensors only,
    so CPU tensors need gloo beside it (what accelerate itself sets for its FSDP offload).
    """
    return "cuda:nccl,cpu:gloo" if distributed == "fsdp" and cpu_offload and cuda else None


def choose(distributed: str, cpu_offload: bool, accelerator: Any) -> Sharding:
    """Sharding from the recipe (`train.distributed`) and from how accelerate was launched."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP):
        raise ConfigError(
            [
                f"accelerate is configured for {kind.value}; spotune runs one process, DDP (torchrun, or accelerate "
                "launch --multi_gpu) or FSDP (train.distributed=fsdp, or an accelerate FSDP config)"
            ],
            "accelerate config",
        )
    if distributed != "fsdp" and kind != DistributedType.FSDP:
        return Sharding()
    require_fsdp_torch()
    notes, checkpointing = [], False
    if kind == DistributedType.FSDP:  # `accelerate launch --config_file` with an FSDP config
        if distributed != "fsdp":
            notes.append("accelerate is configured for FSDP: sharding as with train.distributed=fsdp")
        plugin = accelerator.state.fsdp_plugin
        cpu_offload = cpu_offload or _plugin_offloads(plugin)
        checkpointing = bool(getattr(plugin, "activation_checkpointing", False))
    if not torch.distributed.is_initialized():
        notes.append(
            "train.distributed=fsdp in a single process: nothing to shard, training unsharded (launch with torchrun, "
            "also --nproc_per_node 1, for train.fsdp_cpu_offload on one GPU)"
        )
        return Sharding(notes=tuple(notes))
    world = torch.distributed.get_world_size()
    where = ", shards kept in CPU memory" if cpu_offload else ""
    notes.append(f"FSDP: sharding over {world} process{'es' * (world > 1)}, a unit per decoder layer{where}")
    return Sharding(True, cpu_offload, checkpointing, tuple(notes))


def _plugin_offloads(plugin: Any) -> bool:
    """accelerate's FSDP plugin holds a CPUOffloadPolicy (FSDP2) or a CPUOffload(offload_params) (FSDP1)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = getattr(plugin, "cpu_offload", None)
    return isinstance(offload, CPUOffloadPolicy) or bool(getattr(offload, "offload_params", False))


def prepare(
    accelerator: Any,
    model: torch.nn.Module,
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    sharding: Sharding,
) -> tuple[Any, Any]:
    """The model and its optimizer (over the trainable parameters, in `model.parameters()` order),
    handed to accelerate: DDP-wrapped, or sharded here first (see the module docstring)."""
    if not sharding.fsdp:
        return accelerator.prepare(model, make_optimizer([p for p in model.parameters() if p.requires_grad]))
    model = shard(model, accelerator.device, sharding.cpu_offload)
    # fully_shard swapped every parameter for a DTensor one under the same name and in the same
    # order, so the optimizer's parameter indices (the checkpoint's `state.<idx>`) match DDP's.
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)  # autocast only
    return model, accelerator.prepare_optimizer(optimizer, device_placement=False)


def shard(model: torch.nn.Module, device: torch.device, cpu_offload: bool) -> torch.nn.Module:
    """FSDP2 over every process: each decoder layer is one unit (all-gathered for its forward and
    backward, resharded after), the root holds the rest. Every rank built the same LoRA init
    (same seed), so the shards agree without a broadcast.

    A non-quantised base arrives on the CPU and fully_shard moves each shard to `device` (or keeps
    it in CPU memory under `cpu_offload`); a 4-bit base arrives on `device` already.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from trainer.model.load import decoder_layers

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model, "train.distributed", "use train.distributed=ddp"):
        fully_shard(layer, mesh=mesh, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


# ---------------------------------------------------------------------------- the loop's two calls


@contextlib.contextmanager
def no_sync(accelerator: Any, model: torch.nn.Module) -> Iterator[None]:
    """Backward without reducing gradients across ranks; they accumulate until a synced backward.

    FSDP2 keeps the unsharded gradients of the trainable (LoRA) parameters meanwhile: small next
    to the base, and one reduce-scatter per optimizer step instead of one per micro-batch.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        with accelerator.no_sync(model):  # DDP's no_sync; a no-op on one process
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(accelerator: Any, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` and return the global gradient norm as a plain tensor.

    Under FSDP the gradients are DTensor shards and torch's clip returns the norm as a DTensor
    (already reduced over the shards); the loop stacks it with plain tensors, so it is unwrapped.
    """
    return full_tensor(accelerator.clip_grad_norm_(params, max_norm))


# ---------------------------------------------------------------------------- full <-> sharded tensors


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: an all-gather for a DTensor (collective: every rank calls
    it, in the same order), the tensor itself otherwise."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]  # DTensor method


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` cut the way `like` is sharded (this rank's piece, on `like`'s device), or `full`
    itself when `like` is a plain tensor. Every rank holds `full` (read from the checkpoint), so
    no data moves between ranks."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import DTensor, distribute_tensor

    kwargs = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]  # DTensor attributes
    cut = distribute_tensor(full.to(like.dtype), mesh, placements, **kwargs)
    local = cut.to_local().to(like.device)  # CPU when the shards are offloaded
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=cut.shape, stride=cut.stride())


def _dtensor_class() -> Any:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5 names it torch.distributed._tensor; FSDP needs 2.6 anyway
        return None
    return DTensor


# ---------------------------------------------------------------------------- collective timeout


class CollectiveTimeout:
    """How long a collective may wait for the other ranks, once training runs.

    torch waits 10 minutes (NCCL) or 30 (gloo) by default: a rank that hangs (a stuck GPU, a
    deadlock) or dies without its peers noticing (NCCL cannot tell) keeps every other rank, and
    the bill, running that long. Start-up keeps the default (rank 0 may prepare data or download
    while the others wait); after the first optimizer step `arm()` sets `seconds`, after a barrier
    so that no rank runs a collective under the short timeout while a slower one still ends its
    first step under the long one (torchtitan's `set_pg_timeouts` does the same). `disarm()` puts
    the default back for final/, the merge and the report, where the others may wait longer.

    On a timeout gloo raises in the waiting rank, and NCCL's watchdog ends the process: either
    way the run exits non-zero and a supervisor restarts it from the last checkpoint.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.armed = False

    @staticmethod
    def _group() -> Any:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.group.WORLD

    def arm(self) -> None:
        """Idempotent; a no-op in one process or without `seconds`."""
        if self.armed or self.seconds is None:
            return
        self.armed = True
        group = self._group()
        if group is not None:
            import torch.distributed as dist

            dist.barrier()
            _set_timeout(group, self.seconds)

    def disarm(self) -> None:
        if not self.armed:
            return
        self.armed = False
        group = self._group()
        if group is not None:
            import torch.distributed as dist
            from torch.distributed import distributed_c10d as c10d

            default = getattr(c10d, "_get_default_timeout", None)
            if default is not None:
                _set_timeout(group, default(dist.get_backend(group)).total_seconds())


def _set_timeout(group: Any, seconds: float) -> None:
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    # Private, but the one way to change a live group's timeout (torch >= 2.3; torchtitan uses it).
    # A torch without it keeps the default: slower to end a hung run, never wrong.
    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        log.warning(
            "torch %s cannot change a process group's timeout: train.collective_timeout_seconds is not applied",
            torch.__version__,
        )
        return
    set_timeout(timedelta(seconds=seconds), group)


def min_over_ranks(values: list[float], device: Any) -> list[float]:
    """Each value's minimum over every rank (one all-reduce MIN), for a decision all ranks must
    share; the values themselves in one process. A maximum is the minimum of the negated value."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return list(values)
    where = device if getattr(device, "type", "cpu") == "cuda" else torch.device("cpu")  # NCCL takes CUDA tensors
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [float(x) for x in t.tolist()]


def end_process_group() -> None:
    """Destroy this process's gloo group, if one is up, before the interpreter exits.

    Left to interpreter shutdown, a gloo group whose collective timed out can still hold that
    receive: its C++ destructor then calls std::terminate, and the rank dies of SIGABRT (134)
    instead of exiting with its code, about one time in three on CPU. Destroying it is local (no
    rank waits for another), so it cannot hang a rank whose partners are gone. NCCL is left as
    it was: its watchdog already ends a timed-out rank, and shutting down a communicator whose
    peers died can block."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return
    try:
        dist.destroy_process_group()
    except Exception as e:  # the exit code already says what happened; this must not replace it
        log.warning("could not destroy the process group on exit: %s", e)
