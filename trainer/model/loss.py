"""Loss of a micro-batch: decoder body -> hidden states of labelled positions -> fused head + CE.

Convention (what must stay true):
- labels are aligned with input_ids; the hidden state at p predicts labels[p+1]; IGNORE_INDEX
  (-100) is never predicted. trainer.training.batches.micro_batch builds, on the host, the flat index
  of those positions over the whole micro-batch (`label_index`) and their labels.
- the result is a *sum* over the micro-batch's trainable tokens; the loop divides by the
  step's trainable tokens over every micro-batch and rank.
- the model gets the document bounds in the form its attention implementation reads
  (trainer/model/attention.py), so none attends across documents whatever the micro-batch size.

The head and the loss are ours, not the model's: only labelled positions reach the vocabulary
projection, and the chunked fused head below (per-token log-probabilities: SFT sums them, the
preference objectives sum them per sequence) never holds [tokens x vocab] logits at once. That
replaces `logits_to_keep` as a 2-D tensor, which only recent transformers releases handle (5.17's
Llama indexed hidden[:, keep] into [B, B, K, H]).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from trainer.data.template import IGNORE_INDEX
from trainer.model.attention import model_inputs
from trainer.model.wrappers import causal_lm

CHUNK_ELEMENTS = 1 << 25
"""Logits computed at once by the pure-torch fused loss: 32M fp32 values (128 MB, plus as much
for their gradient): 261 tokens of Llama 3's 128k vocabulary, enough to keep the matmul large."""

HEAD_TILE_TOKENS = 1 << 15
"""Most head positions per call of Liger's fused loss. Liger sizes its logits chunk from the tokens
it is given (tokens / ceil(vocab / hidden): 1/32 of them for Llama 3), so one call over a 512k-token
row would hold 16k x 128k logits; called per tile of 32k tokens its chunk is at most 1,024 tokens
(about 1.2 GiB with the softmax and gradient) whatever the sequence, which is why a constant tile
bounds the working set and need not follow free memory: what still grows with the sequence is the
hidden states' gradient (tokens x hidden), which the backward needs anyway. The pure-torch path's
chunk (`CHUNK_ELEMENTS`) is constant already."""

# Config attributes that change the logits after the head matmul; the fused head does not apply
# them, so such models are refused instead of trained on a different function.
_HEAD_QUIRKS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def token_loss_sum(model: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32) over the micro-batch's trainable tokens."""
    hidden, head = labelled_hidden(model, micro)
    return linear_cross_entropy(hidden, head.weight, micro["label_targets"], getattr(head, "bias", None))


def labelled_hidden(model: torch.nn.Module, micro: dict[str, Any]) -> tuple[torch.Tensor, torch.nn.Linear]:
    """The decoder's final hidden states at the positions that predict a label ([T, H], `label_index`
    order), and the output head that turns them into logits.

    The call goes through the top-level module (DDP, accelerate's autocast wrapper, PeftModel)
    so that DDP's reducer and mixed precision see the forward (calling the decoder body directly
    would skip both: no gradient all-reduce, no autocast). Hooks on the decoder body hand it the
    document bounds and take its final hidden states; `logits_to_keep=1` leaves the model's own
    head one position of work.
    """
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    check_head(lm, head)
    inputs, bounds = model_inputs(micro, lm.config._attn_implementation)
    captured: list[torch.Tensor] = []

    def add_bounds(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        # Given to the decoder body itself: some causal-LM wrappers (GPT-2 in transformers 5.0)
        # do not pass extra kwargs on to it, and the bounds must never be dropped silently.
        return args, {**kwargs, **bounds}

    def keep_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    extra: dict[str, Any] = {"logits_to_keep": 1} if _takes_logits_to_keep(lm) else {}
    decoder = lm.get_decoder()
    hooks = [
        decoder.register_forward_pre_hook(add_bounds, with_kwargs=True),
        decoder.register_forward_hook(keep_hidden),
    ]
    try:
        model(**inputs, use_cache=False, **extra)
    finally:
        for hook in hooks:
            hook.remove()
    # [B, S, H] or [1, B*S, H]: the same flat order, which label_index indexes.
    hidden = captured[-1].reshape(micro["input_ids"].numel(), -1).index_select(0, micro["label_index"])
    return hidden, head


def check_head(lm: Any, head: Any) -> None:
    """Refuse heads the fused loss would compute differently from the model."""
    if not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        raise ValueError(
            f"the output head ({type(head).__name__}) is not a plain torch.nn.Linear: spotune's fused head "
            "and loss would skip what it adds. Remove lm_head from adapter.target_modules (LoRA on the head), "
            "or keep the head unquantised"
        )
    for name in _HEAD_QUIRKS:
        if getattr(lm.config, name, None) not in (None, 0, 1, 1.0):
            raise ValueError(
                f"model config sets {name}={getattr(lm.config, name)!r}, which changes the logits after the "
                f"head; spotune's fused head and loss do not apply it, so {lm.config.model_type!r} is not supported"
            )


def _takes_logits_to_keep(lm: Any) -> bool:
    return "logits_to_keep" in inspect.signature(lm.forward).parameters


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_t CE(hidden[t] @ weight.T + bias, targets[t]) in fp32, without [T x V] logits at once.

    Liger Kernel's Triton kernel on CUDA when installed (the `gpu` extra), else minus the sum of
    `token_logprobs`. Matmuls run in the weight's dtype, the softmax in fp32, as the plain
    `F.cross_entropy(lm_head(h).float(), y)` does.
    """
    hidden = hidden.to(weight.dtype)
    if hidden.is_cuda and _liger() is not None and hidden.size(0) > 0:
        loss_fn = _liger()(ignore_index=IGNORE_INDEX, reduction="sum")
        tiles = range(0, hidden.size(0), HEAD_TILE_TOKENS)
        return sum(
            (
                loss_fn(weight, hidden[s : s + HEAD_TILE_TOKENS], targets[s : s + HEAD_TILE_TOKENS], bias).float()
                for s in tiles
            ),
            torch.zeros((), dtype=torch.float32, device=hidden.device),
        )
    return token_logprobs(hidden, weight, targets, bias).neg().sum()


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(targets[t]) per token (fp32, [T]) of `hidden @ weight.T + bias`, without [T x V] logits at once:
    SFT's loss is minus their sum, the preference objectives sum them per sequence (trainer/model/preference.py)."""
    hidden = hidden.to(weight.dtype)
    chunk = max(1, CHUNK_ELEMENTS // weight.size(0))
    return ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, chunk, torch.is_grad_enabled())


class ChunkedTokenLogprobs(torch.autograd.Function):
    """Fused head + per-token log-probabilities, chunked over tokens (pure torch, any device).

    Forward computes each chunk's logits, its tokens' log-probabilities and, when a gradient is
    needed, d logp / d hidden = (onehot - softmax) @ weight per token, then drops the logits.
    Backward only scales each token's row by its incoming gradient, so logits are computed once and
    never stored: memory is O(chunk x V) instead of O(T x V). A trainable head (never a LoRA run's:
    `check_head` refuses an adapted one, the base's is frozen) gets its gradients in backward, chunk by
    chunk from recomputed logits, where each token's incoming gradient is known.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        grad_enabled: bool,
    ) -> torch.Tensor:
        # needs_input_grad alone would still ask for a trainable head's gradient under no_grad (eval).
        need_h = grad_enabled and ctx.needs_input_grad[0]
        ctx.head = (
            grad_enabled and ctx.needs_input_grad[1],
            grad_enabled and bias is not None and ctx.needs_input_grad[2],
        )
        out = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        for start in range(0, hidden.size(0), chunk):
            h, y = hidden[start : start + chunk], targets[start : start + chunk]
            logits = F.linear(h, weight, bias).float()
            out[start : start + chunk] = torch.log_softmax(logits, dim=-1).gather(1, y[:, None]).squeeze(1)
            if grad_h is not None:
                # fp32, cast to the matmul dtype like autograd does for the plain computation.
                grad_h[start : start + chunk] = _dlogp_dlogits(logits, y).to(weight.dtype) @ weight
        ctx.chunk = chunk
        ctx.save_for_backward(grad_h, *((hidden, weight, bias, targets) if any(ctx.head) else ()))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        grad_h, *inputs = ctx.saved_tensors
        scale = grad_out.float()
        out_h = None if grad_h is None else (grad_h.float() * scale[:, None]).to(grad_h.dtype)
        out_w = out_b = None
        if inputs:
            hidden, weight, bias, targets = inputs
            need_w, need_b = ctx.head
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
            for start in range(0, hidden.size(0), ctx.chunk):
                h, y = hidden[start : start + ctx.chunk], targets[start : start + ctx.chunk]
                grad = _dlogp_dlogits(F.linear(h, weight, bias).float(), y) * scale[start : start + ctx.chunk, None]
                if grad_w is not None:
                    grad_w += grad.t() @ h.float()
                if grad_b is not None:
                    grad_b += grad.sum(0)
            out_w = None if grad_w is None else grad_w.to(weight.dtype)
            out_b = None if grad_b is None else grad_b.to(bias.dtype)
        return out_h, out_w, out_b, None, None, None


def _dlogp_dlogits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """d log p(target) / d logits = onehot - softmax, per row (fp32; the logits are read, not changed)."""
    grad = torch.softmax(logits, dim=-1).neg_()
    grad[torch.arange(len(targets), device=targets.device), targets] += 1.0
    return grad


def _liger() -> Any:
    """Liger Kernel's fused linear cross-entropy module class, or None when not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def plain_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The unfused reference: every logit at once (tests and the benchmark compare against it)."""
    logits = F.linear(hidden.to(weight.dtype), weight, bias).float()
    return F.cross_entropy(logits, targets, reduction="sum")
