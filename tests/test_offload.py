"""trainer/model/offload.py: with activation offloading on, loss and gradients are bit-identical to off.

CPU runs the same saved-tensor hooks as CUDA (copies into separate host tensors instead of
pinned memory on a side stream), so these tests exercise the code path the GPU uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.config import AdapterConfig, ModelConfig
from trainer.model import offload
from trainer.model.load import build
from trainer.model.loss import token_loss_sum
from trainer.training.batches import micro_batch, to_device


def _micro() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 500, (2, 48), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100  # a masked prompt
    pos = torch.cat([torch.arange(20), torch.arange(28)]).repeat(2, 1)  # two documents per row
    return micro_batch(ids, labels, pos)


def _loss_and_grads(
    path: Path, offload_mode: str, corrupt: bool = False, device: str = "cpu", checkpointing: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model_cfg = ModelConfig(
        name_or_path=str(path), dtype="float32", gradient_checkpointing=checkpointing, activation_offload=offload_mode
    )
    model = build(model_cfg, AdapterConfig(r=4, dropout=0.1), device=device)  # dropout: recomputation replays masks
    model.to(device).train()
    if corrupt:  # control: a hook that changes what comes back must change the gradients
        off = model.spotune_offload
        plain_unpack = off.unpack

        def unpack(item: Any) -> torch.Tensor:
            t = plain_unpack(item)
            return t * (1 + 1e-3) if t.is_floating_point() else t

        off.unpack = unpack  # type: ignore[method-assign]
    torch.manual_seed(1)
    loss = token_loss_sum(model, to_device(_micro(), torch.device(device)))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("checkpointing", [True, False])
def test_offloading_leaves_loss_and_gradients_bit_identical(tiny_llama: Path, checkpointing: bool) -> None:
    """Every saved tensor comes back as it went, with checkpointing (the layer inputs move) and without (every
    activation moves). Two tensors of one shape that live one after the other in the same memory (a layer's
    input freed once it is copied, the next layer's input allocated there) are two tensors, not one saved
    twice: before, the second got the first's copy back and the gradients changed from run to run."""
    loss_off, grads_off = _loss_and_grads(tiny_llama, "off", checkpointing=checkpointing)
    for _ in range(3):  # the allocator's reuse varies from run to run
        loss_on, grads_on = _loss_and_grads(tiny_llama, "on", checkpointing=checkpointing)
        assert torch.equal(loss_on, loss_off)
        assert grads_on.keys() == grads_off.keys() and grads_on
        for name in grads_off:
            assert torch.equal(grads_on[name], grads_off[name]), name
    # Control: the same test fails when the hooks hand back anything else.
    _, grads_bad = _loss_and_grads(tiny_llama, "on", corrupt=True, checkpointing=checkpointing)
    assert any(not torch.equal(grads_bad[n], grads_off[n]) for n in grads_off)


def test_checkpointed_layer_inputs_are_what_moves(tiny_llama: Path) -> None:
    """With checkpointing, the saved tensors outside the recomputed layers are the layer inputs:
    one [B*S, hidden] fp32 tensor per layer (what the memory estimate's `offloaded` counts), and
    the final norm's input, saved twice by RMSNorm and copied once."""
    model = build(
        ModelConfig(
            name_or_path=str(tiny_llama), dtype="float32", gradient_checkpointing=True, activation_offload="on"
        ),
        AdapterConfig(r=4, dropout=0.0),
    )
    model.train()
    off: offload.ActivationOffload = model.spotune_offload
    cfg = model.get_base_model().config
    micro = _micro()
    token_loss_sum(model, micro).backward()
    layer_input = micro["input_ids"].numel() * cfg.hidden_size * 4
    assert off.offloaded_bytes == (cfg.num_hidden_layers + 1) * layer_input
    assert all(item is None for item in off.saved)  # backward took every one back
    with torch.no_grad():  # evaluation saves nothing and moves nothing
        token_loss_sum(model, micro)


def test_hooks_do_not_leak_when_the_forward_raises(tiny_llama: Path) -> None:
    model = build(
        ModelConfig(
            name_or_path=str(tiny_llama), dtype="float32", gradient_checkpointing=True, activation_offload="on"
        ),
        AdapterConfig(r=4, dropout=0.0),
    )
    bad = dict(_micro(), input_ids=torch.full((2, 48), 10**6))  # an out-of-range token id
    with pytest.raises(IndexError):
        token_loss_sum(model, bad)
    x = torch.ones(4, requires_grad=True)
    y = (x * x).sum()  # saved here must not go through the offloader
    before = model.spotune_offload.offloaded_bytes
    y.backward()
    assert model.spotune_offload.offloaded_bytes == before and torch.equal(x.grad, 2 * torch.ones(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offloading_on_cuda_is_bit_identical(tiny_llama: Path) -> None:
    """The CUDA path: pinned host copies on a side stream, prefetched ahead of the backward."""
    loss_off, grads_off = _loss_and_grads(tiny_llama, "off", device="cuda")
    loss_on, grads_on = _loss_and_grads(tiny_llama, "on", device="cuda")
    assert torch.equal(loss_on, loss_off)
    for name in grads_off:
        assert torch.equal(grads_on[name], grads_off[name]), name
    _, grads_bad = _loss_and_grads(tiny_llama, "on", corrupt=True, device="cuda")
    assert any(not torch.equal(grads_bad[n], grads_off[n]) for n in grads_off)
