"""What is inside the wrappers a model gets in training: DDP / accelerate (`.module`),
torch.compile (`._orig_mod`) and peft's PeftModel. The one place that peels them."""

from __future__ import annotations

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
