"""The LoRA-aware FLOP count: by hand on a tiny shape, and against torch's FlopCounterMode.

Agreement with FlopCounterMode is exact (integer FLOPs) once the one documented
approximation is accounted for: autograd skips the input-gradient of the first
layer's projections that read the (frozen) embedding output directly.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from trainer.model import flops

VOCAB = 300


# hidden 8, 1 layer, 2 heads of 4, 1 kv head, ffn 16, vocab 10: small enough to count by hand.
TINY = flops.ModelShape(
    arch="llama",
    layers=1,
    hidden=8,
    intermediate=16,
    heads=2,
    kv_heads=1,
    head_dim=4,
    vocab=10,
    tied_embeddings=False,
)


def _config(arch: str) -> transformers.PretrainedConfig:
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=160,
            vocab_size=VOCAB,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[
        arch
    ]
    return cls(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )


def test_hand_count_tiny_shape() -> None:
    # hidden 8, 1 layer, 2 heads of 4, 1 kv head, ffn 16, vocab 10, LoRA r=2 on q and v only.
    s = TINY
    block = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k, v, o, gate/up/down = 576
    assert s.block_matmul_params() == block
    assert s.matmul_params() == block + 10 * 8
    lora = flops.lora_params(s, 2, ("q_proj", "v_proj"))
    assert lora == 2 * (8 + 8) + 2 * (8 + 4)  # = 56
    # Two documents of 3 and 5 tokens: causal pairs 6 + 15 = 21.
    tokens, sq = 8, 3 * 3 + 5 * 5
    assert flops.causal_pairs(tokens, sq) == 21
    expected = (4 * (block + 80) + 6 * 56) * 8 + 3 * (2 * 2 * 4 * 2) * 21 * 1
    assert (
        flops.train_flops(s, tokens, sq, s.matmul_params(), lora) == expected == 25696
    )  # 23680 linear + 2016 attention
    # Logits only at 3 labelled positions: the frozen head (80 weights) runs for 3 tokens, not 8.
    assert flops.train_flops(s, tokens, sq, s.matmul_params(), lora, head_tokens=3) == expected - 4 * 80 * 5
    # Control: making the LoRA weights frozen changes the answer by exactly their weight-gradient.
    assert flops.train_flops(s, tokens, sq, s.matmul_params() + lora, 0) == expected - 2 * 56 * 8


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_shape_counts_match_hf_and_peft(arch: str) -> None:
    cfg = _config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    shape = flops.model_shape(cfg)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    import peft  # here, not at collection: peft imports bitsandbytes and with it TorchInductor, ~2 s per test worker

    for r, targets in [(4, ("all-linear",)), (2, ("q_proj", "v_proj") if arch != "gpt2" else ("c_attn",))]:
        lora = peft.get_peft_model(
            transformers.AutoModelForCausalLM.from_config(cfg),
            peft.LoraConfig(r=r, target_modules=list(targets) if targets[0] != "all-linear" else "all-linear"),
        )
        assert flops.lora_params(shape, r, targets) == sum(p.numel() for p in lora.parameters() if p.requires_grad)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_agrees_with_flop_counter_mode(arch: str) -> None:
    torch.manual_seed(0)
    cfg = _config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    import peft  # here, not at collection: peft imports bitsandbytes and with it TorchInductor, ~2 s per test worker

    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    batch, seq = 2, 32
    ids = torch.randint(0, VOCAB, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    measured = counter.get_total_flops()

    shape = flops.model_shape(cfg)
    tokens = batch * seq
    # A dense kernel with a causal mask still computes the full seq x seq square: causal=False.
    ours = flops.train_flops(
        shape, tokens, batch * seq * seq, shape.matmul_params(), flops.lora_params(shape, 4), causal=False
    )
    # What autograd skips: the input-gradient of the first layer's projections fed by the
    # frozen embedding (q/k/v, or gpt2's fused c_attn) and of their LoRA A matrices.
    first = [(i, o) for n, i, o in shape.linears() if n in ("q_proj", "k_proj", "v_proj", "c_attn")]
    skipped = 2 * tokens * sum(i * o + 4 * i for i, o in first)
    assert ours - skipped == measured
    assert abs(ours / measured - 1) < 0.06  # the approximation is a few percent at 2 layers, less when deeper
    # Control: the attention term is needed for the match.
    assert ours - skipped - flops.attention_flops(shape, batch * seq * seq) != measured


def test_unknown_target_module_names_the_fix() -> None:
    s = flops.model_shape(_config("llama"))
    with pytest.raises(ValueError, match="adapter.target_modules"):
        flops.lora_params(s, 8, ("c_attn",))


def _llama_3_1_8b() -> flops.ModelShape:
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "llama-3.1-8b.json"
    return flops.model_shape(transformers.LlamaConfig(**json.loads(path.read_text())))


def test_published_count_reproduces_nvidias_8b_lora_mfu() -> None:
    """NeMo AutoModel, Llama3 8B LoRA, one H100, seq 4096 full rows: 12,472.87 tokens/s at
    "402 TFLOPs/sec/GPU", 40.6% of 989 TFLOP/s. One second of it, rows of one document each."""
    shape = _llama_3_1_8b()
    assert shape.matmul_params() == 7_504_658_432 and shape.total_params() == 8_030_261_248
    tokens, seq, peak = 12_472.87, 4096, 989e12
    lora = flops.lora_params(shape, 16)
    counts = flops.mfu_flops(shape, tokens, tokens * seq, lora, head_tokens=tokens)
    assert set(counts) == set(flops.MFU_COUNTS)
    assert round(counts[flops.MFU] / peak, 3) == 0.406
    assert abs(counts[flops.MFU] / 402e12 - 1) < 0.005  # their TFLOPs/sec figure, within its rounding
    # NeMo's llama3 pre-training formula, written out, x 2/3: the same number.
    h, layers, ffn, vocab = 4096, 32, 14336, 128256
    nemo = seq * layers * h * h * (12 + 12 * 8 / 32 + 18 * ffn / h + 12 * seq / h * 0.5 + 6 * vocab / (layers * h))
    assert counts[flops.MFU] / tokens == pytest.approx(nemo / seq * 2 / 3, rel=1e-4)  # (S+1)/2 vs S/2 keys
    # Controls: the other counts do not give NVIDIA's figure.
    assert round(counts[flops.MFU_6N] / peak, 3) == 0.608
    assert round(counts[flops.MFU_LORA] / peak, 3) == 0.422
    assert round(flops.six_n_flops(shape, tokens) / peak, 3) != 0.406


def test_published_count_by_hand_and_packing() -> None:
    s = TINY
    # Two documents of 3 and 5 tokens (21 causal pairs): 4 per matmul weight per token + 2/3 attention.
    tokens, sq = 8, 3 * 3 + 5 * 5
    attention = 3 * (2 * 2 * 4 * 2) * 21
    assert flops.frozen_base_flops(s, tokens, sq) == 4 * s.matmul_params() * 8 + attention * 2 / 3
    # Control: one document of 8 tokens (36 pairs) counts more attention than the packed two.
    assert flops.frozen_base_flops(s, tokens, 64) > flops.frozen_base_flops(s, tokens, sq)
