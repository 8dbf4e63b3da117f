"""The fused head + loss equals the plain computation; heads it cannot compute are refused;
the model knobs of the fast path (adapter compute dtype, per-layer compile, attention choice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainer.config import AdapterConfig, ModelConfig
from trainer.model import load as model_lib
from trainer.model import loss as micro_loss

T, H, V = 37, 16, 50


def _inputs(dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, b, targets  # type: ignore[return-value]


def _loss_and_grads(fn, hidden, weight, bias, targets):  # type: ignore[no-untyped-def]
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    loss = fn(hidden, weight, targets, bias)
    (loss * 0.5).backward()  # a non-unit incoming gradient, as the loop's 1/N gives
    return loss.detach(), [t.grad.clone() for t in (hidden, weight, bias) if t is not None]


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_fused_loss_equals_plain_in_fp32(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(micro_loss, "CHUNK_ELEMENTS", 8 * V)  # 8-token chunks: five of them, the last partial
    args = _inputs(torch.float32, bias)
    plain = _loss_and_grads(micro_loss.plain_linear_cross_entropy, *args)
    fused = _loss_and_grads(micro_loss.linear_cross_entropy, *args)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-5)
    for got, want in zip(fused[1], plain[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Control: one shifted target changes loss and gradients beyond the tolerance above.
    hidden, weight, b, targets = args
    wrong = targets.clone()
    wrong[T - 1] = (wrong[T - 1] + 1) % V
    moved = _loss_and_grads(micro_loss.linear_cross_entropy, hidden, weight, b, wrong)
    assert abs(float(moved[0] - plain[0])) > 1e-3 and not torch.allclose(moved[1][0], plain[1][0], atol=1e-4)


def test_chunked_fused_loss_equals_plain_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(micro_loss, "CHUNK_ELEMENTS", 8 * V)
    args = _inputs(torch.bfloat16, bias=False)
    plain = _loss_and_grads(micro_loss.plain_linear_cross_entropy, *args)
    fused = _loss_and_grads(micro_loss.linear_cross_entropy, *args)
    assert fused[0].dtype == torch.float32  # the loss is fp32 whatever the compute dtype
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-4)  # same bf16 logits, fp32 softmax
    for got, want in zip(fused[1], plain[1], strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_token_logprobs_equal_plain_per_token(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunked head kernel: per-token log-probabilities (what the preference objectives sum per
    sequence, each token with its own incoming gradient), and SFT's loss is minus their sum."""
    monkeypatch.setattr(micro_loss, "CHUNK_ELEMENTS", 8 * V)
    args = _inputs(torch.float32, bias)
    upstream = torch.linspace(-1.0, 2.0, T)  # a different incoming gradient per token

    def per_token(fn, hidden, weight, b, targets):  # type: ignore[no-untyped-def]
        return _loss_and_grads(lambda *a: (fn(*a) * upstream).sum() * 2, hidden, weight, b, targets)

    def plain(hidden, weight, targets, b):  # type: ignore[no-untyped-def]
        return torch.log_softmax(F.linear(hidden, weight, b).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)

    want, got = per_token(plain, *args), per_token(micro_loss.token_logprobs, *args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # Control: one shifted target changes that token's log-probability alone.
    hidden, weight, b, targets = args
    wrong = torch.where(torch.arange(T) == T - 1, (targets + 1) % V, targets)
    with torch.no_grad():
        right, moved = (
            micro_loss.token_logprobs(hidden, weight, targets, b),
            micro_loss.token_logprobs(hidden, weight, wrong, b),
        )
    assert torch.equal(moved[:-1], right[:-1]) and moved[-1] != right[-1]
    # SFT's loss off CUDA is minus their sum, gradients and all.
    sft = _loss_and_grads(micro_loss.linear_cross_entropy, *args)
    summed = _loss_and_grads(lambda *a: -micro_loss.token_logprobs(*a).sum(), *args)
    assert torch.equal(sft[0], summed[0]) and all(torch.equal(x, y) for x, y in zip(sft[1], summed[1], strict=True))


def test_frozen_head_gets_no_weight_gradient_and_eval_needs_none() -> None:
    hidden, weight, _, targets = _inputs(torch.float32, bias=False)
    weight.requires_grad_(False)
    loss = micro_loss.linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        again = micro_loss.linear_cross_entropy(hidden, weight, targets)
    assert again.grad_fn is None and torch.equal(again, loss.detach())
    # No labelled token in a micro-batch: zero loss, and backward still runs.
    empty = micro_loss.linear_cross_entropy(hidden[:0], weight, targets[:0])
    empty.backward()
    assert float(empty.detach()) == 0.0


def _peft(path: Path, **adapter: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return model_lib.build(ModelConfig(name_or_path=str(path), dtype="float32"), AdapterConfig(**adapter))  # type: ignore[arg-type]


def test_heads_the_fused_loss_cannot_compute_are_refused(tiny_llama: Path) -> None:
    from trainer.training.batches import micro_batch

    ids = torch.randint(4, 100, (1, 12))
    micro = micro_batch(ids, ids.clone(), torch.arange(12)[None])
    lora_head = _peft(tiny_llama, target_modules=("q_proj", "lm_head"), dropout=0.0)
    with pytest.raises(ValueError, match="Remove lm_head from adapter.target_modules"):
        micro_loss.token_loss_sum(lora_head, micro)
    model = _peft(tiny_llama, dropout=0.0)
    micro_loss.token_loss_sum(model, micro)  # control: the same micro-batch through a plain head
    model.get_base_model().config.final_logit_softcapping = 30.0  # what Gemma 2 sets
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        micro_loss.token_loss_sum(model, micro)


def test_adapters_compute_in_the_autocast_dtype(tiny_llama: Path) -> None:
    """Under autocast a LoRA layer takes the bf16 activation as it is (no fp32 copy), while its
    weights stay fp32 for the optimizer; without the switch peft up-casts (the control)."""
    cfg = ModelConfig(name_or_path=str(tiny_llama), dtype="bfloat16")
    seen: dict[bool, torch.dtype] = {}
    for autocast in (True, False):
        model = model_lib.build(cfg, AdapterConfig(dropout=0.0), autocast=autocast)
        lora_a = next(m for n, m in model.named_modules() if n.endswith("q_proj.lora_A.default"))
        assert lora_a.weight.dtype == torch.float32
        lora_a.register_forward_pre_hook(lambda m, a, key=autocast: seen.__setitem__(key, a[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=torch.randint(4, 100, (1, 8)), use_cache=False)
    assert seen == {True: torch.bfloat16, False: torch.float32}


def test_compile_wraps_every_decoder_layer(tiny_llama: Path) -> None:
    model = _peft(tiny_llama, dropout=0.0)
    assert model_lib.compile_layers(model) == 2
    layers = micro_loss.causal_lm(model).get_decoder().layers
    assert all(layer._compiled_call_impl is not None for layer in layers)


def test_attention_choice_is_explicit() -> None:
    cpu = torch.device("cpu")
    assert model_lib.resolve_attn_implementation("auto", cpu) == "sdpa"
    assert model_lib.resolve_attn_implementation("spotune_varlen", cpu) == "spotune_varlen"
    from transformers import AttentionInterface

    assert "spotune_varlen" in AttentionInterface._global_mapping


def test_meter_mfu_is_the_published_count() -> None:
    """run.py's FLOP count is trainer/model/flops.py's `MFU` count (what published LoRA figures use:
    head at every token); the LoRA-aware count (head at labelled tokens only) sits beside it."""
    from transformers import LlamaConfig

    from trainer.model import flops

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=500
    )
    shape = flops.model_shape(config)
    fn = flops.meter_flops_fn(config, trainable=1000)
    assert fn is not None
    assert fn(800, 9e4, 300) == flops.frozen_base_flops(shape, 800, 9e4) == fn(800, 9e4, 800)
    # Control: the LoRA-aware count of the same work is another number.
    lora_aware = flops.train_flops(shape, 800, 9e4, shape.matmul_params(), 1000, head_tokens=300)
    assert fn(800, 9e4, 300) != lora_aware
