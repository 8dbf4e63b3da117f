"""Training FLOPs of a (LoRA) fine-tune, counted from the model's shape.

The count is what the maths needs, not what a kernel happens to execute:

* every matmul weight costs 2 FLOPs per token forward (multiply + add);
* backward computes the gradient w.r.t. the weight's *input* (another 2 FLOPs per
  weight per token) for every weight, frozen or not, because adapters further down
  the network need the gradient to flow through;
* only trainable weights also get a weight gradient (2 more): so a frozen base weight
  costs 4 FLOPs/param/token and a LoRA weight 6 (the usual "6N" is the all-trainable case);
* attention scores (QK^T) and the weighted sum (AV) cost 2*head_dim*heads FLOPs each
  per (query, key) pair per layer forward, twice that backward. With packing the pairs
  are those inside each document (block-diagonal), causal: L*(L+1)/2 for a document
  of L tokens, which is why the caller passes the sum of squared document lengths.

Excluded on purpose: activation recompute under gradient checkpointing (MFU counts
useful work only), norms, activations, softmax, the loss, embedding lookups (not a
matmul) and the optimizer: all O(params) or O(tokens*hidden), far below the matmuls.

One approximation: the very first layer's input-gradient is not actually needed (the
embeddings are frozen) and autograd skips it for the projections that read the
embedding output directly. `tests/test_flops.py` measures that difference exactly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Module names that `all-linear` adapts in each architecture family. peft's `all-linear`
# is every nn.Linear/Conv1D except the output head; these tables are the same set.
_LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GPT2_LINEARS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that FLOPs and memory depend on."""

    arch: str
    """`llama` (llama/qwen2/mistral style: gated MLP, RMSNorm) or `gpt2`."""
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    """Qwen2 puts a bias on q/k/v; gpt2 biases every linear (see `total_params`)."""
    max_positions: int = 0
    """Learned position embeddings (gpt2 only; rotary models have none)."""
    experts: int = 0
    """A mixture of experts: routed experts per layer (0: a dense model, whose MLP is `intermediate` wide)."""
    top_k: int = 0
    """Routed experts each token goes through."""
    expert_intermediate: int = 0
    """One routed expert's MLP width."""
    shared_intermediate: int = 0
    """The shared experts' total MLP width, which every token goes through (0: none)."""

    def linears(self) -> list[tuple[str, int, int]]:
        """(module name, in_features, out_features) of every matmul weight in one block."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.arch == "gpt2":
            return [("c_attn", h, 3 * h), ("attn.c_proj", h, h), ("c_fc", h, i), ("mlp.c_proj", i, h)]
        attention = [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h)]
        if not self.experts:
            return [*attention, ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
        # A mixture of experts: what one token runs through, the shared experts and its top-k routed ones
        # (flops count active parameters; `total_params` adds the experts it skips, which stay resident).
        s, e = self.shared_intermediate, self.expert_intermediate
        shared = [("shared.gate_proj", h, s), ("shared.up_proj", h, s), ("shared.down_proj", s, h)] if s else []
        # transformers 5 fuses a routed expert's gate and up projections into one (and LoRA adapts it as one).
        routed = [("experts.gate_up_proj", h, 2 * e), ("experts.down_proj", e, h)] * self.top_k
        return [*attention, *shared, *routed]

    def block_matmul_params(self) -> int:
        return sum(i * o for _, i, o in self.linears())

    def head_params(self) -> int:
        """The output projection hidden -> vocab (a matmul even when tied to the embedding)."""
        return self.vocab * self.hidden

    def matmul_params(self) -> int:
        """Base weights that take part in a matmul for every token: blocks and the head."""
        return self.layers * self.block_matmul_params() + self.head_params()

    def total_params(self) -> int:
        """Every parameter of the Hugging Face model (embeddings, norms, biases included)."""
        h = self.hidden
        embed = self.vocab * h + self.max_positions * h
        head = 0 if self.tied_embeddings else self.head_params()
        if self.arch == "gpt2":
            bias = sum(o for _, _, o in self.linears())
            norms = 2 * 2 * h  # two LayerNorms (weight + bias) per block
            final = 2 * h
        else:
            bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
            norms = 2 * h  # two RMSNorm weights per block
            final = h
        # A mixture of experts keeps every expert resident (and a router), not only the top-k a token uses.
        idle = (self.experts - self.top_k) * 3 * h * self.expert_intermediate + self.experts * h if self.experts else 0
        return embed + head + self.layers * (self.block_matmul_params() + bias + norms + idle) + final


def model_shape(hf_config: Any) -> ModelShape:
    """Read a transformers PretrainedConfig of llama/qwen2/mistral/gpt2 style."""
    model_type = str(getattr(hf_config, "model_type", ""))
    if model_type == "gpt2" or hasattr(hf_config, "n_embd"):
        h = int(hf_config.n_embd)
        heads = int(hf_config.n_head)
        return ModelShape(
            arch="gpt2",
            layers=int(hf_config.n_layer),
            hidden=h,
            intermediate=int(getattr(hf_config, "n_inner", None) or 4 * h),
            heads=heads,
            kv_heads=heads,
            head_dim=h // heads,
            vocab=int(hf_config.vocab_size),
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            qkv_bias=True,
            max_positions=int(hf_config.n_positions),
        )
    try:
        h = int(hf_config.hidden_size)
        heads = int(hf_config.num_attention_heads)
        layers = int(hf_config.num_hidden_layers)
        inter = int(hf_config.intermediate_size)
        vocab = int(hf_config.vocab_size)
    except (AttributeError, TypeError) as e:
        raise ValueError(
            f"model_shape: config of type {model_type or type(hf_config).__name__!r} lacks {e}; "
            "supported are llama/qwen2/mistral/gpt2-style configs"
        ) from None
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    experts = next((getattr(hf_config, k) for k in _EXPERT_COUNTS if getattr(hf_config, k, None)), 0)
    moe: dict[str, int] = {}
    if experts:  # a mixture of experts (a dense first layer or two, where a family has them, counted as MoE)
        expert_width = int(getattr(hf_config, "moe_intermediate_size", None) or inter)
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", None) or 0)
        shared = shared or int(getattr(hf_config, "n_shared_experts", None) or 0) * expert_width
        top_k = int(hf_config.num_experts_per_tok)
        moe = dict(experts=int(experts), top_k=top_k, expert_intermediate=expert_width, shared_intermediate=shared)
    return ModelShape(
        arch="llama",
        layers=layers,
        hidden=h,
        intermediate=inter,
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        vocab=vocab,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2 hard-codes bias on q/k/v; llama/mistral expose `attention_bias` (default off).
        qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        **moe,
    )


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where a mixture of experts' config says how many routed experts a layer has."""


def adapted_linears(shape: ModelShape, target_modules: Sequence[str]) -> list[tuple[str, int, int]]:
    """The block linears a LoRA with these `target_modules` adapts (peft's suffix match)."""
    if any(t == "all-linear" for t in target_modules):
        return shape.linears()
    out = []
    for name, i, o in shape.linears():
        # peft matches a target when the module path ends with it; gpt2's two c_proj share a suffix.
        if any(name == t or name.endswith("." + t) or re.fullmatch(t, name) for t in target_modules):
            out.append((name, i, o))
    if not out:
        names = ", ".join(n for n, _, _ in shape.linears())
        raise ValueError(
            f"adapter.target_modules {list(target_modules)} matches no linear of a {shape.arch} block; "
            f"use all-linear or some of: {names}"
        )
    return out


def lora_params(shape: ModelShape, r: int, target_modules: Sequence[str] = ("all-linear",)) -> int:
    """LoRA parameter count: r*(in+out) per adapted linear, in every layer; every routed expert carries its own
    adapter (a mixture of experts' `linears` lists the top-k a token uses)."""
    per_layer = 0.0
    for name, i, o in adapted_linears(shape, target_modules):
        per_layer += r * (i + o) * (shape.experts / shape.top_k if name.startswith("experts.") else 1)
    return shape.layers * round(per_layer)


def causal_pairs(tokens: float, doc_len_sq_sum: float) -> float:
    """(query, key) pairs of causal attention inside documents: sum L(L+1)/2 = (sum L^2 + sum L)/2."""
    return (doc_len_sq_sum + tokens) / 2.0


def attention_flops(shape: ModelShape, pairs: float) -> float:
    """QK^T and AV over `pairs` (query, key) pairs: 2*2*head_dim*heads forward, twice that backward."""
    forward = 2 * 2 * shape.head_dim * shape.heads * pairs * shape.layers
    return 3.0 * forward


def train_flops(
    shape: ModelShape,
    tokens: float,
    doc_len_sq_sum: float,
    frozen_params: float,
    trainable_params: float,
    *,
    causal: bool = True,
    head_tokens: float | None = None,
) -> float:
    """FLOPs of forward + backward over `tokens` tokens, excluding recompute.

    `frozen_params`: frozen base weights that run a matmul per token (use
    `shape.matmul_params()`; embeddings are a lookup, not a matmul).
    `trainable_params`: trainable weights in matmuls (use `lora_params`).
    `doc_len_sq_sum`: sum over documents of length**2 for the tokens counted (for
    unpacked rows, one document per row). `causal=False` counts the full square,
    which is what a dense attention kernel executes with a mask.
    `head_tokens`: positions whose logits are computed, when the loop skips the output head
    where no label is (default: every token); `frozen_params` must then include the head.
    """
    linear = (4.0 * frozen_params + 6.0 * trainable_params) * tokens
    if head_tokens is not None:
        linear -= 4.0 * shape.head_params() * (tokens - head_tokens)
    pairs = causal_pairs(tokens, doc_len_sq_sum) if causal else float(doc_len_sq_sum)
    return linear + attention_flops(shape, pairs)


# --- MFU counts --------------------------------------------------------------------------------
# Three counts of the same training work; each is defined here once and nowhere else.
#
# `MFU` (what the meter logs as `mfu` and docs/gpu.md calls MFU) is the count published LoRA
# figures use, so a tokens/s figure converts to the MFU they print. NVIDIA's NeMo AutoModel
# table (Llama3 8B LoRA, one H100, seq 4096, full rows) gives 12,472.87 tokens/s, "402
# TFLOPs/sec/GPU", i.e. 40.6% of the H100's 989 TFLOP/s dense bf16. Their llama3 formula
# is the pre-training count, 6 FLOPs per matmul weight per token (N = 7.50e9 matmul weights:
# blocks + head, no embedding lookup) plus causal attention over the row (6*S*hidden per
# token per layer, S/2 keys on average), scaled by 2/3 for a frozen base (no weight
# gradient). Per token: 4 * 7.50e9 + 4 * 4096 * 4096 * 32 = 32.17e9 FLOPs; x 12,473 = 401.2
# TFLOP/s = 40.57% of 989 TFLOP/s. tests/test_flops.py checks that arithmetic, and that
# 6*N (60.8%) or the LoRA-aware count (42.2%) would not reproduce it.
#
# `MFU_LORA`: `train_flops` above with the LoRA weights' own 6 FLOPs, attention's full 3x
#   backward and the head only where the loop applies it: the work spotune's step must do.
# `MFU_6N`: 6 x every parameter of the model (embeddings included) per token, the count of
#   full fine-tuning that some LoRA write-ups quote; it credits weight gradients LoRA never computes.
MFU = "mfu"
MFU_LORA = "mfu_lora"
MFU_6N = "mfu_6n"
MFU_COUNTS = (MFU, MFU_LORA, MFU_6N)


def frozen_base_flops(shape: ModelShape, tokens: float, doc_len_sq_sum: float) -> float:
    """The published LoRA count (`MFU`): 4 FLOPs per matmul weight per token (head included,
    at every token) plus 2/3 of causal attention inside each document.

    For rows that are one document each of S tokens (what the published figures train on),
    `doc_len_sq_sum` = rows * S**2 and this is NeMo's llama3 formula x 2/3. With packed
    documents the attention term counts only the pairs inside a document, as `train_flops` does.
    """
    attention = attention_flops(shape, causal_pairs(tokens, doc_len_sq_sum))
    return 4.0 * shape.matmul_params() * tokens + attention * 2.0 / 3.0


def six_n_flops(shape: ModelShape, tokens: float) -> float:
    """`MFU_6N`: 6 FLOPs per parameter of the whole model per token, attention not counted."""
    return 6.0 * shape.total_params() * tokens


def mfu_flops(
    shape: ModelShape, tokens: float, doc_len_sq_sum: float, trainable_params: float, head_tokens: float
) -> dict[str, float]:
    """Every count of the same work: {MFU: ..., MFU_LORA: ..., MFU_6N: ...} FLOPs.

    `trainable_params`: the LoRA weights (`lora_params`); `head_tokens`: positions whose logits
    the loop computes (spotune: the labelled ones), read by the LoRA-aware count only.
    """
    lora_aware = train_flops(
        shape, tokens, doc_len_sq_sum, shape.matmul_params(), trainable_params, head_tokens=head_tokens
    )
    return {
        MFU: frozen_base_flops(shape, tokens, doc_len_sq_sum),
        MFU_LORA: lora_aware,
        MFU_6N: six_n_flops(shape, tokens),
    }


def meter_flops_fn(
    hf_config: Any, trainable: int, reference: bool = False
) -> Callable[[float, float, float], float] | None:
    """The meter's FLOPs of a step (tokens, sum of squared document lengths, head tokens) for this
    model with `trainable` LoRA parameters, or None for an architecture the FLOP model does not know.
    `reference`: the step also runs the reference forward over the same tokens (`config.runs_reference`)."""
    try:
        shape = model_shape(hf_config)
    except ValueError:
        return None  # an architecture the FLOP model does not know: MFU stays null

    def fn(tokens: float, doc_sq: float, head_tokens: float) -> float:
        # The meter's `mfu` is the published count (MFU below); the others sit beside it here.
        done = mfu_flops(shape, tokens, doc_sq, trainable, head_tokens)[MFU]
        return done + (reference_forward_flops(shape, tokens, doc_sq, head_tokens) if reference else 0.0)

    return fn


def reference_forward_flops(shape: ModelShape, tokens: float, doc_len_sq_sum: float, head_tokens: float) -> float:
    """A preference objective's reference forward (DPO): 2 FLOPs per frozen matmul weight per token, the
    head only where a label is, and causal attention's forward (a third of `attention_flops`); no
    backward. Counted by the meter's MFU and the estimate alike: it is work the step must do."""
    linear = 2.0 * shape.matmul_params() * tokens - 2.0 * shape.head_params() * (tokens - head_tokens)
    return linear + attention_flops(shape, causal_pairs(tokens, doc_len_sq_sum)) / 3.0
