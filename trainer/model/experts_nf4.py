"""QLoRA's routed experts in 4 bits: each expert of a fused 3-D expert Parameter stored in NF4, dequantised in the
forward only for the experts a batch routes to, and never kept dequantised for the backward.

bitsandbytes' `load_in_4bit` quantises nn.Linear layers only, so transformers 5's fused experts (one 3-D Parameter
per projection, most of an MoE model's weights) would load in 16 bits. `quantise` stores each expert of each such
Parameter with bitsandbytes' own `quantize_4bit` (NF4, double quantisation, bitsandbytes' default block size: what
`load_in_4bit` gives the linear layers through trainer/model/load.py's `quantization_config`) and replaces the
Parameter: it leaves the module's parameters, so nothing keeps a full-precision copy, and a storage-less stand-in of
its shape and dtype (on the meta device, a plain attribute) is what peft's ParamWrapper (built before) and
`experts.find` read; any code that would read its values fails loudly instead of computing with zeros.

The expert LoRA kernel (trainer/model/experts.py) reads an expert weight through `weight`: the Parameter itself for
a model that is not quantised, else the experts it routes to dequantised with bitsandbytes' `dequantize_4bit`
(the other experts zero, never read). What autograd saves of that tensor for the backward (the per-expert slices
the matmuls save) is packed as a recipe by saved-tensor hooks pushed around each forward of the experts' outermost
LoRA wrapper (`_Recompute`), and dequantised again, expert by expert, when the backward needs it: recompute, as
bitsandbytes' own 4-bit matmul does for a linear layer.

The LoRA factors stay in the compute dtype's master copy (fp32) and train as on a 16-bit base. A merged export is
merged into the 16-bit base (trainer/serve/export.py), as for every QLoRA run.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

QUANT_TYPE = "nf4"
_ATTR = "_spotune_nf4"
"""The attribute of a fused experts module that holds its NF4 storage (`Nf4Experts`)."""


@dataclass
class Projection:
    """One expert Parameter in NF4, expert by expert (bitsandbytes' QuantState fields, stacked over experts)."""

    shape: tuple[int, ...]
    """The Parameter's shape [experts, a, b]."""
    dtype: torch.dtype
    """What dequantising gives (the Parameter's dtype: the compute dtype)."""
    blocksize: int
    packed: torch.Tensor
    """[experts, a * b / 2] uint8: two 4-bit codes a byte."""
    absmax: torch.Tensor
    """[experts, blocks] uint8: each block's absmax, itself quantised (double quantisation)."""
    absmax_scale: torch.Tensor
    """[experts, blocks / 256] fp32: the absmax blocks' scales."""
    offset: torch.Tensor
    """[experts] fp32: the mean each expert's absmax was centred on before quantising."""
    nested_blocksize: int
    code: torch.Tensor
    """The NF4 code (16 values), shared by every expert."""
    absmax_code: torch.Tensor
    """The absmax quantisation's code (256 values), shared by every expert."""

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.absmax, self.absmax_scale, self.offset, self.code, self.absmax_code]

    def nbytes(self) -> int:
        """Resident bytes of this projection's storage, codes included."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def expert(self, e: int) -> torch.Tensor:
        """Expert `e`'s weight [a, b], dequantised."""
        import bitsandbytes.functional as bnb

        nested = bnb.QuantState(
            absmax=self.absmax_scale[e], code=self.absmax_code, blocksize=self.nested_blocksize, dtype=torch.float32
        )
        state = bnb.QuantState(
            absmax=self.absmax[e],
            shape=torch.Size(self.shape[1:]),
            code=self.code,
            blocksize=self.blocksize,
            quant_type=QUANT_TYPE,
            dtype=self.dtype,
            offset=self.offset[e],
            state2=nested,
        )
        return bnb.dequantize_4bit(self.packed[e], state)

    def experts(self, hit: Iterable[int]) -> torch.Tensor:
        """[experts, a, b]: the experts in `hit` dequantised, the others zero; in one `dequantize_4bit` call where
        each expert is whole blocks (then the flattened experts hit are one tensor to bitsandbytes; one kernel,
        not one per expert, on a GPU), else expert by expert. The same values as `expert` either way."""
        import bitsandbytes.functional as bnb

        hit = list(hit)
        full = torch.zeros(self.shape, dtype=self.dtype, device=self.packed.device)
        per = self.shape[1] * self.shape[2]
        if not hit:
            return full
        if per % self.blocksize:
            for e in hit:  # (bitsandbytes' `out=` variant has no CPU kernel: one expert's copy at a time)
                full[e].copy_(self.expert(e))
            return full
        index = torch.tensor(hit, device=self.packed.device)
        state = bnb.QuantState(
            absmax=self._absmax(hit, index),
            shape=torch.Size((len(hit), *self.shape[1:])),
            code=self.code,
            blocksize=self.blocksize,
            quant_type=QUANT_TYPE,
            dtype=self.dtype,
        )
        some = bnb.dequantize_4bit(self.packed[index].reshape(-1), state)
        if len(hit) == self.shape[0] and hit == sorted(hit):
            return some  # every expert hit: no scatter (and no second copy of the projection)
        return full.index_copy_(0, index, some)

    def _absmax(self, hit: list[int], index: torch.Tensor) -> torch.Tensor:
        """The fp32 block scales of the experts `hit`, flattened, as bitsandbytes' nested dequantisation gives them
        (dequantize_blockwise, plus each expert's offset): one call where each expert's scales are whole blocks."""
        import bitsandbytes.functional as bnb

        blocks = self.absmax.shape[1]
        if blocks % self.nested_blocksize == 0:
            nested = bnb.QuantState(
                absmax=self.absmax_scale[index].reshape(-1),
                code=self.absmax_code,
                blocksize=self.nested_blocksize,
                dtype=torch.float32,
            )
            scales = bnb.dequantize_blockwise(self.absmax[index].reshape(-1), nested)
        else:
            scales = torch.cat(
                [
                    bnb.dequantize_blockwise(
                        self.absmax[e],
                        bnb.QuantState(
                            absmax=self.absmax_scale[e],
                            code=self.absmax_code,
                            blocksize=self.nested_blocksize,
                            dtype=torch.float32,
                        ),
                    )
                    for e in hit
                ]
            )
        return scales + self.offset[index].repeat_interleave(blocks)


@dataclass
class Nf4Experts:
    """A fused experts module's NF4 storage, and the dequantised weights alive in its current forward."""

    projections: dict[str, Projection]
    live: dict[int, tuple[weakref.ref[torch.Tensor], str, list[int]]] = field(default_factory=dict)
    """id of a dequantised tensor -> (the tensor, its projection, the experts dequantised in it): what the pack hook
    recognises (weakly held: a tensor freed in the forward must not match a later one at the same address)."""
    hooked: int = 0
    """Forwards in progress under the recompute hooks (`_Recompute`): only then is a dequantised tensor recorded."""

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.projections.values())


def storage(experts: torch.nn.Module) -> Nf4Experts | None:
    """The NF4 storage of a fused experts module (None: its expert Parameters hold their weights)."""
    return getattr(experts, _ATTR, None)


def weight(experts: torch.nn.Module, name: str, hit: list[int]) -> torch.Tensor:
    """The expert Parameter `name` of `experts` as the kernel multiplies by it ([experts, ...], as stored): the
    Parameter itself, or, quantised, the experts with rows routed to them (`hit`, ascending) dequantised."""
    nf4 = storage(experts)
    if nf4 is None:
        return getattr(experts, name)
    full = nf4.projections[name].experts(hit)
    if nf4.hooked and torch.is_grad_enabled():
        nf4.live[id(full)] = (weakref.ref(full), name, hit)
    return full


@dataclass(frozen=True)
class _Saved:
    """What the backward gets instead of a view of a dequantised weight: how to dequantise it again."""

    projection: Projection
    hit: tuple[int, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> torch.Tensor:
        per = self.projection.shape[1] * self.projection.shape[2]
        extent = sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True) if n) + 1
        first, last = self.offset // per, (self.offset + extent - 1) // per
        if first == last:  # a slice of one expert (the per-expert loop's matmuls save these): that expert alone
            one = self.projection.expert(first)
            return one.as_strided(self.size, self.stride, self.offset - first * per)
        return self.projection.experts(self.hit).as_strided(self.size, self.stride, self.offset)


class _Recompute:
    """Saved-tensor hooks for one forward of a quantised experts module: a view of a weight `weight` dequantised is
    saved as a `_Saved` recipe; everything else is saved as it is."""

    def __init__(self, nf4: Nf4Experts) -> None:
        self.nf4 = nf4
        self.active: list[Any] = []

    def pack(self, t: torch.Tensor) -> Any:
        root = t._base if t._base is not None else t
        entry = self.nf4.live.get(id(root))
        if entry is None or entry[0]() is not root:
            return t
        _, name, hit = entry
        return _Saved(
            self.nf4.projections[name], tuple(hit), tuple(t.size()), tuple(t.stride()), int(t.storage_offset())
        )

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, _Saved) else saved

    def enter(self, module: torch.nn.Module, args: Any) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self.active.append(hooks)
        self.nf4.hooked += 1

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.active.pop().__exit__(None, None, None)
        self.nf4.hooked -= 1
        if not self.nf4.hooked:
            self.nf4.live.clear()


@dataclass(frozen=True)
class Quantised:
    """What `quantise` did: the fused expert Parameters stored in NF4 and their bytes before and after."""

    parameters: list[str]
    dense_bytes: int
    """The Parameters' bytes as loaded (16 or 32 bits a weight)."""
    nf4_bytes: int
    """Their NF4 storage: packed codes, quantised absmax, scales, offsets and codes."""


def quantise(
    experts: dict[str, torch.nn.Module],
    names: Iterable[str],
    wrappers: Iterable[torch.nn.Module],
    device: torch.device | None = None,
) -> Quantised:
    """Store the 3-D expert Parameters `names` of each fused experts module in NF4, expert by expert, on `device`
    (default: where each is; one expert at a time goes there in 16 bits), see the module docstring; and hook each experts module's outermost LoRA wrapper (`wrappers`, whose forward runs the kernel) so
    the backward dequantises again instead of keeping dequantised weights."""
    import bitsandbytes.functional as bnb

    names = tuple(names)
    done: list[str] = []
    dense = packed = 0
    for module_name, module in experts.items():
        projections: dict[str, Projection] = {}
        for name in names:
            param = getattr(module, name, None)
            if not isinstance(param, torch.nn.Parameter) or param.dim() != 3 or param.is_meta:
                continue
            projections[name] = _quantised(bnb, param.detach(), device or param.device)
            dense += param.numel() * param.element_size()
            # Gone from the module's parameters (so `.to()`, DDP's broadcast and state dicts never meet it); in its
            # place a plain attribute of the same shape and dtype on the meta device, which peft's wrapper and
            # `experts.find` read the shape of, and which fails loudly if anything reads its values.
            del module._parameters[name]
            object.__setattr__(
                module, name, torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
            )
            done.append(f"{module_name}.{name}")
        if projections:
            setattr(module, _ATTR, Nf4Experts(projections))
            packed += sum(p.nbytes() for p in projections.values())
    by_experts = {id(m): storage(m) for m in experts.values()}
    for wrapper in wrappers:
        held = by_experts.get(id(_innermost(wrapper)))
        if held is not None:
            hooks = _Recompute(held)
            wrapper.register_forward_pre_hook(hooks.enter)
            wrapper.register_forward_hook(hooks.exit, always_call=True)  # popped when the forward raises too
    return Quantised(done, dense, packed)


def _quantised(bnb: Any, param: torch.Tensor, device: torch.device) -> Projection:
    states, packed = [], []
    for e in range(param.size(0)):
        weight = param[e].to(device).contiguous()
        codes, state = bnb.quantize_4bit(weight, compress_statistics=True, quant_type=QUANT_TYPE)
        packed.append(codes.flatten())
        states.append(state)
    first = states[0]
    return Projection(
        shape=tuple(param.shape),
        dtype=param.dtype,
        blocksize=first.blocksize,
        packed=torch.stack(packed),
        absmax=torch.stack([s.absmax for s in states]),
        absmax_scale=torch.stack([s.state2.absmax for s in states]),
        offset=torch.stack([s.offset.reshape(()) for s in states]),
        nested_blocksize=first.state2.blocksize,
        code=first.code,  # the same NF4 table for every expert
        absmax_code=first.state2.code,  # the same dynamic-map table for every expert
    )


def _innermost(module: Any) -> Any:
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def dequantised(experts: torch.nn.Module, name: str) -> torch.Tensor:
    """Every expert of the quantised Parameter `name`, dequantised: the weights the NF4 model computes with."""
    nf4 = storage(experts)
    if nf4 is None:
        raise ValueError(f"{type(experts).__name__}: its expert Parameters are not quantised")
    projection = nf4.projections[name]
    return projection.experts(range(projection.shape[0]))


def quantised_modules(model: torch.nn.Module) -> Iterator[tuple[str, Nf4Experts]]:
    """(name, NF4 storage) of each quantised experts module of `model`."""
    for module_name, module in model.named_modules():
        nf4 = storage(module)
        if nf4 is not None:
            yield module_name, nf4
