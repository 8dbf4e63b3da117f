"""Attention over packed documents: the bounds every kernel gets, and spotune's varlen kernel.

The loss (trainer/model/loss.py) hands every attention implementation the document bounds of a
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
(`torch.nn.attention.varlen.varlen_attn`, no flash-attn package needed; a float32 query is cast
to bf16 for it, said once: `varlen_choice`), elsewhere a per-document sdpa reference. It refuses to run without the bounds rather than attend
across documents.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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
    """The FlashAttentionKwargs of a micro-batch (see trainer.training.batches.micro_batch)."""
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
            "trainer.model.loss.token_loss_sum, or set model.attn_implementation=sdpa"
        )
    if sliding_window is not None and int(longest) > sliding_window:
        raise ValueError(
            f"attention '{VARLEN}': a document of {int(longest)} tokens exceeds the model's sliding window "
            f"({sliding_window}); use model.attn_implementation=sdpa or flash_attention_2"
        )
    if dropout and module.training:
        raise ValueError(f"attention '{VARLEN}' has no attention dropout; use model.attn_implementation=sdpa")
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    kernel = torch_varlen()
    path, cast = varlen_choice(q.device.type, q.dtype, kernel is not None)
    if path == "kernel":
        assert kernel is not None
        if cast is not None:
            _say_once(
                f"spotune_varlen: {q.dtype} attention on CUDA runs the flash kernel in {cast}, the output cast back"
            )
            out = kernel(q.to(cast), k.to(cast), v.to(cast), cu, int(longest), scaling).to(q.dtype)
        else:
            out = kernel(q, k, v, cu, int(longest), scaling)
    else:
        if q.is_cuda:
            _say_once(f"spotune_varlen: {q.dtype} attention on CUDA runs the per-document reference: {path}")
        out = reference_varlen(q, k, v, cu, scaling)
    return out.unsqueeze(0), None


FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""What torch's varlen flash kernel computes in."""


def varlen_choice(device_type: str, dtype: torch.dtype, kernel: bool) -> tuple[str, torch.dtype | None]:
    """Which path `spotune_varlen` takes: ("kernel", None) runs the flash kernel as is; ("kernel",
    a half dtype) casts to it first (a float32 query on CUDA: the per-document Python loop would
    cost a device sync and one launch per document, far more than the rounding of the inputs to
    bf16 that autocast would apply anyway); anything else is the reason for the reference path."""
    if device_type != "cuda":
        return "reference", None
    if not kernel:
        return f"reference ({varlen_unavailable_reason()})", None
    if dtype in FLASH_DTYPES:
        return "kernel", None
    if dtype == torch.float32:
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return "kernel", torch.bfloat16 if bf16 else torch.float16
    return f"reference (no flash kernel for {dtype})", None


@functools.cache
def _say_once(note: str) -> None:
    print(note, file=sys.stderr, flush=True)


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


@dataclass(frozen=True)
class VarlenKernel:
    """torch's `varlen_attn` called the way the installed release spells it.

    Its keywords moved between releases (read from each release's torch/nn/attention/varlen.py):
    2.10 takes `is_causal` and no scale; 2.11 adds `scale` and `window_size` (causal is
    (-1, 0)) and drops `is_causal`; 2.12-2.14 add `enable_gqa`, without which they refuse
    fewer KV heads than query heads. So each keyword is passed only where the signature has it:
    without `enable_gqa` the KV heads are repeated (exact, more memory), and without `scale` a
    model's non-default scaling is folded into the query (softmax(c*q.k/sqrt(D)) with
    c = scaling*sqrt(D)). tests/test_attention.py runs this against stand-ins with each
    release's exact signature, so the next change of it is caught on CPU, not on a paid GPU.
    """

    fn: Callable[..., Any]
    causal: Literal["window_size", "is_causal"]
    takes_scale: bool
    native_gqa: bool

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> VarlenKernel | str:
        """The adapter for `fn`, or why it cannot serve (a sentence)."""
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return "its signature cannot be read"
        if "window_size" in params:
            causal: Literal["window_size", "is_causal"] = "window_size"
        elif "is_causal" in params:
            causal = "is_causal"
        else:
            return "it takes neither window_size nor is_causal, so it cannot be made causal"
        return cls(fn, causal, "scale" in params, "enable_gqa" in params)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scaling: float | None
    ) -> torch.Tensor:
        """Causal attention per document of [T, H, D] tensors (fewer KV heads allowed)."""
        kwargs: dict[str, Any] = {"window_size": (-1, 0)} if self.causal == "window_size" else {"is_causal": True}
        default = q.size(-1) ** -0.5
        if self.takes_scale:
            kwargs["scale"] = scaling
        elif scaling is not None and not math.isclose(scaling, default, rel_tol=1e-6):
            q = q * (scaling / default)
        gqa = q.size(1) != k.size(1)
        if gqa and self.native_gqa:
            kwargs["enable_gqa"] = True
        elif gqa:
            groups = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return self.fn(q, k, v, cu, cu, longest, longest, **kwargs)


@functools.lru_cache(maxsize=1)
def _installed_varlen() -> VarlenKernel | str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return VarlenKernel.of(varlen_attn)


def torch_varlen() -> VarlenKernel | None:
    """torch's varlen flash attention as spotune calls it, or None where the installed torch
    lacks a usable one (`varlen_unavailable_reason` says why)."""
    kernel = _installed_varlen()
    return kernel if isinstance(kernel, VarlenKernel) else None


def varlen_unavailable_reason() -> str | None:
    kernel = _installed_varlen()
    return None if isinstance(kernel, VarlenKernel) else f"torch's varlen_attn cannot serve: {kernel}"


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
    """Whether `spotune_varlen` runs a fused kernel here (CUDA and a torch with a usable varlen_attn)."""
    return device.type == "cuda" and torch_varlen() is not None
