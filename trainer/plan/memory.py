"""Peak device memory of one LoRA/QLoRA training step, per GPU, from the model's shape.

What is resident at the step's peak, each term named (`MemoryEstimate`):
  allocated = weights (storage dtype; NF4: 4-bit blocks + 8-bit absmax per 64 + fp32 scale per
              256 absmax blocks) + adapter + its gradients + optimizer states
            + activations saved for backward + the head/loss working set + backward temporaries
  reserved  = allocated + fragmentation (the caching allocator's headroom)
  total     = reserved + overhead (CUDA context, cuBLAS workspace: outside the allocator)
  offloaded = host memory activation offloading uses instead (not in total).
`allocated` is what torch.cuda.max_memory_allocated reads, `reserved` max_memory_reserved.

Per-layer saved activations and the backward's temporaries, per token, counted from what
autograd keeps (trainer/plan/activations.py: norms, attention, MLP, LoRA; tiled or not).

With gradient checkpointing each layer keeps only its input (a*h per token) and one layer
is recomputed at a time, so one layer's full activations join the backward temporaries.
With activation offloading (trainer/model/offload.py) all but two layers' saved tensors (the one in
use, the one being fetched) sit in pinned host memory instead.

Head and loss: spotune's fused head (trainer/model/loss.py) holds one chunk of logits at a time (a*V,
fp32 softmax and gradient, per token of the chunk) and the hidden states' gradient; a model's
own loss (`fused_head=False`) holds every logit and its gradient, often the largest term. Only
labelled positions reach the head (`head_tokens`); the default assumes every position does,
which keeps the estimate on the safe side for prompt-masked data.

Preference objectives: a DPO step first runs the reference's forward under no_grad, which frees each
layer's output as the next one runs, so it adds nothing at the step's peak; started from an adapter
(adapter.init_from) it keeps that adapter frozen beside the trained one (`with_reference_adapter`: twice
`adapter`). The per-sequence log-probabilities are a few floats per pair.

Not counted: the rotary cos/sin tables (2*a*head_dim per token, shared by every layer).
tests/test_tiling_memory.py checks the activation terms against what autograd saves for a
real-shaped Llama-3.1-8B layer on the meta device (exact, with a flash kernel's layout), with and
without checkpointing and tiling, and the layer's backward peak against its live bytes.

Backward temporaries: one layer's at their largest (activations.layer_backward_bytes) plus
(NF4/int8) the largest weight dequantised. The head's working set is gone when a layer's backward
runs, so the term is what the layer needs beyond it: the peak is the larger.

Calibration, each against a measurement kept with the code:
* the one GPU measurement so far (docs/gpu.md, "Measured so far": one H100, Llama-3.1-8B shape, seq 4096, LoRA r16 all linear, one
  row, spotune_varlen, liger; tests/test_plan_memory_terms.py): LoRA bf16 without
  checkpointing 39.6 GiB estimated against 38.6 allocated (1.03x); QLoRA NF4 checkpointed
  8.19 against 7.96 (1.03x). No term was fitted to these: both follow from the formulas.
* CPU fp32 peaks (tests/test_plan_memory.py: profiler allocation trace of a full optimizer
  step, 4-layer hidden-512 llama/qwen2, and the tiny recipe through spotune's own step).
* Not calibrated yet: `FRAGMENTATION` (no reserved figure measured) and the CUDA context
  (`CUDA_OVERHEAD_BYTES`); benchmarks/gpu_memory.py prints reserved beside allocated.

Under FSDP on N devices (`shards=N`) every parameter, gradient and optimizer state is held as
1/N of the whole; what a device holds unsharded at the peak is the root module's parameters
(embeddings, final norm, output head: gathered for the forward and kept for backward) and up
to two decoder layers at a time (the one computing and the one prefetched). With the frozen
base offloaded to CPU (`offload=True`) the shards live in host memory and only the gathered
working set is on the device. Activations are per device either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from trainer.model.flops import ModelShape
from trainer.plan import activations as act
from trainer.plan.activations import MLP_TILE_TOKENS

GIB = 1024**3
WeightFormat = Literal["float32", "bfloat16", "float16", "int8", "nf4"]
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NF4 with double quantisation: 4 bits per weight, an 8-bit absmax per 64 weights, and an
# fp32 scale per 256 absmax blocks (bitsandbytes defaults): 0.5 + 1/64 + 4/(64*256) bytes.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# LLM.int8: one byte per weight plus an fp32 scale per output row (added per linear below).
INT8_BYTES = 1.0
# trainer/model/loss.py's CHUNK_ELEMENTS (logits per chunk of the pure-torch fused loss); a test keeps them equal.
CHUNK_ELEMENTS = 1 << 25
# trainer/model/loss.py's HEAD_TILE_TOKENS (most head positions per fused-loss call); a test keeps them equal.
HEAD_TILE_TOKENS = 1 << 15
# CUDA context and cuBLAS workspace, outside the caching allocator (not in max_memory_reserved).
CUDA_OVERHEAD_BYTES = 1.0 * GIB
# The caching allocator's headroom over what is allocated, as a share of the per-step memory
# (activations, head, backward temporaries). ASSUMED, not yet calibrated: the one GPU measurement
# (docs/gpu.md) gives max_memory_allocated only; benchmarks/gpu_memory.py prints reserved beside allocated.
FRAGMENTATION = 0.05


ALLOCATED_TERMS = ("weights", "adapter", "gradients", "optimizer", "activations", "logits", "backward_workspace")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by component: what is resident at the step's peak, each term named."""

    weights: float
    """Frozen base in its storage dtype (NF4: packed blocks + absmax + nested scales)."""
    adapter: float
    """LoRA weights (fp32)."""
    gradients: float
    """LoRA gradients (fp32)."""
    optimizer: float
    """Optimizer states of the LoRA weights."""
    activations: float
    """Saved for backward: every layer's (or, checkpointed, every layer's input; offloaded, the
    layers in flight), plus the embedding output and the final norm's."""
    logits: float
    """The head and loss working set: one chunk of logits and its gradient (fused head), or every
    logit and its gradient (unfused), plus the hidden states' gradient the head hands back."""
    backward_workspace: float
    """Temporaries of one layer's backward (with checkpointing, that layer recomputed), and a
    dequantised weight for NF4/int8 linears, beyond the head's working set (freed by then)."""
    fragmentation: float
    """The caching allocator's headroom: reserved minus allocated at the peak."""
    overhead: float
    """CUDA context and cuBLAS workspace: outside the allocator, still on the device."""
    offloaded: float = 0.0
    """Host (pinned) memory that activation offloading uses instead of the device; not in `total`."""

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated should read at the peak."""
        return float(sum(getattr(self, name) for name in ALLOCATED_TERMS))

    @property
    def reserved(self) -> float:
        """What torch.cuda.max_memory_reserved should read at the peak."""
        return self.allocated + self.fragmentation

    @property
    def total(self) -> float:
        """Device memory the run needs: reserved plus the CUDA context."""
        return self.reserved + self.overhead

    def as_gib(self) -> dict[str, float]:
        out = {k: v / GIB for k, v in asdict(self).items()}
        out["allocated"], out["reserved"], out["total"] = self.allocated / GIB, self.reserved / GIB, self.total / GIB
        return out


def weight_bytes(shape: ModelShape, fmt: WeightFormat, compute_dtype: str = "bfloat16") -> float:
    """Base weights: quantised formats apply to the block linears only (bitsandbytes keeps
    embeddings, norms and the output head in the compute dtype)."""
    total = shape.total_params()
    if fmt in _DTYPE_BYTES:
        return float(total * _DTYPE_BYTES[fmt])
    linear = shape.layers * shape.block_matmul_params()
    if fmt == "nf4":  # every routed expert too, the ones a token skips included (trainer/model/experts_nf4.py)
        linear += shape.layers * idle_expert_params(shape)
        return (total - linear) * _DTYPE_BYTES[compute_dtype] + linear * NF4_BYTES
    rest = (total - linear) * _DTYPE_BYTES[compute_dtype]
    row_scales = shape.layers * sum(o for _, _, o in shape.linears()) * 4
    return rest + linear * INT8_BYTES + row_scales


def idle_expert_params(shape: ModelShape) -> int:
    """One layer's routed-expert weights a token does not use (all but its top-k; 0 for a dense model): resident,
    and under QLoRA in NF4 like the rest of the experts."""
    return (shape.experts - shape.top_k) * 3 * shape.hidden * shape.expert_intermediate if shape.experts else 0


def layer_weight_bytes(shape: ModelShape, fmt: WeightFormat, compute_dtype: str = "bfloat16") -> float:
    """One decoder block's base weights: the unit FSDP gathers (sharded per block)."""
    per = {"nf4": NF4_BYTES, "int8": INT8_BYTES}.get(fmt) or _DTYPE_BYTES[fmt]
    return (
        shape.block_matmul_params() * per
        + 2 * shape.hidden * _DTYPE_BYTES[compute_dtype if fmt in ("nf4", "int8") else fmt]
    )


def smallest_shard_count(fits: Callable[[int], bool], most: int = 64) -> int | None:
    """The fewest devices (1, 2, 4, 8, ... up to `most`) whose FSDP shards fit, or None."""
    n = 1
    while n <= most:
        if fits(n):
            return n
        n *= 2
    return None


def optimizer_bytes_per_param(optimizer: str) -> float:
    """AdamW keeps fp32 m and v (8 bytes); the 8-bit variants 1 byte each plus a small per-block scale."""
    if optimizer == "adamw":
        return 8.0
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 2.0 + 2 * 4 / 2048  # bitsandbytes block-wise state: an fp32 absmax per 2048 values
    raise ValueError(f"train.optimizer: unknown optimizer {optimizer!r}; use adamw, adamw_8bit or paged_adamw_8bit")


def head_working_bytes(shape: ModelShape, a: int, tokens: int, head_tokens: int, fused: bool) -> float:
    """The head and loss at their largest (see `MemoryEstimate.logits`).

    Fused (trainer/model/loss.py: Liger's kernel on CUDA, else the chunked torch version): one chunk's
    logits in the compute dtype, their fp32 softmax and gradient, at most max(Liger's chunk,
    `loss.CHUNK_ELEMENTS / vocab`) tokens at once, where Liger's chunk is its call's tokens over
    ceil(vocab / hidden) and a call takes at most `HEAD_TILE_TOKENS` (so the chunk stops growing
    with the sequence); the head's input gradient (head tokens x
    hidden) kept for backward, and its scatter back to every position. Unfused (a model's own
    loss): every logit in the compute dtype and fp32, and the fp32 gradient (plus its cast)."""
    if not fused:
        return tokens * shape.vocab * (a + 4) + tokens * shape.vocab * (4 + (a if a < 4 else 0))
    per_call = min(head_tokens, HEAD_TILE_TOKENS)
    liger = 1 << max(0, math.ceil(math.log2(max(1, math.ceil(per_call / math.ceil(shape.vocab / shape.hidden))))))
    chunk = min(head_tokens, max(liger, CHUNK_ELEMENTS // shape.vocab))
    return chunk * shape.vocab * (a + 8) + (head_tokens + tokens) * shape.hidden * a


def _saved(
    shape: ModelShape, a: int, tokens: int, saved_per_layer: float, offload: bool, tiled_norms: bool
) -> tuple[float, float, float]:
    """(on the device, on the host, the final norm's part that comes back after the head's).

    Every layer's saved tensors, the embedding output and the final norm's fp32 input and output
    (`tiled_norms`: its input only, in the compute dtype, trainer/model/tiling.py).
    The offloader packs everything the decoder body saves, outside its layers too: the final
    norm's input goes to the host in the forward and comes back for the norm's own backward, right
    after the head's (so it joins the head's phase, not the layers'); the embedding output is
    layer 0's input, one of the offloaded layer inputs already."""
    embed_out = a * shape.hidden * tokens  # the embedding output (first layer's input)
    final_norm = (a if tiled_norms else 4 + a) * shape.hidden * tokens
    if not offload:
        return shape.layers * saved_per_layer + embed_out + final_norm, 0.0, 0.0
    in_flight = min(2, shape.layers)  # the layer being used and the one being fetched
    return in_flight * saved_per_layer, (shape.layers - in_flight) * saved_per_layer + final_norm, final_norm


def dequantised_bytes(shape: ModelShape, a: int, weight_format: WeightFormat) -> float:
    """NF4/int8: the largest block weight dequantised to the compute dtype (bitsandbytes does that
    in each backward; NF4 routed experts: one projection of every expert a batch routes to, at most all of
    them); nothing for weights kept in a float dtype."""
    if weight_format not in ("nf4", "int8"):
        return 0.0
    experts = shape.experts * shape.hidden * 2 * shape.expert_intermediate if weight_format == "nf4" else 0
    return float(max(experts, *(i * o for _, i, o in shape.linears())) * a)


def with_reference_adapter(estimate: MemoryEstimate) -> MemoryEstimate:
    """`estimate` with a frozen copy of the adapter beside the trained one (a DPO run started from an
    adapter keeps it as its reference: trainer/model/reference.py)."""
    return dataclasses.replace(estimate, adapter=2 * estimate.adapter)


def estimate_memory(
    shape: ModelShape,
    *,
    weight_format: WeightFormat,
    compute_dtype: str,
    lora_params: int,
    lora_r: int,
    target_modules: Sequence[str],
    lora_dropout: bool,
    optimizer: str,
    micro_batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    device_overhead: float = CUDA_OVERHEAD_BYTES,
    fragmentation: float = FRAGMENTATION,
    eager_attention: bool = False,
    shards: int = 1,
    offload: bool = False,
    activation_offload: bool = False,
    fused_head: bool = True,
    head_tokens: int | None = None,
    tiled_mlp: bool = False,
    mlp_tile_tokens: int = MLP_TILE_TOKENS,
    attention_output_copy: bool = True,
) -> MemoryEstimate:
    """Peak bytes per GPU for one optimizer step (adapter kept in fp32, as peft does by default);
    `shards`/`offload`: FSDP over that many devices, the frozen base offloaded to CPU;
    `activation_offload`: saved decoder tensors in host memory, two layers' worth in flight
    (trainer/model/offload.py); `fused_head`: spotune's fused head and loss (False: the model's own);
    `head_tokens`: positions that reach the head (default: all, the safe side for SFT data);
    `tiled_mlp`: every MLP and norm in tiles of `mlp_tile_tokens` (trainer/model/tiling.py; one tile
    or less runs the plain module); `attention_output_copy`: see trainer/plan/activations.py (False for flash-attn)."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    a = _DTYPE_BYTES[compute_dtype]
    tokens = micro_batch_size * seq_len
    tiled = tiled_mlp and tokens > mlp_tile_tokens
    tiled_norms = tiled and shape.arch == "llama"  # gpt2's blocks have no input/post-attention norms to tile
    eager_seq = seq_len if eager_attention else 0
    per_layer = (
        act.layer_activation_bytes_per_token(
            shape, a, lora_r, target_modules, lora_dropout, eager_seq, tiled, attention_output_copy
        )
        * tokens
    )
    saved_per_layer = a * shape.hidden * tokens if gradient_checkpointing else per_layer
    activations, offloaded, final_norm = _saved(shape, a, tokens, saved_per_layer, activation_offload, tiled_norms)
    head = head_working_bytes(shape, a, tokens, tokens if head_tokens is None else head_tokens, fused_head)
    head += final_norm  # offloaded: it comes back for the norm's own backward, right after the head's
    mlp_per_token = act.mlp_activation_bytes_per_token(shape, a, lora_r, target_modules, lora_dropout)
    tile = mlp_tile_tokens if tiled else None
    layer_backward = act.layer_backward_bytes(shape, a, tokens, target_modules, mlp_per_token, tile)
    layer_backward += dequantised_bytes(shape, a, weight_format)
    if gradient_checkpointing:  # the layer being recomputed holds all its activations; with tiled
        # norms its input (the tiled input norm keeps it) is the checkpoint's, already counted
        layer_backward += per_layer - (a * shape.hidden * tokens if tiled_norms else 0)
    # The head's working set is gone by the time a layer runs its backward: the peak takes the
    # larger of the two, so the workspace term is what a layer's backward needs beyond the head.
    workspace = max(0.0, layer_backward - head)
    weights = weight_bytes(shape, weight_format, compute_dtype)
    state = 1.0 / shards  # the adapter, its gradients and optimizer state are sharded too
    if shards > 1 or offload:
        layer = layer_weight_bytes(shape, weight_format, compute_dtype)
        root = weights - shape.layers * layer
        gathered = root + min(2, shape.layers) * layer
        weights = gathered + (0.0 if offload else (weights - gathered) / shards)
        state = 0.0 if offload else state  # CPU offload keeps parameters, gradients and the step on the host
    return MemoryEstimate(
        weights=weights,
        adapter=4.0 * lora_params * state,
        gradients=4.0 * lora_params * state,
        optimizer=optimizer_bytes_per_param(optimizer) * lora_params * state,
        activations=activations,
        logits=head,
        backward_workspace=workspace,
        fragmentation=fragmentation * (activations + head + workspace),
        overhead=device_overhead,
        offloaded=offloaded,
    )
