"""Peak device memory of one LoRA/QLoRA training step, per GPU, from the model's shape.

peak = base weights + adapter (weights, gradients, optimizer states)
       + saved activations of every layer + the logits/loss working set
       + the backward working set + framework overhead.

Per-layer saved activations (llama-style block, elements per token, `a` = bytes of the
compute dtype), counted from what autograd keeps for backward:

* two RMSNorms: each keeps an fp32 copy of its input and its normalised output: 2*(4h + a*h) bytes;
* attention (flash/memory-efficient kernels, no seq x seq matrix): rotated q, k, v, the
  kernel output and its contiguous copy fed to o_proj: a*(2*q + 2*kv) + a*q, plus the fp32
  log-sum-exp per head; eager attention also keeps scores and probabilities, 2*a*heads*seq;
* gated MLP: gate, silu(gate), up and their product: 4*a*i;
* LoRA, per adapted linear: the A output (a*r); with dropout > 0 also the dropped copy of
  the input and its mask: in*(a + 1). (peft applies dropout separately per adapter, which
  is why dropout costs so much memory.)
gpt2 blocks use the same terms with a plain MLP (c_fc output, GELU output: 2*a*i + GELU's
internal input) and LayerNorms.

With gradient checkpointing each layer keeps only its input (a*h per token) and one layer
is recomputed at a time, so one layer's full activations are added once.

Logits: the head writes a*V per token and log_softmax keeps its fp32 output (4*V); backward
adds the fp32 gradient (4*V, plus a*V for the cast back when a < 4). Over a long vocabulary
this is often the single largest term. The peak of a step is at the start of backward:
all saved activations plus the logits and their gradient.

spotune's loop computes logits only at positions that carry a label (`logits_to_keep`), so
for prompt-masked SFT data the real logits term is smaller: the estimate assumes every
position of a row is trained (true for `text` data), which keeps it on the safe side.

Under FSDP on N devices (`shards=N`) every parameter, gradient and optimizer state is held as
1/N of the whole; what a device holds unsharded at the peak is the root module's parameters
(embeddings, final norm, output head: gathered for the forward and kept for backward) and up
to two decoder layers at a time (the one computing and the one prefetched). With the frozen
base offloaded to CPU (`offload=True`) the shards live in host memory and only the gathered
working set is on the device. Activations are per device either way.

Measured against CPU fp32 peaks (tests/test_plan_memory.py: profiler allocation trace of
a full optimizer step, 4-layer hidden-512 llama/qwen2) the total comes out 2-8% high without
checkpointing and 16% high with it (the measured peak there lacks the logits gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from trainer.model.flops import ModelShape, adapted_linears

GIB = 1024**3
WeightFormat = Literal["float32", "bfloat16", "float16", "int8", "nf4"]
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NF4 with double quantisation: 4 bits per weight, an 8-bit absmax per 64 weights, and an
# fp32 scale per 256 absmax blocks (bitsandbytes defaults): 0.5 + 1/64 + 4/(64*256) bytes.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# LLM.int8: one byte per weight plus an fp32 scale per output row (added per linear below).
INT8_BYTES = 1.0
# CUDA context, cuBLAS workspace and allocator slack that no tensor accounts for.
CUDA_OVERHEAD_BYTES = 1.0 * GIB
# The caching allocator rarely packs perfectly: dynamic memory (activations, logits) grows by this share.
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by component."""

    weights: float
    adapter: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    backward_workspace: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    def as_gib(self) -> dict[str, float]:
        out = {k: v / GIB for k, v in asdict(self).items()}
        out["total"] = self.total / GIB
        return out


def weight_bytes(shape: ModelShape, fmt: WeightFormat, compute_dtype: str = "bfloat16") -> float:
    """Base weights: quantised formats apply to the block linears only (bitsandbytes keeps
    embeddings, norms and the output head in the compute dtype)."""
    total = shape.total_params()
    if fmt in _DTYPE_BYTES:
        return float(total * _DTYPE_BYTES[fmt])
    linear = shape.layers * shape.block_matmul_params()
    rest = (total - linear) * _DTYPE_BYTES[compute_dtype]
    if fmt == "nf4":
        return rest + linear * NF4_BYTES
    row_scales = shape.layers * sum(o for _, _, o in shape.linears()) * 4
    return rest + linear * INT8_BYTES + row_scales


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


def layer_activation_bytes_per_token(
    shape: ModelShape,
    a: int,
    r: int,
    targets: Sequence[str],
    lora_dropout: bool,
    eager_attention_seq: int = 0,
) -> float:
    """Bytes autograd keeps per token for one block (see the module docstring).

    `eager_attention_seq`: with eager attention, the sequence length whose scores and
    softmax probabilities (heads x seq per token, each) are kept as well."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * (4 * h + a * h)
    attention = a * (2 * q + 2 * kv) + a * q + 4 * shape.heads + 2 * a * shape.heads * eager_attention_seq
    mlp = (4 if shape.arch == "llama" else 3) * a * i
    lora = 0.0
    for _, fan_in, _ in adapted_linears(shape, targets):
        lora += a * r + (fan_in * (a + 1) if lora_dropout else 0)
    return norms + attention + mlp + lora


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
) -> MemoryEstimate:
    """Peak bytes per GPU for one optimizer step (adapter kept in fp32, as peft does by default);
    `shards`/`offload`: FSDP over that many devices, the frozen base offloaded to CPU."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    a = _DTYPE_BYTES[compute_dtype]
    tokens = micro_batch_size * seq_len
    per_layer = (
        layer_activation_bytes_per_token(
            shape, a, lora_r, target_modules, lora_dropout, eager_attention_seq=seq_len if eager_attention else 0
        )
        * tokens
    )
    embed_out = a * shape.hidden * tokens  # the embedding output (first layer's input)
    final_norm = (4 + a) * shape.hidden * tokens
    # Held after forward: logits in the compute dtype and log_softmax's fp32 output (the
    # loss's fp32 upcast is a temporary; in fp32 it is no copy at all).
    logits = tokens * shape.vocab * (a + 4)
    # Backward starts with every activation still held and adds the fp32 logits gradient
    # (and its cast back to the compute dtype): the step's peak unless checkpointing moved it.
    logits_grad = tokens * shape.vocab * (4 + (a if a < 4 else 0))
    activations: float
    workspace: float
    if gradient_checkpointing:
        # Each layer keeps only its input; later in backward one layer at a time is
        # recomputed, by which point the logits are gone: the peak is the larger of the two.
        activations = shape.layers * a * shape.hidden * tokens + embed_out + final_norm
        workspace = max(logits_grad, per_layer - logits)
    else:
        activations = shape.layers * per_layer + embed_out + final_norm
        workspace = logits_grad
    scale = 1 + fragmentation
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
        activations=activations * scale,
        logits=logits * scale,
        backward_workspace=workspace * scale,
        overhead=device_overhead,
    )
