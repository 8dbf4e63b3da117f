"""What is inside the wrappers a model gets in training: DDP / accelerate (`.module`),
torch.compile (`._orig_mod`) and peft's PeftModel. The one place that peels them, and that says
which part of a checkpoint is the language model's decoder (what LoRA adapts)."""

from __future__ import annotations

import re
from typing import Any

import torch


def unwrap_parallel(model: torch.nn.Module) -> Any:
    """The model inside DDP / accelerate wrappers."""
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def unwrap_peft(model: torch.nn.Module) -> Any:
    """The peft model inside DDP / accelerate wrappers."""
    inner = unwrap_parallel(model)
    if not hasattr(inner, "peft_config"):
        raise TypeError(f"expected a peft model, got {type(inner).__name__}")
    return inner


def causal_lm(model: torch.nn.Module) -> Any:
    """The transformers causal LM inside DDP/compile wrappers and a PeftModel."""
    inner = unwrap_parallel(model)
    inner = getattr(inner, "_orig_mod", inner)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def outside_the_decoder(base: torch.nn.Module) -> str | None:
    """A regex (peft's `exclude_modules`) for every module outside the language model's decoder, or
    None where the decoder is the only stack. Image-text checkpoints (Gemma 3 4B/12B load as
    Gemma3ForConditionalGeneration) also have a vision tower whose attention is named q_proj, k_proj,
    v_proj: adapted there, its LoRA weights would never see a gradient in text training, ride along
    in the adapter, and stop DDP at its first step (a parameter that took part in no backward)."""
    get = getattr(base, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is base:
        return None
    names = {id(m): n for n, m in base.named_modules()}
    name = names.get(id(decoder))
    if not name:
        return None
    # Every module that is not the decoder or below it, but the head: a recipe may name lm_head
    # (and is refused with the reason, trainer/model/loss.py), which must not vanish silently here.
    head = getattr(base, "get_output_embeddings", lambda: None)()
    head_name = names.get(id(head)) if head is not None else None
    outside = [
        n
        for n, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and n != head_name and not (n == name or n.startswith(f"{name}."))
    ]
    if not outside:  # a plain causal LM: nothing to exclude (peft warns about an exclusion that matches nothing)
        return None
    keep = rf"(?!{re.escape(head_name)}$)" if head_name else ""
    return rf"(?!{re.escape(name)}(?:\.|$)){keep}.*"
