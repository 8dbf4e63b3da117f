"""The memory arithmetic of trainer/plan/memory.py and activations.py against a real-shaped
Llama-3.1-8B decoder layer (hidden 4096, intermediate 14336, 32 heads, 8 kv heads, bf16, LoRA r32 on
every linear) on the meta device: what autograd saves, what the layer allocates at its peak, and its
parameters, at sequence lengths up to 512k tokens without computing anything (tests/layer_memory.py).
"Tiled" is `model.tiled_mlp=on`: the norms and the MLP in tiles (trainer/model/tiling.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from layer_memory import LLAMA_8B, TARGETS, LiveBytes, layer, peak_bytes, run, saved_bytes
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from trainer.model import flops, tiling
from trainer.plan import activations, memory

SHAPE = flops.model_shape(transformers.LlamaConfig(**LLAMA_8B))
MODEL = flops.model_shape(transformers.LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": 32}))
TILE = 8192
A = 2  # bf16
FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _per_token(seq: int, tiled: bool) -> float:
    return memory.act.layer_activation_bytes_per_token(
        SHAPE, A, 32, TARGETS, False, tiled_mlp=tiled and seq > TILE, attention_output_copy=False
    )


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
        expected = seq * _per_token(seq, tiled)
    assert abs(measured / expected - 1) <= 0.02, (measured / seq, expected / seq)
    if tiled and not checkpointing and seq > TILE:  # control: the untiled terms would miss by 4x
        assert seq * _per_token(seq, False) / measured > 4


def test_the_offloaded_and_in_flight_terms_are_the_measured_layer_and_final_norm() -> None:
    """32 layers, checkpointed, offloaded, tiled, 512k tokens: the host keeps 30 layers' saved
    inputs and the final norm's, the device two layers' (trainer/model/offload.py)."""
    seq = 524288
    layer_saved = saved_bytes(*run(layer(seq, tile=TILE), seq, checkpointing=True))
    with torch.device("meta"):
        norm = LlamaRMSNorm(SHAPE.hidden).to(torch.bfloat16)
    tiling.tile_in_place(norm, TILE)
    x = torch.empty(1, seq, SHAPE.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    norm_saved = saved_bytes(lambda: norm(x), list(norm.parameters()))
    assert norm_saved == A * SHAPE.hidden * seq  # its input only: no fp32 copy (untiled: 3x that)
    est = memory.estimate_memory(**_kwargs(seq), tiled_mlp=True)
    assert est.offloaded == 30 * layer_saved + norm_saved
    assert est.activations == 2 * layer_saved
    untiled = memory.estimate_memory(**_kwargs(seq), tiled_mlp=False)
    assert untiled.offloaded - est.offloaded == 4 * SHAPE.hidden * seq  # control: untiled, the fp32 copy


def _kwargs(seq: int) -> dict[str, Any]:
    return dict(
        shape=MODEL,
        weight_format="nf4",
        compute_dtype="bfloat16",
        lora_params=flops.lora_params(MODEL, 32, TARGETS),
        lora_r=32,
        target_modules=TARGETS,
        lora_dropout=False,
        optimizer="adamw",
        micro_batch_size=1,
        seq_len=seq,
        gradient_checkpointing=True,
        activation_offload=True,
        attention_output_copy=False,
    )


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


def _slope(values: list[int], seqs: tuple[int, ...]) -> float:
    slopes = {(values[k + 1] - values[k]) / (seqs[k + 1] - seqs[k]) for k in range(len(seqs) - 1)}
    assert len(slopes) == 1, slopes  # linear in the sequence: no term grows faster
    return slopes.pop()


def test_the_tiled_layers_peak_grows_linearly_as_estimated() -> None:
    """A checkpointed layer's forward and backward at 128k, 256k and 512k tokens. Tiled, its peak per
    token is the recomputed layer's saved tensors plus o_proj's backward (activations.py), and at
    the attention kernel's backward the same plus dq, dk, dv (without the CUDA kernel's workspace,
    which the meta device does not run); untiled, the MLP's intermediates make it 3x."""
    seqs = (131072, 262144, 524288)
    runs = [peak_bytes(run(layer(s, tile=TILE), s, checkpointing=True)[0], FLASH_BACKWARD) for s in seqs]
    peak, at_attention = _slope([p for p, _ in runs], seqs), _slope([m for _, m in runs], seqs)
    recomputed = _per_token(seqs[0], True) - A * SHAPE.hidden  # its input is the checkpoint's (made outside)
    estimated = recomputed + activations.o_proj_backward_bytes_per_token(SHAPE, A, TARGETS)
    assert abs(peak / estimated - 1) <= 0.02, (peak, estimated)
    attention = recomputed + activations.attention_backward_bytes_per_token(SHAPE, A, kernel_workspace=False)
    assert abs(at_attention / attention - 1) <= 0.02, (at_attention, attention)
    estimate_tokens = activations.layer_backward_bytes(SHAPE, A, seqs[0], TARGETS, 0.0, TILE, False) / seqs[0]
    assert estimate_tokens == max(estimated, attention) - recomputed
    untiled = [peak_bytes(run(layer(s), s, checkpointing=True)[0])[0] for s in seqs[:2]]
    assert _slope(untiled, seqs[:2]) / peak > 3  # control: untiled, the slope is far steeper


def test_the_tiled_mlp_and_its_norm_are_bounded_by_a_tile() -> None:
    """What grows with the sequence in the tiled norm + MLP unit is its output, the incoming
    gradient, the input gradient and its copy into x.grad (x is a leaf here), all tokens x hidden;
    the [tokens x intermediate] tensors and the norm's fp32 copies exist for one tile at a time."""
    for seq in (65536, 131072):
        for tile in (TILE, None):
            unit = layer(seq, tile=tile).mlp
            x = torch.empty(1, seq, SHAPE.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
            with LiveBytes() as mode:
                out = unit(x)
                out.backward(torch.empty_like(out))
                del out
            beyond = mode.peak - 4 * A * seq * SHAPE.hidden
            if tile:
                assert isinstance(unit.inner, tiling.NormThenMLP)
                assert beyond <= 8 * A * TILE * SHAPE.intermediate
            else:  # control: untiled, four [tokens x intermediate] tensors and more
                assert beyond > 4 * A * seq * SHAPE.intermediate
