"""One decoder layer's activation memory per token: what autograd saves, and the backward's peak.

Elements per token of a llama-style block, `a` = bytes of the compute dtype, h = hidden, q / kv =
query / key-value width, i = MLP intermediate, r = LoRA rank:

Saved for backward (`layer_activation_bytes_per_token`), untiled:
* two RMSNorms: each keeps an fp32 copy of its input, its fp32 inverse RMS and its normalised
  output: 2*(4h + 4 + a*h) bytes;
* attention (flash/memory-efficient kernels, no seq x seq matrix): rotated q, k, v, the
  kernel output, and (`attention_output_copy`: kernels that return [heads, tokens] order, sdpa
  and the varlen path) its contiguous copy fed to o_proj: a*(2*q + 2*kv) [+ a*q], plus the fp32
  log-sum-exp per head; eager attention also keeps scores and probabilities, 2*a*heads*seq;
* gated MLP: gate, silu(gate), up and their product: 4*a*i;
* LoRA, per adapted linear: the A output (a*r); with dropout > 0 also the dropped copy of
  the input and its mask: in*(a + 1). (peft applies dropout separately per adapter, which
  is why dropout costs so much memory.)
gpt2 blocks use the same terms with a plain MLP (c_fc output, GELU output: 2*a*i + GELU's
internal input) and LayerNorms.

With `model.tiled_mlp` (trainer/model/tiling.py) the norms and the MLP keep only their inputs:
the input norm its input (the layer's input, a*h) and its output (what the q/k/v adapters read,
a*h); the post-attention norm and the MLP, one tiled unit, the residual sum they read (a*h). So
the norms cost 3*a*h instead of 2*(4h + 4 + a*h), and the MLP nothing (its activations and its
adapters' exist for one tile at a time). With checkpointing the layer's input is the one the
checkpoint keeps: the recomputed layer adds the rest.

The backward's peak (`layer_backward_bytes`), beyond the layer's saved tensors, at the largest of
its phases:
* untiled, the MLP's: the gradients of its gate and up outputs and of the layer's input and
  output, a*(2i + 2h); or, after it, the post-attention RMSNorm's: the layer's two gradients and
  `NORM_BACKWARD_FP32` fp32 [tokens x hidden] temporaries, less the MLP's freed activations;
* tiled, o_proj's: the layer's incoming gradient and the one after the mid residual add (2*a*h),
  and o_proj's input gradient as peft computes it, the LoRA path's, the base linear's and their
  sum (3*a*q); or the attention kernel's: the two gradients, o_proj's input gradient (a*q), the
  gradients of q, k and v, a*(q + 2kv), and the kernel's own workspace on CUDA: FlashAttention-2's
  backward (PyTorch's port, flash_api.cpp `mha_varlen_bwd`, the kernel torch's varlen_attn and
  sdpa run) accumulates dq in fp32 (4q) with an fp32 softmax sum per head, and for grouped-query
  attention writes dk and dv at the full head count before summing them (2*a*q). That workspace
  is read from the kernel's source, not measured: the meta device runs no CUDA kernel;
* tiled, one tile of the MLP and its norm: their recomputed activations, the gate and up
  gradients and the norm's fp32 temporaries, per tile; beside the layer's two gradients.
tests/test_tiling_memory.py measures a real-shaped Llama-3.1-8B layer on the meta device against
these (saved bytes exact, the peak's slope within 2%).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.model.flops import ModelShape, adapted_linears

# trainer/model/tiling.py's DEFAULT_TILE_TOKENS (`model.tiled_mlp_tokens`' default).
MLP_TILE_TOKENS = 8192
# The block linears inside the MLP (what `model.tiled_mlp` computes in tiles), by ModelShape.linears name.
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj", "c_fc", "mlp.c_proj")
# fp32 [tokens x hidden] temporaries an RMSNorm's backward holds at its peak (HF's LlamaRMSNorm
# through autograd): the live-bytes trace of a Llama-3.1-8B layer on meta, tests/test_tiling_memory.py.
NORM_BACKWARD_FP32 = 4


def layer_activation_bytes_per_token(
    shape: ModelShape,
    a: int,
    r: int,
    targets: Sequence[str],
    lora_dropout: bool,
    eager_attention_seq: int = 0,
    tiled_mlp: bool = False,
    attention_output_copy: bool = True,
) -> float:
    """Bytes autograd keeps per token for one block (see the module docstring).

    `eager_attention_seq`: with eager attention, the sequence length whose scores and
    softmax probabilities (heads x seq per token, each) are kept as well. `tiled_mlp`: the norms
    and the MLP keep only their inputs (trainer/model/tiling.py)."""
    h = shape.hidden
    norms = 3 * a * h if tiled_mlp and shape.arch == "llama" else 2 * (4 * h + 4 + a * h)
    lora = sum(
        _lora_bytes(a, r, fan_in, lora_dropout)
        for name, fan_in, _ in adapted_linears(shape, targets)
        if not _in_mlp(name)
    )
    mlp = 0.0 if tiled_mlp else mlp_activation_bytes_per_token(shape, a, r, targets, lora_dropout)
    return norms + attention_bytes_per_token(shape, a, eager_attention_seq, attention_output_copy) + lora + mlp


def attention_bytes_per_token(shape: ModelShape, a: int, eager_attention_seq: int, output_copy: bool) -> float:
    """q, k, v (rotated), the kernel's output [and its contiguous copy], the fp32 log-sum-exp."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    copy = a * q if output_copy else 0
    return float(a * (2 * q + 2 * kv) + copy + 4 * shape.heads + 2 * a * shape.heads * eager_attention_seq)


def mlp_activation_bytes_per_token(
    shape: ModelShape, a: int, r: int, targets: Sequence[str], lora_dropout: bool
) -> float:
    """What the MLP and its adapted linears keep per token: gate, silu(gate), up and their product
    (gpt2: c_fc's output, GELU's input and output) and the LoRA terms of its linears."""
    lora = sum(
        _lora_bytes(a, r, fan_in, lora_dropout) for name, fan_in, _ in adapted_linears(shape, targets) if _in_mlp(name)
    )
    return (4 if shape.arch == "llama" else 3) * a * shape.intermediate + lora


def _in_mlp(name: str) -> bool:
    return name in MLP_LINEARS


def _lora_bytes(a: int, r: int, fan_in: int, lora_dropout: bool) -> float:
    """Per token, per adapted linear: the A output (a*r); with dropout its input's dropped copy and mask."""
    return a * r + (fan_in * (a + 1) if lora_dropout else 0)


def backward_workspace_bytes(
    shape: ModelShape, a: int, tokens: int, mlp_tile: tuple[int, float] | None = None
) -> float:
    """The MLP's backward phase: the gradients of its gate and up outputs and of the layer's input
    and output (a*(2i + 2h) per token). `mlp_tile` (tile tokens, MLP activation bytes per token):
    the MLP (with its norm) in tiles, whose gate and up gradients, recomputed activations and norm
    temporaries exist for one tile at a time."""
    temporaries = float(a * 2 * shape.hidden * tokens)
    if mlp_tile is None:
        return temporaries + a * 2 * shape.intermediate * tokens
    tile, mlp_per_token = mlp_tile
    norm = NORM_BACKWARD_FP32 * 4 * shape.hidden
    return temporaries + (a * 2 * shape.intermediate + mlp_per_token + norm) * min(tile, tokens)


def norm_backward_bytes(shape: ModelShape, a: int, tokens: int) -> float:
    """The untiled post-attention RMSNorm's backward phase: the gradients of the layer's input and
    output (a*2h per token) and the norm's own temporaries, `NORM_BACKWARD_FP32` fp32 [tokens x
    hidden] tensors at once (autograd's pow / mean / mul chain in fp32). gpt2's LayerNorm backward
    is one kernel with no such temporaries."""
    fp32 = NORM_BACKWARD_FP32 * 4 * shape.hidden if shape.arch == "llama" else 0
    return float((a * 2 * shape.hidden + fp32) * tokens)


def o_proj_backward_bytes_per_token(shape: ModelShape, a: int, targets: Sequence[str]) -> float:
    """The layer's two gradients and o_proj's input gradient: with LoRA on o_proj, the LoRA
    path's, the base linear's and their sum (peft adds them), else the base linear's only."""
    q = shape.heads * shape.head_dim
    adapted = any(name in ("o_proj", "attn.c_proj") for name, _, _ in adapted_linears(shape, targets))
    return float(2 * a * shape.hidden + (3 if adapted else 1) * a * q)


def attention_backward_bytes_per_token(shape: ModelShape, a: int, kernel_workspace: bool = True) -> float:
    """The layer's two gradients, o_proj's input gradient (the kernel's dout), dq, dk and dv, and
    (`kernel_workspace`) FlashAttention-2's backward workspace on CUDA (see the module docstring)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    grads = 2 * a * shape.hidden + a * q + a * (q + 2 * kv)
    if not kernel_workspace:
        return float(grads)
    expanded = 2 * a * q if kv < q else 0
    return float(grads + 4 * q + 4 * shape.heads + expanded)


def layer_backward_bytes(
    shape: ModelShape,
    a: int,
    tokens: int,
    targets: Sequence[str],
    mlp_per_token: float,
    tile: int | None,
    kernel_workspace: bool = True,
) -> float:
    """One layer's backward temporaries at their largest, beyond its saved tensors (module docstring).

    Untiled: while the MLP runs its backward, or after it, while the post-attention norm runs its
    own (the MLP's saved tensors are gone by then). Tiled (`tile` tokens): the MLP and the norms are
    bounded by a tile, so o_proj's backward or the attention kernel's is the layer's peak."""
    if tile is None:
        mlp_phase = backward_workspace_bytes(shape, a, tokens)
        return max(mlp_phase, norm_backward_bytes(shape, a, tokens) - mlp_per_token * tokens)
    mlp_phase = backward_workspace_bytes(shape, a, tokens, (tile, mlp_per_token))
    o_proj = o_proj_backward_bytes_per_token(shape, a, targets) * tokens
    attention = attention_backward_bytes_per_token(shape, a, kernel_workspace) * tokens
    return max(mlp_phase, o_proj, attention)
