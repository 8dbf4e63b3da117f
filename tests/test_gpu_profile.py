"""`benchmarks/gpu.py --profile`: the bucketing rule, and a CPU profile of one step of a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_profile as gp  # noqa: E402

R, V = 16, 1000
LORA = gp.lora_widths(R, fused=False)


def _k(name: str, *ops: str, dims: tuple[int, ...] = (), us: float = 1.0) -> gp.Kernel:
    return gp.Kernel(name, ops, frozenset(dims), us)


def test_bucket_rule_on_cuda_kernel_names() -> None:
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64"
    assert gp.bucket(_k(gemm, "aten::mm", "aten::linear", dims=(4096, 4096)), LORA, V) == "base_matmul"
    assert gp.bucket(_k(gemm, "aten::mm", "aten::linear", dims=(4096, R)), LORA, V) == "lora_matmul"
    assert gp.bucket(_k(gemm, "aten::mm", "MmBackward0", dims=(R, 4096)), LORA, V) == "lora_matmul"
    assert gp.bucket(_k(gemm, "aten::mm", dims=(4096, V)), LORA, V) == "head_loss"
    assert gp.bucket(_k("flash_fwd_kernel", "aten::_flash_attention_forward"), LORA, V) == "attention"
    assert gp.bucket(_k("_rms_norm_forward_kernel", "LigerRMSNormFunction"), LORA, V) == "norm_act_rope"
    assert gp.bucket(_k("_cross_entropy_kernel", "LigerFusedLinearCrossEntropyFunction"), LORA, V) == "head_loss"
    assert gp.bucket(_k("multi_tensor_apply_kernel", "aten::_fused_adamw_", "Optimizer.step#AdamW.step"), LORA, V) == (
        "optimizer"
    )
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda>"
    assert gp.bucket(_k(elementwise, "aten::copy_", "aten::_to_copy", "aten::to"), LORA, V) == "cast_copy"
    assert gp.bucket(_k("Memcpy HtoD (Pageable -> Device)"), LORA, V) == "cast_copy"
    assert gp.bucket(_k("void at::native::vectorized_elementwise_kernel<MulFunctor>", "aten::mul"), LORA, V) == (
        "norm_act_rope"
    )
    assert gp.bucket(_k("indexSelectLargeIndex", "aten::embedding_dense_backward"), LORA, V) == "other"
    # adapter.fused: q/k/v's A as one [T x 3r] matmul; without the fused widths it reads as a base matmul.
    assert gp.bucket(_k(gemm, "aten::mm", dims=(4096, 3 * R)), gp.lora_widths(R, fused=True), V) == "lora_matmul"
    assert gp.bucket(_k(gemm, "aten::mm", dims=(4096, 3 * R)), LORA, V) == "base_matmul"
    # Control: the same GEMM read with another rank is a base matmul.
    assert gp.bucket(_k(gemm, "aten::mm", dims=(4096, R)), gp.lora_widths(8, fused=False), V) == "base_matmul"


def test_breakdown_sums_to_the_span_and_counts_gaps_as_idle() -> None:
    kernels = [_k("a", "aten::mm", dims=(64, 64), us=4.0), _k("b", "aten::mul", us=4.0), _k("c", "aten::copy_", us=2.0)]
    # Two streams overlap by 2 µs over [0, 6); then a gap; then [10, 12): busy 8 µs of a 12 µs span.
    intervals = [(0.0, 4.0), (2.0, 6.0), (10.0, 12.0)]
    out = gp.breakdown(kernels, intervals, LORA, V)
    assert out["total"] == 12.0 and out[gp.IDLE] == 4.0
    assert sum(out[b] for b in gp.BUCKETS) + out[gp.IDLE] == pytest.approx(12.0)
    assert out["base_matmul"] == pytest.approx(4.0 * 8 / 10)  # scaled: 10 µs of kernels in 8 busy µs
    assert gp.union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    # Busy time no kernel record covers (linked to no op) is `other`, not spread over the buckets.
    part = gp.breakdown(kernels[:1], intervals, LORA, V)
    assert part["base_matmul"] == 4.0 and part["other"] == 4.0 and part[gp.IDLE] == 4.0


def test_cpu_profile_of_one_tiny_step_fills_the_buckets(tiny_llama: Path) -> None:
    from trainer.config import AdapterConfig, ModelConfig
    from trainer.model import load as model_lib
    from trainer.model.loss import token_loss_sum
    from trainer.training.batches import micro_batch

    torch.manual_seed(0)
    model = model_lib.build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=R, dropout=0.0))
    vocab = model.get_base_model().config.vocab_size
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(4, 100, (1, 40))
    pos = torch.cat([torch.arange(25), torch.arange(15)])[None]  # two packed documents
    micro = micro_batch(ids, ids.clone(), pos)

    def step() -> None:
        token_loss_sum(model, micro).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: the optimizer state exists before the profiled step
    prof = gp.profile_step(step, LORA, vocab)
    ms = prof["ms"]
    for b in ("base_matmul", "lora_matmul", "attention", "norm_act_rope", "head_loss", "optimizer", "cast_copy"):
        assert ms[b] > 0, (b, ms)
    assert sum(ms.values()) == pytest.approx(prof["total_ms"])
    assert sum(prof["share"].values()) == pytest.approx(1.0)
    assert "profile of one step" in gp.summary(prof)
    # Control: the same step of the model without adapters (full fine-tune) has no LoRA matmul.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    full = gp.profile_step(lambda: token_loss_sum(plain, micro).backward(), LORA, vocab)["ms"]
    assert full["lora_matmul"] == 0 and full["base_matmul"] > 0
