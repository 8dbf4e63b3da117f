"""Memory of one real-shaped decoder layer, measured on the meta device (no compute, any length).

- `LiveBytes`: a TorchDispatchMode that counts the bytes of every storage an op creates until the
  storage is freed (a finalizer on it), and the peak of that count: the layer's own allocations in
  forward and backward, on top of what existed before (weights, its input).
- `saved_bytes`: what autograd keeps for backward (saved-tensor hooks), each storage once,
  parameters and views of them left out: what the estimate's activation terms count.
- attention is torch's flash kernel op (`_scaled_dot_product_flash_attention_for_cpu`), whose
  autograd keeps q, k, v, the output and the log-sum-exp like the GPU kernels spotune uses; its
  meta kernel takes k and v at the kv-head count, as those grouped-query kernels do. (`sdpa` on
  meta takes the math path and keeps the [seq x seq] scores, which no GPU run does.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from trainer.model import tiling

FLASH = "spotune_test_flash"
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=1,
    vocab_size=128256,
    rope_theta=500000.0,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _flash(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any = None, **_: Any) -> Any:
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(FLASH, _flash)


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created under the mode and still alive; `peak`: their most at once;
    `at_mark`: the live bytes right after the last op whose name contains `mark`."""

    def __init__(self, mark: str | None = None) -> None:
        super().__init__()
        self.live = self.peak = self.at_mark = 0
        self.alive: set[int] = set()
        self.mark = mark

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage: nothing new, even where that
        # storage was made before the mode (a weight's transpose, a view of the layer's input).
        given = {id(a.untyped_storage()) for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) not in self.alive and id(storage) not in given:
                    self.alive.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        if self.mark is not None and self.mark in str(func):
            self.at_mark = self.live
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes


def layer(seq: int, r: int = 32, dropout: float = 0.0, tile: int | None = None) -> LlamaDecoderLayer:
    """A Llama-3.1-8B decoder layer in bf16 on meta, LoRA r on every linear (only LoRA trains)."""
    cfg = transformers.LlamaConfig(**LLAMA_8B)
    cfg._attn_implementation = FLASH
    with torch.device("meta"):
        block = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    import peft  # here, not at collection: peft imports bitsandbytes and with it TorchInductor, ~2 s per test worker

    lora = peft.LoraConfig(r=r, target_modules=TARGETS, lora_dropout=dropout)
    block = peft.inject_adapter_in_model(lora, block)
    for name, p in block.named_parameters():
        p.requires_grad_("lora_" in name)
    for module in block.modules():  # computed in bf16 like under autocast (trainer/model/load.py)
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False
    block.to(torch.bfloat16)
    if tile is not None:  # the norms and the MLP, as model.tiled_mlp=on does (trainer/model/tiling.py)
        tiling.apply(torch.nn.ModuleList([block]), tile)
    return block


def inputs(seq: int) -> tuple[torch.Tensor, dict[str, Any]]:
    cfg = transformers.LlamaConfig(**LLAMA_8B)
    with torch.device("meta"):
        rope = LlamaRotaryEmbedding(cfg)
    x = torch.empty(1, seq, cfg.hidden_size, device="meta", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(seq, device="meta")[None]
    cos, sin = rope(x, pos)
    return x, {"position_embeddings": (cos.to(torch.bfloat16), sin.to(torch.bfloat16)), "position_ids": pos}


def run(block: torch.nn.Module, seq: int, checkpointing: bool = False) -> tuple[Callable[[], torch.Tensor], list]:
    """The layer's forward as a closure (non-reentrant checkpointing when asked), and what every
    layer shares: its parameters and the rotary tables (saved by each layer, one storage per model)."""
    x, kw = inputs(seq)

    def forward() -> torch.Tensor:
        if checkpointing:
            return torch.utils.checkpoint.checkpoint(lambda t: block(t, **kw), x, use_reentrant=False)
        return block(x, **kw)

    return forward, [*block.parameters(), *kw["position_embeddings"]]


def saved_bytes(forward: Callable[[], torch.Tensor], shared: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward during `forward`, each storage once, `shared` left out."""
    param_storages = {id(p.untyped_storage()) for p in shared}
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if id(storage) not in param_storages:
            kept[id(storage)] = t  # holding it keeps the id unique while we count
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def peak_bytes(forward: Callable[[], torch.Tensor], mark: str | None = None) -> tuple[int, int]:
    """Peak of the layer's own live bytes over forward and backward (incoming gradient included),
    and the live bytes right after the op named `mark` (see `LiveBytes`)."""
    with LiveBytes(mark) as mode:
        out = forward()
        out.backward(torch.empty_like(out))
        del out
    return mode.peak, mode.at_mark
