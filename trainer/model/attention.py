"""Attention over packed documents: the bounds every kernel gets, and spotune's varlen kernel.

The loss (trainer/loss.py) hands every attention implementation the document bounds of a
micro-batch of B packed rows, whatever B is (`model_inputs`):

- sdpa, eager and flex_attention get [B, S] with position_ids restarting at 0 per document:
  transformers builds a block-diagonal causal mask (or flex block mask) per row from them
  (`masking_utils.find_packed_sequence_indices`; it needs no attention_mask and use_cache=False);
- every other implementation gets the micro-batch as ONE row of B*S tokens with
  `cu_seq_lens_q/k` + `max_length_q/k` (transformers' `FlashAttentionKwargs`), so flash
  attention 2/3 take their varlen path. Without them transformers infers documents from
  position_ids only for a batch of one row (`_is_packed_sequence`), which is why a [B, S]
  micro-batch used to attend across documents under FlashAttention.

`spotune_varlen` is an attention function of ours registered through transformers'
`AttentionInterface`: on CUDA it calls torch's own varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`, no flash-attn package needed), elsewhere a
per-document sdpa reference. It refuses to run without the bounds rather than attend
across documents.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "spotune_varlen"
"""`model.attn_implementation` value of spotune's own varlen attention."""


MASK_BASED = frozenset({"sdpa", "eager", "flex_attention"})
"""Implementations that get the document bounds as a mask transformers builds per row from
position_ids; they run the micro-batch as [B, S] (flattening would only grow an sdpa/eager
mask B-fold and change the CPU path's summation order). Every other implementation (flash
attention, spotune_varlen, one registered by a user) runs one row of B*S tokens with
cu_seq_lens: the safe default, since that is all FlashAttention understands."""


def model_inputs(micro: dict[str, Any], implementation: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(input_ids and position_ids as the forward should get them, the varlen bounds kwargs or {})."""
    if implementation in MASK_BASED:
        return {"input_ids": micro["input_ids"], "position_ids": micro["position_ids"]}, {}
    flat = {"input_ids": micro["input_ids"].reshape(1, -1), "position_ids": micro["position_ids"].reshape(1, -1)}
    return flat, bounds_kwargs(micro)


def bounds_kwargs(micro: dict[str, Any]) -> dict[str, Any]:
    """The FlashAttentionKwargs of a micro-batch (see trainer.batches.micro_batch)."""
    cu, longest = micro["cu_seq_lens"], micro["max_length"]
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention inside each document of a packed row (transformers' attention signature).

    query: [1, Hq, T, D], key/value: [1, Hkv, T, D]; returns ([1, T, Hq, D], None).
    """
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None or longest is None or query.size(0) != 1:
        raise ValueError(
            f"attention '{VARLEN}' needs one packed row with cu_seq_lens_q and max_length_q (got batch "
            f"{query.size(0)}, cu_seq_lens_q={'set' if cu is not None else 'missing'}); call it through "
            "trainer.loss.token_loss_sum, or set model.attn_implementation=sdpa"
        )
    if sliding_window is not None and int(longest) > sliding_window:
        raise ValueError(
            f"attention '{VARLEN}': a document of {int(longest)} tokens exceeds the model's sliding window "
            f"({sliding_window}); use model.attn_implementation=sdpa or flash_attention_2"
        )
    if dropout and module.training:
        raise ValueError(f"attention '{VARLEN}' has no attention dropout; use model.attn_implementation=sdpa")
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _torch_varlen() is not None:
        out = _torch_varlen()(
            q,
            k,
            v,
            cu,
            cu,
            int(longest),
            int(longest),
            scale=scaling,
            window_size=(-1, 0),  # causal
            enable_gqa=q.size(1) != k.size(1),
        )
    else:
        out = reference_varlen(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


def reference_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Plain per-document causal sdpa over [T, H, D] tensors; the CPU path and the tests' reference.

    Reads the bounds on the host (a device sync on CUDA, where the fused kernel is used instead).
    """
    bounds = cu_seq_lens.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            dq, dk, dv = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            o = F.scaled_dot_product_attention(
                dq, dk, dv, is_causal=True, scale=scaling, enable_gqa=dq.size(0) != dk.size(0)
            )
            out[start:end] = o.transpose(0, 1)
    return out


def _torch_varlen() -> Any:
    """torch's varlen flash attention, or None where the installed torch lacks it (or its causal
    `window_size`, which older releases spelled differently)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask function of `spotune_varlen`: bounds come from cu_seq_lens, so no dense mask is built."""
    return None


def register() -> None:
    """Make `attn_implementation="spotune_varlen"` loadable (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _no_mask)


def varlen_available(device: torch.device) -> bool:
    """Whether `spotune_varlen` runs a fused kernel here (CUDA and a torch with varlen_attn)."""
    return device.type == "cuda" and _torch_varlen() is not None
