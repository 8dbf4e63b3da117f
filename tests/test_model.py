"""trainer/model/load.py: LoRA over a frozen base, QLoRA 4-bit on CPU, activation checkpointing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from trainer.config import AdapterConfig, ModelConfig
from trainer.model.load import build, count_params, resolve_attn_implementation


def _ids() -> torch.Tensor:
    return torch.randint(4, 500, (2, 32), generator=torch.Generator().manual_seed(0))


def _base_params(path: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_trains_only_adapters_in_fp32(tiny_model: Callable[..., Path], arch: str) -> None:
    path = tiny_model(arch)
    model = build(ModelConfig(name_or_path=str(path), dtype="bfloat16"), AdapterConfig(r=4))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values()), "adapters stay fp32 over a bf16 base"
    frozen_dtypes = {p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen_dtypes == {torch.bfloat16}
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    counts = count_params(model)
    assert counts.trainable == sum(p.numel() for p in trainable.values())
    assert counts.frozen == _base_params(path)


def test_target_modules_subset_and_error(tiny_llama: Path) -> None:
    model = build(
        ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(target_modules=("q_proj", "v_proj"))
    )
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".q_proj." in n or ".v_proj." in n for n in names)
    with pytest.raises(ValueError, match="adapter.target_modules"):
        build(
            ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(target_modules=("no_such_proj",))
        )


def test_qlora_4bit_quantises_the_base_on_cpu(tiny_llama: Path) -> None:
    import bitsandbytes as bnb

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="bfloat16"), AdapterConfig(method="qlora", r=4))
    linears4 = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears4) == 2 * 7, "every block linear of both layers is 4-bit"
    q = linears4[0].weight.quant_state
    assert q.quant_type == "nf4" and q.nested, "NF4 with double quantisation"
    assert count_params(model).frozen == _base_params(tiny_llama), "4-bit weights count at their logical size"
    out = model(input_ids=_ids(), use_cache=False).logits
    out.float().sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


_PLAIN_THEN_QUANTISED = """
import sys
from trainer.config import AdapterConfig, ModelConfig
from trainer.model.load import build

build(ModelConfig(name_or_path=sys.argv[1], dtype="float32"), AdapterConfig(r=4))
print("plain", "bitsandbytes" in sys.modules)
model = build(ModelConfig(name_or_path=sys.argv[1], dtype="bfloat16"), AdapterConfig(method="qlora", r=4))
lora4 = [m for m in model.modules() if type(m).__module__ == "peft.tuners.lora.bnb" and type(m).__name__ == "Linear4bit"]
print("quantised", "bitsandbytes" in sys.modules, len(lora4))
"""


def test_plain_lora_never_imports_bitsandbytes_and_a_quantised_base_after_it_gets_its_layers(tiny_llama: Path) -> None:
    """In a fresh process (this one may have imported bitsandbytes for another test): plain LoRA
    starts without bitsandbytes (1 s of CPU on each restart), and the 4-bit build that follows in
    the same process still gets peft's 4-bit LoRA layers, which peft's cached "bitsandbytes is
    absent" would refuse. "quantised True" is the control: the check sees bitsandbytes once loaded."""
    out = subprocess.run(
        [sys.executable, "-c", _PLAIN_THEN_QUANTISED, str(tiny_llama)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.splitlines()
    assert out == ["plain False", "quantised True 14"], out  # 2 layers x 7 block linears


def test_activation_checkpointing_gives_the_same_gradients(tiny_llama: Path) -> None:
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = build(
            ModelConfig(name_or_path=str(tiny_llama), dtype="float32", gradient_checkpointing=checkpointing),
            AdapterConfig(r=4, dropout=0.0),
        )
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
        model.train()
        assert model.base_model.model.is_activation_checkpointing == checkpointing
        model(input_ids=_ids(), use_cache=False).logits.sum().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain, recomputed = grads(False), grads(True)
    assert all(g.abs().sum() > 0 for n, g in plain.items() if "lora_A" in n), "control: A gets a gradient"
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name


def test_attention_choice() -> None:
    assert resolve_attn_implementation("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attn_implementation("eager", torch.device("cpu")) == "eager"


ADAPTED = {
    "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},  # Phi-4 fuses q/k/v and gate/up
    "gemma3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
}


@pytest.mark.parametrize("arch", sorted(ADAPTED))
def test_the_recipes_newer_families_train_with_lora_on_the_decoder_only(
    tiny_model: Callable[..., Path], tiny_data: Path, tmp_path: Path, arch: str
) -> None:
    """Qwen3, Phi-4 (Phi3ForCausalLM) and Gemma 3 (an image-text model) through `spotune train` on packed
    rows: every linear layer of the decoder adapted (the recipes' all-linear), nothing outside it."""
    from safetensors.torch import load_file

    from trainer import config as C
    from trainer.training import run

    path = tiny_model(arch)
    out = tmp_path / arch
    overrides = {
        "output_dir": str(out),
        "model.name_or_path": str(path),
        "model.dtype": "float32",
        "data.path": str(tiny_data),
        "data.seq_len": 128,
        "train.max_steps": 2,
        "train.micro_batch_size": 2,
        "metrics.progress": False,
        "metrics.report": False,
        "checkpoint.every_minutes": None,
    }
    assert run.train(C.RunConfig().replace(**overrides)) == 0
    keys = load_file(out / "final" / "adapter_model.safetensors").keys()
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys}
    assert adapted == ADAPTED[arch], sorted(keys)[:6]
    assert not any("vision" in k or "projector" in k for k in keys)
    if arch == "gemma3":  # the control: peft's own all-linear on this model reaches the vision tower
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        plain = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(r=4, target_modules="all-linear"))
        assert any("vision_tower" in n for n, p in plain.named_parameters() if p.requires_grad)
