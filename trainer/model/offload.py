"""Activation offloading: what autograd saves inside the decoder goes to host memory during the
forward and comes back ahead of the backward (`model.activation_offload`).

The mechanism is autograd's `saved_tensors_hooks` (torchtune's OffloadActivations uses the same
one): while the decoder body runs forward, every tensor autograd saves for backward passes
through `pack`, and `unpack` gives it back when backward needs it. With gradient checkpointing
(non-reentrant) the only tensors saved outside the checkpointed regions are each layer's inputs
(torch.utils.checkpoint saves them with `save_for_backward` before it installs its own inner
hooks, which win inside the layer), so those, about `hidden x tokens x dtype` per layer, are what
moves: the device then holds one layer's activations at a time, whatever the layer count.

On CUDA:
- pack copies the tensor into pinned host memory on a side stream (after the compute stream's
  work so far), so the forward does not wait for the copy; `record_stream` keeps the device
  block from being reused until the copy has finished;
- unpack of saved tensor k also starts the host-to-device copy of tensor k-1 on the side stream
  (backward consumes saved tensors in reverse order of the forward), so the next layer's input
  is on its way while this layer recomputes; the compute stream waits on that copy's event only
  when it needs the tensor.
On CPU the same hooks run with plain copies into separate host tensors, so the tests exercise
the code path: the values that come back are bit-identical to what went out, which is why loss
and gradients do not change (tests/test_offload.py).

Not moved: the decoder's parameters (or views of them; their storage is on the device anyway;
under FSDP2 also the weights a layer gathers, and the DTensors themselves),
and tensors under `min_bytes` (rotary tables, positions: the copy would cost more than it saves).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

MIN_BYTES = 1024
"""Smaller saved tensors stay where they are (torchtune's default threshold as well)."""


@dataclass
class _Offloaded:
    """One saved tensor that lives in host memory until backward needs it."""

    host: torch.Tensor
    device: torch.device
    index: int
    copied: Any = None  # CUDA event: the device-to-host copy has finished
    fetched: torch.Tensor | None = None  # prefetched device copy
    fetched_event: Any = None


class ActivationOffload:
    """The pack/unpack pair and its bookkeeping for one model (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, min_bytes: int = MIN_BYTES) -> None:
        self.module = module
        self.min_bytes = min_bytes
        self.stream: Any = None
        self.saved: list[_Offloaded | None] = []
        self.skip: set[int] = set()
        self.seen: dict[tuple, tuple[weakref.ref[torch.Tensor], _Offloaded]] = {}
        """One host copy for a tensor saved twice (RMSNorm's input), by where its bytes are (see `pack`)."""
        self.offloaded_bytes = 0
        """Bytes moved to host memory by the latest forward (what the estimate's `offloaded` term predicts)."""
        self._hooks: Any = None

    # Called by the decoder's forward pre-hook and forward hook (see `attach`).
    def enter(self) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation saves nothing
        self.saved = []
        self.seen = {}
        self.offloaded_bytes = 0
        # Parameter storages, gathered each forward: FSDP gathers parameters into new storages.
        # Under FSDP2 the registered parameters are DTensors here (their layer has not gathered
        # them yet), which have no storage of their own: their local shard's is what they hold.
        self.skip = {ptr for p in self.module.parameters() if (ptr := _storage_ptr(p)) is not None}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def exit(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self.seen = {}  # keys hold data pointers: only valid while this forward's tensors live

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        ptr = _storage_ptr(t)
        if (
            nbytes < self.min_bytes
            or ptr is None  # a tensor subclass without storage (a DTensor): left to its owner
            or _is_parameter(t)
            or t.device.type not in ("cuda", "cpu")
            or ptr in self.skip
        ):
            return t
        key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        if (hit := self.seen.get(key)) is not None and hit[0]() is t:
            return hit[1]
        item = _Offloaded(host=torch.empty(0), device=t.device, index=len(self.saved))
        if t.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully computed before it is read
            with torch.cuda.stream(stream):
                item.host = torch.empty_like(t, device="cpu", pin_memory=True)
                item.host.copy_(t, non_blocking=True)
                item.copied = stream.record_event()
            t.record_stream(stream)  # the block is not reused before the copy ends
        else:
            item.host = torch.empty_like(t, device="cpu")
            item.host.copy_(t)
        self.saved.append(item)
        # The key names memory, which a tensor freed during this forward hands on to the next one of its shape
        # (each layer's input, under checkpointing): a hit counts only while the very tensor it was made for
        # lives (its storage cannot have been reused then), or a layer would get another layer's activations back.
        self.seen[key] = (weakref.ref(t), item)
        self.offloaded_bytes += nbytes
        return item

    def unpack(self, item: Any) -> torch.Tensor:
        if not isinstance(item, _Offloaded):
            return item
        if item.index > 0:  # backward runs in reverse: the previous layer's input comes next
            earlier = self.saved[item.index - 1]
            if earlier is not None:
                self._fetch(earlier)
        self._fetch(item)
        self.saved[item.index] = None  # the host copy goes once autograd drops its reference
        assert item.fetched is not None
        t, item.fetched = item.fetched, None
        if t.is_cuda:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(item.fetched_event)
            t.record_stream(current)  # allocated on the side stream, used and freed on this one
        return t

    def _fetch(self, item: _Offloaded) -> None:
        """Start the copy back to the device (once)."""
        if item.fetched is not None:
            return
        if item.device.type == "cuda":
            stream = self._side_stream()
            with torch.cuda.stream(stream):
                stream.wait_event(item.copied)
                item.fetched = torch.empty_like(item.host, device=item.device)
                item.fetched.copy_(item.host, non_blocking=True)
                item.fetched_event = stream.record_event()
        else:
            item.fetched = torch.empty_like(item.host)
            item.fetched.copy_(item.host)

    def _side_stream(self) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        return self.stream


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where `t`'s storage starts; a DTensor's local shard's; None for a tensor without storage."""
    local = t.to_local() if hasattr(t, "to_local") else t  # torch.distributed.tensor.DTensor
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear layer saves its weight transposed). FSDP2 gathers a
    layer's weights into fresh parameters inside the layer's own pre-hook, after `enter` ran, so
    the storage set misses them; being (a view of) a Parameter does not."""
    return isinstance(t, torch.nn.Parameter) or isinstance(getattr(t, "_base", None), torch.nn.Parameter)


def attach(model: torch.nn.Module, min_bytes: int = MIN_BYTES) -> ActivationOffload:
    """Offload what the decoder body of `model` saves for backward; returns the offloader.

    Hooks on the decoder body, not on the whole model: the head and fused loss (trainer/model/loss.py)
    keep their small working set on the device. The forward hook runs even when the forward
    raises (`always_call`), so the saved-tensor hooks never leak into later code.
    """
    from trainer.model.loss import causal_lm

    decoder = causal_lm(model).get_decoder()
    offload = ActivationOffload(decoder, min_bytes)
    decoder.register_forward_pre_hook(lambda module, args: offload.enter())
    decoder.register_forward_hook(lambda module, args, output: offload.exit(), always_call=True)
    model.spotune_offload = offload  # type: ignore[assignment]  # the run's log and the benchmark read it
    return offload
