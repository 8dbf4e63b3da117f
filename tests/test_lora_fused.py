"""`adapter.fused`: q/k/v's and gate/up's LoRA A matmuls as one wider matmul each give peft's
loss and gradients, and the adapter files peft writes without it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trainer.config import AdapterConfig, ModelConfig
from trainer.model import load as model_lib
from trainer.model import lora_fused
from trainer.model.loss import token_loss_sum
from trainer.training.batches import micro_batch

# fp32 on CPU: one [T x 3r] matmul against three [T x r] ones, whose sums BLAS blocks differently
# (measured: at most 8e-7 of a gradient's largest entry). Each gradient must agree to 1e-5 of it.
REL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= REL * b.abs().max())


def _packed() -> dict[str, Any]:
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.cat([torch.arange(16), torch.arange(8)])])
    return micro_batch(ids, ids.clone(), pos)


def _build(path: Path, fused: bool, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)  # the same LoRA initialisation on both sides
    model = model_lib.build(
        ModelConfig(name_or_path=str(path), dtype="float32"), AdapterConfig(r=8, dropout=dropout, fused=fused)
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where A's gradient is zero too: make both count
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def _loss_and_grads(model: torch.nn.Module, micro: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = token_loss_sum(model, micro)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _groups(model: torch.nn.Module) -> list[Any]:
    return list({id(m.group): m.group for m in model.modules() if isinstance(m, lora_fused.FusedA)}.values())


def test_fused_lora_gives_peft_loss_and_grads(tiny_llama: Path) -> None:
    micro = _packed()
    plain_loss, plain = _loss_and_grads(_build(tiny_llama, False), micro)
    fused_model = _build(tiny_llama, True)
    groups = _groups(fused_model)
    assert len(groups) == 2 * 2  # q/k/v and gate/up in each of 2 layers
    fused_loss, fused = _loss_and_grads(fused_model, micro)
    assert sum(g.hits for g in groups) == 2 * (2 + 1)  # k, v and up took their slice in both layers
    assert _close(fused_loss, plain_loss)
    assert fused.keys() == plain.keys()  # the same parameter names, so the same optimizer slots
    assert all(_close(fused[name], plain[name]) for name in plain)
    # Control: one A row changed on the fused side moves the gradients outside the tolerance.
    with torch.no_grad():
        next(m for m in fused_model.modules() if isinstance(m, lora_fused.FusedA) and m.index == 1).weight[0] += 0.1
    fused_model.zero_grad()
    _, moved = _loss_and_grads(fused_model, micro)
    assert not all(_close(moved[name], plain[name]) for name in plain)


def test_fused_adapter_files_are_plain_peft(tiny_llama: Path, tmp_path: Path) -> None:
    plain, fused = _build(tiny_llama, False), _build(tiny_llama, True)
    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("plain", "fused"))
    assert a.keys() == b.keys() and any(".q_proj.lora_A." in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "plain" / "adapter_config.json").read_text() == (
        tmp_path / "fused" / "adapter_config.json"
    ).read_text()


def test_with_dropout_each_projection_computes_its_own(tiny_llama: Path) -> None:
    """peft draws one dropout mask per projection, so the siblings' inputs differ: no slice is
    handed on, and the result is peft's own computation."""
    model = _build(tiny_llama, True, dropout=0.1)
    model.train()
    token_loss_sum(model, _packed()).backward()
    assert sum(g.hits for g in _groups(model)) == 0
