"""QLoRA on a mixture of experts is really 4-bit (trainer/model/experts_nf4.py): the fused routed experts are stored in
NF4 per expert, with no full-precision copy left; the model computes exactly what a dense model with the dequantised
weights computes, forward and backward, without keeping dequantised weights for the backward; a run trains, resumes
bit for bit and saves the usual peft adapter; the plan counts the experts at 4 bits; what cannot be quantised is
refused with the reason."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_moe import _randomise_adapter

from trainer import builtin_assets
from trainer.config import AdapterConfig, ConfigError, ModelConfig
from trainer.model import experts, experts_nf4, load


def _build(path: Path, notes: list[str] | None = None, **adapter: Any) -> Any:
    cfg = AdapterConfig(**({"method": "qlora", "dropout": 0.0} | adapter))
    return load.build(ModelConfig(name_or_path=str(path), dtype="float32"), cfg, notes=notes)


def _ids(n: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(4, 200, (n, length), generator=torch.Generator().manual_seed(0))


def _logits_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _dense_experts(model: torch.nn.Module, weights: Callable[[str, str], torch.Tensor]) -> None:
    """Put dense 3-D expert Parameters (`weights(module name, projection)`) back in place of the NF4 storage."""
    for name, module in experts.find(model).experts.items():
        nf4 = experts_nf4.storage(module)
        assert nf4 is not None
        for proj in nf4.projections:
            setattr(module, proj, torch.nn.Parameter(weights(name, proj), requires_grad=False))
        delattr(module, experts_nf4._ATTR)


@pytest.fixture(scope="module")
def qwen3_moe(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("qwen3_moe")


def test_experts_are_resident_in_nf4_and_no_dense_copy_is_left(qwen3_moe: Path) -> None:
    """Every fused expert Parameter is replaced by a storage-less one; its NF4 storage is 4 bits a weight plus
    bitsandbytes' double-quantised block scales (the bytes below are exact): 1/7.4 of fp32 here (1/7.75 at scale);
    the attention is bitsandbytes' 4-bit; the log says it."""
    notes: list[str] = []
    model = _build(qwen3_moe, notes)
    found = experts.find(model)
    names = found.expert_parameters()
    assert names
    dense = nf4_bytes = 0
    for name in names:
        module_name, _, proj = name.rpartition(".")
        param = getattr(found.experts[module_name], proj)
        assert param.is_meta and param.dim() == 3  # the shape peft reads, no storage
        nf4 = experts_nf4.storage(found.experts[module_name])
        assert nf4 is not None
        e, a, b = nf4.projections[proj].shape
        n = a * b  # per expert: 4-bit codes, a uint8 absmax per 64, an fp32 scale per 256 absmax and an offset
        assert nf4.projections[proj].nbytes() == e * (n // 2 + n // 64 + 4 * -(-n // (64 * 256)) + 4) + 4 * (16 + 256)
        dense += e * n * 4
        nf4_bytes += nf4.projections[proj].nbytes()
    assert 7.3 < dense / nf4_bytes < 4 / 0.5156, (dense, nf4_bytes)  # NF4_BYTES at scale; a tiny expert pays its codes
    # gone from the parameters (nothing moves, broadcasts or saves a dense copy); none of the model's is 3-D
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    assert load.count_params(model).frozen == load.count_params(_build(qwen3_moe, method="lora")).frozen  # logical
    assert type(model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer")).__name__ == (
        "Linear4bit"
    )
    assert any(f"{len(names)} fused routed-expert parameters stored in NF4" in n for n in notes), notes


@pytest.mark.parametrize("arch", builtin_assets.MOE_ARCHES)
def test_nf4_experts_compute_what_their_dequantised_weights_do(tiny_model: Callable[..., Path], arch: str) -> None:
    """Every family quantises: logits and every gradient of the NF4 model equal (exactly) the same model with dense
    expert Parameters holding the dequantised NF4 weights, adapters on and off (the DPO reference); control: the
    original weights give measurably other logits. gpt-oss: transposed experts with biases."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    model = _build(path).train()
    _randomise_adapter(model)
    ids = _ids()
    got, got_grads = _logits_and_grads(model, ids)
    assert any("experts" in n and "lora_B" in n for n in got_grads)
    with torch.no_grad(), model.disable_adapter():
        got_off = model(input_ids=ids).logits
    modules = experts.find(model).experts
    weights = {(n, p): experts_nf4.dequantised(m, p) for n, m in modules.items() for p in _projections(m)}
    _dense_experts(model, lambda n, p: weights[(n, p)])
    want, want_grads = _logits_and_grads(model, ids)
    assert torch.equal(got, want)
    with torch.no_grad(), model.disable_adapter():  # peft's own path on the dense experts
        assert torch.equal(got_off, model(input_ids=ids).logits)
    assert not torch.equal(got_off, got)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    real = dict(original.named_parameters())
    _dense_experts_again(model, lambda n, p: real[f"{n.removeprefix('base_model.model.')}.{p}"].detach().clone())
    with torch.no_grad():
        control = model(input_ids=ids).logits
    assert (control - got).abs().max() > 1e-3


def _projections(module: torch.nn.Module) -> list[str]:
    nf4 = experts_nf4.storage(module)
    return list(nf4.projections) if nf4 is not None else []


def _dense_experts_again(model: torch.nn.Module, weights: Callable[[str, str], torch.Tensor]) -> None:
    for name, module in experts.find(model).experts.items():
        for proj in experts.EXPERT_PARAMS:
            if isinstance(getattr(module, proj, None), torch.nn.Parameter):
                setattr(module, proj, torch.nn.Parameter(weights(name, proj), requires_grad=False))


def test_dequantised_experts_are_not_kept_for_the_backward(qwen3_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a training forward no dequantised expert weight is alive (the backward dequantises again), and the
    gradients are those of keeping them; control: without the recompute hooks autograd keeps them."""
    made: list[weakref.ref[torch.Tensor]] = []
    experts_of = experts_nf4.Projection.experts

    def recorded(self: experts_nf4.Projection, hit: Any) -> torch.Tensor:
        out = experts_of(self, hit)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(experts_nf4.Projection, "experts", recorded)
    model = _build(qwen3_moe).train()
    _randomise_adapter(model)
    ids = _ids()

    def alive_after_forward() -> tuple[int, dict[str, torch.Tensor]]:
        made.clear()
        model.zero_grad()
        loss = (model(input_ids=ids).logits ** 2).mean()
        gc.collect()
        alive = sum(1 for r in made if r() is not None)
        loss.backward()
        return alive, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    alive, grads = alive_after_forward()
    assert made and alive == 0
    for module in model.modules():  # the control: the hooks off
        if type(module) is experts.expert_lora_class():
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
    kept, kept_grads = alive_after_forward()
    assert kept == len(made) > 0
    assert grads.keys() == kept_grads.keys() and all(torch.equal(grads[n], kept_grads[n]) for n in grads)


def test_nf4_experts_under_activation_checkpointing(qwen3_moe: Path) -> None:
    """Non-reentrant checkpointing recomputes each layer in the backward, the expert hooks with it: the gradients
    are exactly those without checkpointing."""
    ids = _ids()

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        cfg = ModelConfig(name_or_path=str(qwen3_moe), dtype="float32", gradient_checkpointing=checkpointing)
        model = load.build(cfg, AdapterConfig(method="qlora", dropout=0.0)).train()
        _randomise_adapter(model)
        return _logits_and_grads(model, ids)[1]

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and any("experts" in n for n in plain)
    assert all(torch.equal(plain[n], checkpointed[n]) for n in plain)


def test_qlora_moe_run_trains_resumes_bit_identical_and_saves_a_peft_adapter(qwen3_moe: Path, tmp_path: Path) -> None:
    """`spotune train`'s path with adapter.method=qlora: the expert LoRA trains (its B leaves zero, the loss falls),
    4 steps straight equal 2 + 2 resumed bit for bit (control: step 2's adapter differs from the final one); the
    saved adapter has a lora run's keys and shapes, loads with PeftModel.from_pretrained on the unquantised base,
    and the merged export (into the 16-bit base, as for every QLoRA run) gives that peft model's logits."""
    from peft import PeftModel
    from test_resume import _cfg, _equal, _losses
    from transformers import AutoModelForCausalLM

    from trainer.serve.export import export
    from trainer.training import run

    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=24)

    def make(name: str, steps: int) -> Any:
        return _cfg(tmp_path / name, qwen3_moe, data, tmp_path / "cache", steps, **{"adapter.method": "qlora"})

    assert run.train(make("straight", 4)) == 0
    assert run.train(make("split", 2)) == 0
    assert run.train(make("split", 4)) == 0
    losses = _losses(tmp_path / "straight")
    assert _losses(tmp_path / "split") == losses and losses[4] < losses[1]
    final = lambda name: load_file(tmp_path / name / "final" / "adapter_model.safetensors")  # noqa: E731
    adapter = final("straight")
    assert _equal(adapter, final("split"))
    assert not _equal(
        load_file(tmp_path / "split" / "checkpoints" / "step-000002" / "adapter_model.safetensors"), adapter
    )
    expert_b = [k for k in adapter if "experts" in k and "lora_B" in k]
    assert expert_b and all(adapter[k].abs().sum() > 0 for k in expert_b)  # B starts at zero: these trained
    _build(qwen3_moe, method="lora", r=4, alpha=8).save_pretrained(tmp_path / "lora")  # a 16-bit LoRA's adapter
    lora = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in lora.items()} == {k: v.shape for k, v in adapter.items()}

    base = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32)
    with load.peft_wrapping():
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "straight" / "final")).eval()
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert len(loaded) == len(adapter)
    for key, value in adapter.items():
        name = key.replace(".weight", ".default.weight")
        assert torch.equal(loaded[name].detach(), value), key
    export(tmp_path / "straight", tmp_path / "merged", merge=True)  # `spotune export --merge` of the QLoRA run
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        plain = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32).eval()
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-4)  # control: the adapter changes them


def test_what_cannot_be_quantised_is_refused_with_the_reason(qwen3_moe: Path) -> None:
    with pytest.raises(ConfigError) as e:
        _build(qwen3_moe, quant_bits=8)
    text = str(e.value)
    assert "adapter.method: qlora on qwen3_moe" in text and "adapter.quant_bits=4" in text
    assert "model.layers.0.mlp.experts.gate_up_proj" in text
    model = _build(qwen3_moe)  # peft's merge into NF4 experts: the forward says where a merged model comes from
    model.merge_adapter()
    with pytest.raises(NotImplementedError, match="NF4.*spotune export --merge"):
        model(input_ids=_ids())
    with pytest.raises(ConfigError, match="FSDP does not shard.*adapter.method=lora"):
        load.load_base(ModelConfig(name_or_path=str(qwen3_moe)), AdapterConfig(method="qlora"), sharded=True)


def test_plan_counts_moe_experts_at_4_bits_under_qlora(qwen3_moe: Path) -> None:
    """`spotune estimate`'s weights term under QLoRA counts every routed expert (not only the top-k a token uses) at
    NF4's bytes, and agrees with the loaded model's resident bytes; before, the idle experts counted 16 bits."""
    from transformers import AutoConfig

    from trainer.model import flops
    from trainer.plan import memory

    shape = flops.model_shape(AutoConfig.from_pretrained(qwen3_moe))
    idle = memory.idle_expert_params(shape)
    assert idle == (shape.experts - shape.top_k) * 3 * shape.hidden * shape.expert_intermediate > 0
    quantised = shape.layers * (shape.block_matmul_params() + idle)
    planned = memory.weight_bytes(shape, "nf4", "float32")
    assert planned == (shape.total_params() - quantised) * 4 + quantised * memory.NF4_BYTES
    model = _build(qwen3_moe)
    # the loaded model's weights: float tensors, bitsandbytes' packed linears with their block scales, NF4 experts;
    # leaving out the code tables (about 1 KB a tensor whatever its size: nothing at scale, most of a tiny tensor's)
    floats = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    scales = sum(
        s.absmax.numel() + 4 * s.state2.absmax.numel()
        for m in model.modules()
        if (s := getattr(getattr(m, "weight", None), "quant_state", None)) is not None
    )
    nf4 = sum(
        p.nbytes() - 4 * (p.code.numel() + p.absmax_code.numel())
        for _, n in experts_nf4.quantised_modules(model)
        for p in n.projections.values()
    )
    measured = floats + scales + nf4
    assert abs(planned - measured) / measured < 0.01, (planned, measured)
    top_k_only = (shape.total_params() - shape.layers * shape.block_matmul_params()) * 4
    top_k_only += shape.layers * shape.block_matmul_params() * memory.NF4_BYTES
    assert (top_k_only - measured) / measured > 0.3  # control: the idle experts at 16/32 bits, as before
    dense = memory.weight_bytes(shape, "float32")
    assert planned < 0.6 * dense  # the tiny model's embeddings and head stay fp32; the experts shrink 7.8x


def test_estimate_prices_moe_qlora_at_4_bits_and_never_suggests_fsdp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spotune estimate` on Qwen3-30B-A3B: under QLoRA its weights take NF4's bytes for every expert (about 15.5 GiB
    against 56.9 in bf16); FSDP, which QLoRA on fused experts refuses, is neither a change offered nor a hint;
    control: bf16 LoRA on the same model is shardable and offered FSDP where it does not fit."""
    import json

    from trainer.cli.main import main as spotune

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)

    def recipe(method: str) -> str:
        path = tmp_path / f"{method}.yaml"
        path.write_text(f"model:\n  name_or_path: Qwen/Qwen3-30B-A3B\nadapter:\n  method: {method}\n")
        return str(path)

    def estimate(method: str) -> dict[str, Any]:
        assert spotune(["estimate", recipe(method), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    qlora, lora = estimate("qlora"), estimate("lora")
    assert qlora["model"]["weight_format"] == "nf4" and not qlora["model"]["shardable"] and lora["model"]["shardable"]
    assert 15 < qlora["memory_gib"]["weights"] < 16 and 56 < lora["memory_gib"]["weights"] < 58
    changes = [c["change"] for o in qlora["options"] for c in o.get("fit_changes") or []]
    assert changes and not [c for c in changes if "fsdp" in c]
    assert all(o["fsdp_gpus"] is None for o in qlora["options"])
    assert [c for o in lora["options"] for c in o.get("fit_changes") or [] if "fsdp" in c["change"]]  # control
    assert spotune(["estimate", recipe("qlora")]) == 0
    assert "fsdp" not in capsys.readouterr().out


@pytest.mark.parametrize("shape", [(6, 128, 64), (6, 256, 64), (3, 24, 20)])
def test_experts_dequantised_at_once_equal_bitsandbytes_expert_by_expert(shape: tuple[int, int, int]) -> None:
    """The experts a batch routes to, dequantised in one call, are bit for bit bitsandbytes' own dequantisation of
    each expert's QuantState (nested scales in one call where they are whole blocks: 256 x 64 / 64 = 256 scales; not:
    128 x 64; experts not whole blocks at all: 24 x 20); the experts not hit are zero."""
    import bitsandbytes.functional as bnb

    weights = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    projection = experts_nf4._quantised(bnb, weights, torch.device("cpu"))
    for hit in ([shape[0] - 1, 1], list(range(shape[0])), [2]):
        got = projection.experts(hit)
        for e in range(shape[0]):
            if e not in hit:
                assert not got[e].any()
                continue
            codes, state = bnb.quantize_4bit(weights[e].contiguous(), compress_statistics=True, quant_type="nf4")
            assert torch.equal(got[e], bnb.dequantize_4bit(codes, state)), (hit, e)
            assert torch.equal(got[e], projection.expert(e))
        assert (got[hit[0]] - weights[hit[0]]).abs().max() > 1e-3  # control: 4 bits are not the weights
