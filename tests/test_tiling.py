"""trainer/model/tiling.py: the MLP and the norms in sequence tiles give the untiled loss and gradients.

CPU fp32, a tiny Llama with LoRA (random A and B, so every adapter gradient is non-zero) on every
linear. What is bit-identical and why: the loss, and each tiled unit's output and input gradient
(the input norm, the post-attention norm fused with the MLP, the final norm), because each row of
a tile goes through the same matmuls and row reductions as in the untiled module
(row-independent); so are the last layer's attention gradients, which only those reach. The MLP's
own LoRA gradients are sums over every token: the tiled path sums the tiles' parts in tile order,
the untiled matmul in its own blocking, so they agree to rounding (checked against the untiled
fp32 and an fp64 reference), not bit for bit. So do the attention gradients of the layers below
the last: in fp32 the norm's upcast is a no-op, so untiled, autograd adds three gradients into
the layer's input (the residual's, and the norm's through its square and through its product)
where tiled it adds two (the residual's and the tiled norm's, already the sum of the other two):
the same sum grouped differently. Controls: a tiling that drops a row or computes one twice is
caught.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers

from trainer import config
from trainer.config import AdapterConfig, ConfigError, ModelConfig
from trainer.model import flops, tiling
from trainer.model.load import build, enable_activation_checkpointing

REPO = Path(__file__).resolve().parents[1]
SEQ, TILE = 200, 48  # four full tiles and a short last one


def _model(checkpointing: bool, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if checkpointing:
        enable_activation_checkpointing(model)
    import peft  # here, not at collection: peft imports bitsandbytes and with it TorchInductor, ~2 s per test worker

    lora = peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=dropout, init_lora_weights=False)
    return peft.get_peft_model(model, lora).train()


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.base_model.model.model.layers


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    return model.base_model.model.model


def _rounding_only(tiled: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor) -> bool:
    """Tiled and untiled differ by summation order only: close to each other and as close to fp64."""
    scale = exact.abs().max()
    err_tiled, err_plain = (tiled - exact).abs().max(), (plain - exact).abs().max()
    return bool((tiled - plain).abs().max() <= 1e-5 * scale and err_tiled <= 4 * err_plain + 1e-6 * scale)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(checkpointing: bool) -> None:
    model = _model(checkpointing)
    exact_model = copy.deepcopy(model).double()
    loss_plain, plain = _step(model)
    _, exact = _step(exact_model)
    assert tiling.apply(_layers(model), TILE, _decoder(model)) == 2
    layer = _layers(model)[0]
    assert isinstance(layer.mlp.inner, tiling.NormThenMLP) and tiling.tile_of(layer.input_layernorm) == TILE
    assert tiling.tile_of(_decoder(model).norm) == TILE and layer.mlp.inner.norm is layer.post_attention_layernorm
    names_before = [n for n, _ in model.named_parameters()]
    loss_tiled, tiled = _step(model)
    assert [n for n, _ in model.named_parameters()] == names_before  # adapter files keep their names
    assert torch.equal(loss_tiled, loss_plain)
    assert len(plain) == 28  # 2 layers x (3 MLP + 4 attention linears) x (A, B)
    for name in plain:
        assert plain[name].abs().max() > 0, name
        assert _rounding_only(tiled[name], plain[name], exact[name].float()), name


def test_in_bf16_every_gradient_outside_the_mlps_is_bit_identical() -> None:
    """In the compute dtype of a real run the norm's fp32 upcast is a real cast, so the layer's input
    gets the same two gradients added tiled or not: only the MLP's LoRA gradients (sums in tile
    order) differ, by bf16 rounding."""
    model = _model(True).to(torch.bfloat16)
    loss_plain, plain = _step(model)
    tiling.apply(_layers(model), TILE, _decoder(model))
    loss_tiled, tiled = _step(model)
    assert torch.equal(loss_tiled, loss_plain)
    in_mlp = [n for n in plain if ".mlp." in n]
    assert len(in_mlp) == 12
    for name in plain:
        if name in in_mlp:
            scale = plain[name].abs().max()
            assert scale > 0 and (tiled[name] - plain[name]).abs().max() <= 2**-6 * scale, name
        else:
            assert torch.equal(tiled[name], plain[name]), name


@pytest.mark.parametrize("unit", ["mlp", "input norm", "norm then mlp", "final norm"])
def test_each_tiled_units_output_and_input_gradient_are_bit_identical(unit: str) -> None:
    model = _model(False)
    layer = _layers(model)[0]
    plain: torch.nn.Module = {
        "mlp": layer.mlp,
        "input norm": layer.input_layernorm,
        "norm then mlp": tiling.NormThenMLP(layer.post_attention_layernorm, layer.mlp),
        "final norm": _decoder(model).norm,
    }[unit]
    x = torch.randn(1, SEQ, 64, requires_grad=True)
    g = torch.randn(1, SEQ, 64)
    out_plain = plain(x)
    (grad_plain,) = torch.autograd.grad(out_plain, x, g)
    if unit.endswith(" norm"):  # tiled in place, as `apply` does
        tiled = copy.deepcopy(plain)
        tiling.tile_in_place(tiled, TILE)
    else:
        tiled = tiling.Tiled(plain, TILE)
    out_tiled = tiled(x)
    (grad_tiled,) = torch.autograd.grad(out_tiled, x, g)
    assert torch.equal(out_tiled, out_plain) and torch.equal(grad_tiled, grad_plain)
    with torch.no_grad():  # evaluation: no graph, the same output
        assert torch.equal(tiled(x), out_plain)


def test_the_tiled_norms_read_the_parameters_registered_now() -> None:
    """FSDP puts gathered weights on the modules that register them, and a state dict loaded with
    assign=True puts new Parameter objects there: the tiled norms compute with those, and a deep
    copy's with its own. Control: the new weights change the loss, so a norm holding on to the old
    ones would be caught."""
    model = _model(False)
    before, _ = _step(model)
    plain = copy.deepcopy(model)
    tiling.apply(_layers(model), TILE, _decoder(model))
    kept = copy.deepcopy(model)  # its norms compute with its own weights, not the swapped ones
    for m in (plain, model):
        torch.manual_seed(3)
        norms = [_decoder(m).norm] + [
            n for layer in _layers(m) for n in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        for norm in norms:
            norm.weight = torch.nn.Parameter(torch.rand_like(norm.weight) + 0.5, requires_grad=False)
    swapped, _ = _step(plain)
    tiled, _ = _step(model)
    assert torch.equal(tiled, swapped) and not torch.equal(swapped, before)
    assert torch.equal(_step(kept)[0], before)


@pytest.mark.parametrize("wrong", ["drops a row", "computes a row twice"])
def test_a_wrong_tiling_is_caught(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    model = _model(True)
    exact_model = copy.deepcopy(model).double()
    loss_plain, plain = _step(model)
    _, exact = _step(exact_model)
    right = tiling.spans

    def broken(tokens: int, tile: int) -> list[tuple[int, int]]:
        if wrong == "drops a row":
            return [(start, stop - 1) if stop == tokens else (start, stop) for start, stop in right(tokens, tile)]
        return [(max(0, start - 1), stop) for start, stop in right(tokens, tile)]

    monkeypatch.setattr(tiling, "spans", broken)
    # Uninitialised memory may hold exactly the values a dropped row should have (the allocator hands
    # back the buffer of the untiled step just run): poison every new empty tensor so it cannot.
    real_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *a, **k: real_new_empty(t, *a, **k).fill_(float("nan")))
    tiling.apply(_layers(model), TILE, _decoder(model))
    loss_tiled, tiled = _step(model)
    caught = not torch.equal(loss_tiled, loss_plain) or any(
        not _rounding_only(tiled[n], plain[n], exact[n].float()) for n in plain
    )
    assert caught


def test_dropout_masks_are_replayed_in_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With LoRA dropout the tiled MLP's gradients are those of the masks its forward drew: the same
    as the module run tile by tile under the same generator (control: without the replay they differ)."""
    mlp = _layers(_model(False, dropout=0.3))[0].mlp
    x = torch.randn(1, SEQ, 64)
    g = torch.randn(1, SEQ, 64)

    def by_hand() -> torch.Tensor:
        xr = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        out = torch.cat([mlp(xr[:, a:b]) for a, b in tiling.spans(SEQ, TILE)], dim=1)
        return torch.autograd.grad(out, xr, g)[0]

    def tiled() -> torch.Tensor:
        xr = x.clone().requires_grad_(True)
        torch.manual_seed(5)
        out = tiling.Tiled(mlp, TILE)(xr)
        torch.manual_seed(6)  # a backward later in the step draws from wherever the generator is then
        return torch.autograd.grad(out, xr, g)[0]

    assert torch.equal(tiled(), by_hand())
    monkeypatch.setattr(tiling._RngState, "restored", lambda self: torch.random.fork_rng(devices=[]))
    assert not torch.equal(tiled(), by_hand())


def test_build_tiles_every_layer_on_request(tiny_llama: Path) -> None:
    model = build(
        ModelConfig(name_or_path=str(tiny_llama), dtype="float32", tiled_mlp="on", tiled_mlp_tokens=16),
        AdapterConfig(r=4),
    )
    layers = _layers(model)
    assert all(isinstance(layer.mlp, tiling.Tiled) and layer.mlp.tile == 16 for layer in layers)
    plain = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4))
    assert plain.state_dict().keys() == model.state_dict().keys()
    with pytest.raises(ValueError, match="tiled_mlp_tokens must be at least 1"):
        tiling.Tiled(layers[0].mlp.inner, 0)
    with pytest.raises(ConfigError, match="model.tiled_mlp_tokens: must be at least 1, got 0"):
        config.RunConfig().replace(**{"model.tiled_mlp_tokens": 0})


@pytest.mark.parametrize("seq, tiled", [(100_000, "off"), (300_000, "on")])
def test_auto_tiles_only_when_the_estimate_needs_it(seq: int, tiled: str) -> None:
    """`model.tiled_mlp: auto` (trainer/training/autofit.py): untiled is tried first (no extra MLP
    forward); tiling is chosen where only it fits an 80 GB H100 (8B QLoRA r32, one row)."""
    from trainer.training import autofit

    shape = flops.model_shape(transformers.LlamaConfig.from_pretrained(REPO / "benchmarks/configs/llama-3.1-8b.json"))
    cfg = config.RunConfig().replace(
        **{
            "model.gradient_checkpointing": True,
            "model.activation_offload": "on",
            "model.tiled_mlp": "auto",
            "adapter.method": "qlora",
            "adapter.r": 32,
            "adapter.dropout": 0.0,
            "data.seq_len": seq,
        }
    )
    device = 79.1 * 1024**3
    resolved, lines = autofit.resolve(cfg, shape, device, device, world=1)
    assert resolved.model.tiled_mlp == tiled
    assert ("tiled_mlp=on" in lines[0]) == (tiled == "on"), lines


def test_the_estimate_reads_the_same_tile_sizes() -> None:
    from trainer.model import loss
    from trainer.plan import memory

    assert memory.HEAD_TILE_TOKENS == loss.HEAD_TILE_TOKENS
    assert memory.MLP_TILE_TOKENS == tiling.DEFAULT_TILE_TOKENS == ModelConfig().tiled_mlp_tokens
