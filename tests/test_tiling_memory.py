"""The memory arithmetic of trainer/plan/memory.py against a real-shaped Llama-3.1-8B decoder layer
(hidden 4096, intermediate 14336, 32 heads, 8 kv heads, bf16, LoRA r32 on every linear) on the
meta device: what autograd saves, what the layer allocates at its peak, and its parameters, at
sequence lengths up to 512k tokens without computing anything (tests/layer_memory.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from layer_memory import LLAMA_8B, TARGETS, LiveBytes, layer, peak_bytes, run, saved_bytes

from trainer.model import flops
from trainer.plan import memory

SHAPE = flops.model_shape(transformers.LlamaConfig(**LLAMA_8B))
TILE = 8192
A = 2  # bf16


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("seq", [4096, 65536, 524288])
def test_saved_bytes_are_the_estimates_activation_terms(seq: int, checkpointing: bool, tiled: bool) -> None:
    block = layer(seq, tile=TILE if tiled else None)
    forward, shared = run(block, seq, checkpointing)
    measured = saved_bytes(forward, shared)
    if checkpointing:  # the layer's input only (what activation offloading moves to the host)
        expected = A * SHAPE.hidden * seq
    else:
        expected = seq * memory.layer_activation_bytes_per_token(
            SHAPE, A, 32, TARGETS, False, tiled_mlp=tiled and seq > TILE, attention_output_copy=False
        )
    assert abs(measured / expected - 1) <= 0.02, (measured / seq, expected / seq)
    if tiled and not checkpointing and seq > TILE:  # control: the untiled MLP's term would miss
        untiled = seq * memory.layer_activation_bytes_per_token(
            SHAPE, A, 32, TARGETS, False, attention_output_copy=False
        )
        assert untiled / measured > 2


def test_parameters_adapter_and_optimizer_terms_are_the_modules_tensors() -> None:
    block = layer(1024)
    base = sum(p.numel() * p.element_size() for n, p in block.named_parameters() if "lora_" not in n)
    assert base == memory.layer_weight_bytes(SHAPE, "bfloat16")
    lora = [p for n, p in block.named_parameters() if "lora_" in n]
    assert sum(p.numel() for p in lora) == flops.lora_params(SHAPE, 32, TARGETS)  # SHAPE has one layer
    adapters = [torch.nn.Parameter(torch.empty_like(p, dtype=torch.float32)) for p in lora]  # kept in fp32
    for p in adapters:
        p.grad = torch.empty_like(p)
    opt = torch.optim.AdamW(adapters, foreach=False)
    opt.step()
    moments = sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == memory.optimizer_bytes_per_param("adamw") * flops.lora_params(SHAPE, 32, TARGETS)
    # (AdamW also keeps a one-element `step` tensor per parameter: 14 x 4 bytes, left out of the estimate.)


def test_peak_grows_linearly_and_the_tiled_mlp_is_bounded_by_its_tile() -> None:
    seqs = (65536, 131072, 262144)
    for tiled in (False, True):
        peaks = [peak_bytes(run(layer(s, tile=TILE if tiled else None), s, checkpointing=True)[0]) for s in seqs]
        slopes = [(peaks[1] - peaks[0]) / (seqs[1] - seqs[0]), (peaks[2] - peaks[1]) / (seqs[2] - seqs[1])]
        assert slopes[0] == slopes[1]  # linear in the sequence: no term grows faster
        if tiled:
            tiled_slope = slopes[0]
        else:
            untiled_slope = slopes[0]
    # Per token, the layer's peak with tiling is the estimate's (the norm's backward phase, output
    # and incoming gradient beside it) within 2%; untiled, the MLP's intermediate makes it 1.6x.
    recompute = memory.layer_activation_bytes_per_token(SHAPE, A, 32, TARGETS, False, 0, True, False)
    estimated = recompute + memory.norm_backward_bytes(SHAPE, A, 1) + A * SHAPE.hidden
    assert abs(tiled_slope / estimated - 1) <= 0.02, (tiled_slope, estimated)
    assert untiled_slope / tiled_slope > 1.5
    # The MLP alone: what grows with the sequence is its output, the incoming gradient, the input
    # gradient and its copy into x.grad (x is a leaf here), all tokens x hidden; the
    # [tokens x intermediate] tensors exist for one tile at a time.
    for seq in seqs[:2]:
        for tile in (TILE, None):
            mlp = layer(seq, tile=tile).mlp
            x = torch.empty(1, seq, SHAPE.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
            with LiveBytes() as mode:
                out = mlp(x)
                out.backward(torch.empty_like(out))
                del out
            beyond = mode.peak - 4 * A * seq * SHAPE.hidden
            if tile:
                assert beyond <= 8 * A * TILE * SHAPE.intermediate
            else:  # control: untiled, four [tokens x intermediate] tensors and more
                assert beyond > 4 * A * seq * SHAPE.intermediate
