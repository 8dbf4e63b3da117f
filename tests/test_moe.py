"""Mixture-of-experts models under LoRA (trainer/model/experts.py): every family transformers 5 ships with fused
experts trains LoRA on its routed experts (never silently untrained), the router stays frozen unless asked, and the
per-token expert kernel computes what peft's ParamWrapper computes, saved in peft's layout: peft loads it back to
the same logits, and the merged export gives them too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer import builtin_assets
from trainer.config import AdapterConfig, ConfigError, ModelConfig
from trainer.model import experts, load

FAMILIES = builtin_assets.MOE_ARCHES


def _build(path: Path, notes: list[str] | None = None, **adapter: Any) -> Any:
    return load.build(ModelConfig(name_or_path=str(path), dtype="float32"), AdapterConfig(**adapter), notes=notes)


def _randomise_adapter(model: torch.nn.Module, seed: int = 1) -> None:
    """LoRA B starts at zero (the adapter is then a no-op, and any layout would agree): give every factor values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _ids(n: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 200, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float() ** 2).mean().backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.fixture(scope="module")
def moe_model(tiny_model: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda arch: tiny_model(arch)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_trains_its_experts_with_all_linear_and_dropout(
    moe_model: Callable[[str], Path], arch: str
) -> None:
    """`all-linear` with the default dropout (peft's ParamWrapper refuses any dropout) trains every routed expert
    projection and the attention; the routers carry no adapter; the log says how many expert weights train."""
    notes: list[str] = []
    model = _build(moe_model(arch), notes)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    found = experts.find(model)
    assert found.experts and found.routers
    for name in found.expert_parameters():  # every routed expert Parameter of every layer carries an adapter
        wrapper = model.get_submodule(name.rpartition(".")[0].replace(".base_layer", ""))
        assert any(n.startswith(name.rpartition(".")[0]) and "lora_B" in n for n in trainable), name
        assert hasattr(wrapper, "lora_A")
    for router in found.routers:
        assert not any(n.startswith(f"base_model.model.{router}.") for n in trainable), router
    assert any("self_attn" in n for n in trainable)
    assert any("routed-expert" in n and "trainable adapter parameters" in n for n in notes), notes
    assert any("adapter.dropout=0.05 applies to" in n for n in notes), notes
    model.train()
    logits, grads = _logits_and_grads(model, _ids())
    assert torch.isfinite(logits).all()
    expert_b = [g for n, g in grads.items() if "experts" in n and "lora_B" in n]
    assert expert_b and all(g.abs().sum() > 0 for g in expert_b)  # every expert projection's LoRA learns


def test_router_is_frozen_unless_asked(moe_model: Callable[[str], Path]) -> None:
    model = _build(moe_model("qwen2_moe"), train_router=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".mlp.gate." in n for n in trainable)  # the top-k router (a 2-D Parameter)
    assert any(".shared_expert_gate." in n for n in trainable)  # Qwen2-MoE's shared-expert gate (a Linear)


def test_experts_left_untrained_are_refused_by_name(moe_model: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError) as e:
        _build(moe_model("qwen3_moe"), target_modules=("q_proj", "v_proj"))
    text = str(e.value)
    assert "model.layers.0.mlp.experts.gate_up_proj" in text and "routed experts" in text
    assert "all-linear" in text and "gate_up_proj and down_proj" in text
    # naming the dense per-expert projections selects the fused ones
    model = _build(moe_model("qwen3_moe"), target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"))
    assert any("experts.lora_B" in n or "experts.base_layer.lora_B" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_expert_kernel_equals_peft_and_loads_back_in_peft(
    moe_model: Callable[[str], Path], arch: str, tmp_path: Path
) -> None:
    """The per-token kernel (grouped_mm and the loop) gives peft's ParamWrapper outputs and gradients on the same
    adapter; the adapter it saves, loaded by `PeftModel.from_pretrained`, is that peft model. gpt-oss: transposed
    expert weights with biases; DeepSeek-V3: shared experts and a dense first layer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = moe_model(arch)
    ours = _build(path, dropout=0.0).eval()
    _randomise_adapter(ours)
    ours.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapter"), is_trainable=True).eval()
    assert not any(type(m) is experts.expert_lora_class() for m in theirs.modules())  # peft's own ParamWrapper
    ids = _ids()
    want, want_grads = _logits_and_grads(theirs, ids)
    for grouped in (True, False):
        for m in ours.modules():
            if type(m) is experts.expert_lora_class():
                m.use_grouped_mm = grouped
        got, got_grads = _logits_and_grads(ours, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_expert_major_rank_major_mixup_is_caught(moe_model: Callable[[str], Path], tmp_path: Path) -> None:
    """The control: the same adapter with lora_B laid out expert-major (as a kernel that stored its own layout
    would save it) loads without error and gives other logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = moe_model("qwen3_moe")
    ours = _build(path, dropout=0.0).eval()
    _randomise_adapter(ours)
    ours.save_pretrained(tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_model.safetensors"
    weights = load_file(file)
    experts_n = 8
    for key in [k for k in weights if "experts" in k and "lora_B" in k]:
        b = weights[key]  # [out, r * experts], rank-major
        weights[key] = b.reshape(b.shape[0], -1, experts_n).transpose(1, 2).reshape(b.shape[0], -1).contiguous()
    save_file(weights, file)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    mixed = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = _ids()
    with torch.no_grad():
        assert not torch.allclose(mixed(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-3, atol=1e-3)


def test_merged_export_equals_the_adapter(moe_model: Callable[[str], Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from trainer.serve.export import merge_adapter

    path = moe_model("mixtral")
    ours = _build(path, dropout=0.0).eval()
    _randomise_adapter(ours)
    ours.save_pretrained(tmp_path / "adapter")
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", ModelConfig(name_or_path=str(path), dtype="float32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert not torch.allclose(base(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-3)  # control


def test_kernel_choice_is_grouped_mm_where_it_runs() -> None:
    choice, why = experts.kernel("cpu", torch.float32)
    has = hasattr(torch.nn.functional, "grouped_mm")
    assert (choice == experts.GROUPED) == has, why
