"""LoRA's A matmuls of sibling projections as one wider matmul (`adapter.fused`).

q_proj, k_proj and v_proj read the same activation, and so do gate_proj and up_proj. peft runs
each adapter's A ([r x hidden]) as its own thin matmul: three and two per layer, each too narrow
(r = 16 columns) to keep a GPU busy. Fused, the first sibling computes x @ [A_q; A_k; A_v]^T once
([T x 3r]) and hands the others their slices; autograd splits the gradient back through the
concatenation, so each A keeps its own gradient and optimizer state.

This is a runtime view, not a format: every A keeps its own Parameter, registered under the
same name as before (`...q_proj.lora_A.default.weight`), so checkpoints, the final adapter and
`spotune export` stay plain peft files. What must stay true for a slice to be handed on: the
sibling is called with the very tensor the first one saw (`is`), which holds when LoRA dropout
is off (peft's dropout is then the identity) and the input is not cast per layer. Otherwise the
sibling computes its own A, which is the plain computation, so the maths never depends on the
fusion taking effect; `hits` counts the slices handed on.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections that read one input, in the order the decoder layer calls them
(llama / qwen2 / mistral; GPT-2's c_attn is already one matmul)."""


class _Group:
    """The A modules of one set of siblings, and the last fused product awaiting its readers."""

    def __init__(self) -> None:
        self.members: list[FusedA] = []
        self.x: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.hits = 0


class FusedA(torch.nn.Module):
    """Stands where peft's `lora_A[adapter]` nn.Linear stood, with the same `weight` Parameter."""

    group: _Group

    def __init__(self, linear: torch.nn.Linear, group: _Group) -> None:
        super().__init__()
        self.weight = linear.weight  # the same Parameter: same name in the state dict, same optimizer slot
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.index = len(group.members)
        group.members.append(self)
        object.__setattr__(self, "group", group)  # a plain reference, not a submodule (no cycle in modules())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if self.index == 0:
            weights = [m.weight for m in group.members]  # read per call: FSDP swaps the Parameters
            parts = F.linear(x, torch.cat(weights)).split([w.size(0) for w in weights], dim=-1)
            group.x, group.parts = x, parts[1:]
            return parts[0]
        if group.x is x and len(group.parts) >= self.index:
            out = group.parts[self.index - 1]
            group.hits += 1
            if self.index == len(group.members) - 1:
                group.x, group.parts = None, ()  # the last reader frees the product
            return out
        return F.linear(x, self.weight)  # not the first sibling's input: the plain computation

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused #{self.index}"


def fuse(model: torch.nn.Module) -> list[_Group]:
    """Replace the LoRA A modules of every sibling group in `model` (a PeftModel) by FusedA views;
    returns the groups (two per llama-style layer when every projection is adapted)."""
    parents: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if hasattr(module, "lora_A") and any(leaf in g for g in GROUPS):
            parents.setdefault(parent, {})[leaf] = module
    groups = []
    for siblings in parents.values():
        for names in GROUPS:
            layers = [siblings[n] for n in names if n in siblings]
            for adapter in layers[0].lora_A.keys() if len(layers) > 1 else ():
                if not all(adapter in layer.lora_A and _plain_linear(layer.lora_A[adapter]) for layer in layers):
                    continue
                group = _Group()
                for layer in layers:
                    layer.lora_A[adapter] = FusedA(layer.lora_A[adapter], group)
                groups.append(group)
    return groups


def _plain_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear and module.bias is None
