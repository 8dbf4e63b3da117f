"""`model.compile`: each decoder layer compiled after peft wrapping gives the loss and LoRA
gradients of the eager model, on packed rows, with sdpa and with spotune_varlen (the latter
also with `adapter.fused`, whose view the compiled layers trace)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.config import AdapterConfig, ModelConfig
from trainer.model import load as model_lib
from trainer.model.loss import token_loss_sum
from trainer.training.batches import micro_batch

# fp32 on CPU: inductor fuses and reorders the norms' and activations' reductions, so the
# results agree to rounding, not bit for bit: each gradient to 1e-5 of its largest entry
# (measured 6e-7 with adapter.fused, whose [T x 3r] matmul blocks its sums differently too).
REL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= REL * b.abs().max())


def _packed(seed: int = 0) -> dict[str, Any]:
    ids = torch.randint(4, 100, (2, 24), generator=torch.Generator().manual_seed(seed))
    # Row 0: documents of 10, 9 and 5 tokens; row 1: 16 and 8.
    pos = torch.stack(
        [
            torch.cat([torch.arange(10), torch.arange(9), torch.arange(5)]),
            torch.cat([torch.arange(16), torch.arange(8)]),
        ]
    )
    return micro_batch(ids, ids.clone(), pos)


def _loss_and_grads(
    path: Path, attn: str, compile: bool, micro: dict[str, Any], fused: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same LoRA initialisation on both sides
    cfg = ModelConfig(name_or_path=str(path), dtype="float32", attn_implementation=attn, compile=compile)
    model = model_lib.build(cfg, AdapterConfig(r=8, dropout=0.0, fused=fused))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, where A's gradient is zero too: make both count
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    loss = token_loss_sum(model, micro)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize(("attn", "fused"), [("sdpa", False), ("spotune_varlen", True)])
def test_compiled_layers_give_the_eager_loss_and_grads(tiny_llama: Path, attn: str, fused: bool) -> None:
    torch._dynamo.reset()
    micro = _packed()
    eager_loss, eager = _loss_and_grads(tiny_llama, attn, False, micro)
    compiled_loss, compiled = _loss_and_grads(tiny_llama, attn, True, micro, fused)
    assert model_lib.compile_seconds() > 0  # it did compile; the run's last words say for how long
    from types import SimpleNamespace

    from trainer.training.telemetry import Telemetry

    run = SimpleNamespace(last=None, final_loss=1.0, ledger=SimpleNamespace(device="cpu"))
    summary = {"cost": None, "sustained_tokens_per_s": 1.0, "device_hours": 0.0}
    assert "torch.compile: " in Telemetry.final_summary(run, "finished", 1, summary, Path("missing"))  # type: ignore[arg-type]
    assert _close(compiled_loss, eager_loss)
    assert eager.keys() == compiled.keys() and len(eager) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
    assert all(_close(compiled[name], eager[name]) for name in eager)
    # Control: the same rows with the document bounds moved give gradients outside the tolerance.
    ids = micro["input_ids"].reshape(2, 24)
    moved = micro_batch(ids, ids.clone(), torch.arange(24).repeat(2, 1))
    _, other = _loss_and_grads(tiny_llama, attn, False, moved)
    assert not all(_close(other[name], eager[name]) for name in eager)
