"""Mixture-of-experts models under LoRA (trainer/model/experts.py): every family transformers 5 ships with fused
experts trains LoRA on its routed experts (never silently untrained), the router stays frozen unless asked, and the
per-token expert kernel computes what peft's ParamWrapper computes, saved in peft's layout: peft loads it back to
the same logits, and the merged export gives them too."""

from __future__ import annotations

import json
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
    """The probe finds grouped_mm running (and agreeing with the loop) where this torch has it; on CPU the loop is
    chosen all the same (measured faster there), and the reason says which."""
    has = hasattr(torch.nn.functional, "grouped_mm")
    choice, why = experts.probe("cpu", torch.float32)
    assert (choice == experts.GROUPED) == has, why
    choice, why = experts.kernel("cpu", torch.float32)
    assert choice == experts.LOOP and ("faster" in why if has else "no torch.nn.functional.grouped_mm" in why)


# ---------------------------------------------------------------------------- router load balancing


def _micro(length: int = 24) -> dict[str, Any]:
    from trainer.training.batches import micro_batch

    ids = _ids(1, length)
    return micro_batch(ids, ids.clone(), torch.arange(length)[None])


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_aux_loss_is_the_familys_own_weighted_by_units(moe_model: Callable[[str], Path], arch: str) -> None:
    """The term added is coef x transformers' own aux loss of the same forward x the micro-batch's trainable
    tokens (divided by the step's tokens like the loss), and its gradient reaches the adapter."""
    from trainer.model.balance import STAT, Balanced, balanced
    from trainer.model.objective import Counts, Sft

    model = _build(moe_model(arch), dropout=0.0).train()
    _randomise_adapter(model)
    micro = _micro()
    units = micro["label_index"].numel()
    counts = Counts(trainable=units).tensor()
    objective, note = balanced(Sft(), model, 0.5)
    assert isinstance(objective, Balanced) and note and "auxiliary loss x 0.5" in note
    assert objective.stats == (STAT,)
    total, stats = objective.loss(model, micro, counts)
    plain, _ = Sft().loss(model, micro, counts)
    want = model(input_ids=micro["input_ids"], output_router_logits=True).aux_loss
    torch.testing.assert_close(total - plain, 0.5 * want * units, rtol=1e-5, atol=1e-6)
    assert float(want.detach()) > 0
    assert objective.report(stats.tolist(), Counts(trainable=units))[STAT] == pytest.approx(
        float(want.detach()), rel=1e-5
    )
    model.zero_grad()
    (total - plain).backward()  # the aux term alone: its gradient reaches the adapter through the hidden states
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():  # evaluation (and the DPO reference): no term
        loss, stats = objective.loss(model, micro, counts)
    assert float(stats[-1]) == 0.0


def test_router_aux_loss_where_it_applies(moe_model: Callable[[str], Path], tiny_llama: Path) -> None:
    from trainer.model.balance import Balanced, balanced
    from trainer.model.objective import Sft

    sft = Sft()
    assert balanced(sft, _build(tiny_llama), 0.001) == (sft, None)  # no routers: unchanged, nothing said
    off, note = balanced(Sft(), _build(moe_model("qwen3_moe")), 0.0)
    assert not isinstance(off, Balanced) and note and "=0" in note
    aux_free, note = balanced(Sft(), _build(moe_model("deepseek_v3")), 0.001)
    assert not isinstance(aux_free, Balanced) and note and "without an auxiliary loss" in note


def test_router_aux_loss_aliases() -> None:
    from trainer import config as C

    for name in ("router_aux_loss_coef", "moe_aux_loss_coef"):  # TRL's, LLaMA-Factory's
        assert C.load(None, [f"{name}=0.02"]).train.router_aux_loss_coef == 0.02
    assert C.load(None).train.router_aux_loss_coef == 0.001
    with pytest.raises(ConfigError, match="train.router_aux_loss_coef: must be >= 0"):
        C.load(None, ["train.router_aux_loss_coef=-1"])


# ---------------------------------------------------------------------------- a run: metrics and resume


def test_moe_run_resumes_bit_identical_and_reports_router_aux_loss(
    moe_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """4 steps straight equal 2 steps, stop, 2 more (CPU fp32, dropout on the linear layers, the aux loss on),
    adapter and optimizer bit for bit; the metrics carry the router aux loss. Control: the checkpoints at steps 2
    and 4 differ (so equal finals mean something)."""
    from test_resume import _cfg, _equal, _losses

    from trainer.training import run

    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=24)
    model = moe_model("qwen3_moe")

    def make(name: str, steps: int) -> Any:
        return _cfg(tmp_path / name, model, data, tmp_path / "cache", steps, **{"train.router_aux_loss_coef": 0.01})

    assert run.train(make("straight", 4)) == 0
    assert run.train(make("split", 2)) == 0
    assert run.train(make("split", 4)) == 0  # resumes from step 2
    assert _losses(tmp_path / "split") == _losses(tmp_path / "straight")
    final = lambda name: load_file(tmp_path / name / "final" / "adapter_model.safetensors")  # noqa: E731
    assert any("experts" in k for k in final("straight")) and _equal(final("straight"), final("split"))
    ck = tmp_path / "split" / "checkpoints"
    assert not _equal(load_file(ck / "step-000002" / "adapter_model.safetensors"), final("split"))
    rows = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    aux = [r["router_aux_loss"] for r in rows if "router_aux_loss" in r]
    assert len(aux) == 4 and all(a > 0 for a in aux)


# ---------------------------------------------------------------------------- planning


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_flops_count_active_parameters_memory_counts_all(moe_model: Callable[[str], Path], arch: str) -> None:
    """Per token, flops count the attention, the shared experts and the top-k routed ones; memory counts every
    expert resident; the LoRA count is the adapter spotune builds (every expert carries its own)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model import flops

    path = moe_model(arch)
    shape = flops.model_shape(AutoConfig.from_pretrained(path))
    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert abs(shape.total_params() - real) / real < 0.01  # norms and biases aside, every expert counted
    h, e = shape.hidden, shape.expert_intermediate
    attention = sum(i * o for n, i, o in shape.linears() if n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    shared = 3 * h * shape.shared_intermediate
    assert shape.block_matmul_params() == attention + shared + shape.top_k * 3 * h * e  # top-k of 8, not 8
    assert shape.top_k < shape.experts
    model = _build(path, r=16)
    assert flops.lora_params(shape, 16) == load.count_params(model).trainable


# ---------------------------------------------------------------------------- shared experts peft renames


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_shared_experts_peft_renames_train_and_load_back(
    moe_model: Callable[[str], Path], arch: str, tmp_path: Path
) -> None:
    """DeepSeek's and GLM's shared experts (and DeepSeek-V3's and GLM's dense first layer) name their linear layers
    gate_proj/up_proj/down_proj, which peft rewrites as pre-transformers-5 expert names when it loads an adapter:
    each still carries a trainable adapter that learns, with the dropout the linear layers get; the saved adapter
    loads with `PeftModel.from_pretrained` to the logits training gave, and the merged export gives them too.
    Control: the loaded model with the shared experts' adapters zeroed gives other logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.serve.export import merge_adapter

    path = moe_model(arch)
    notes: list[str] = []
    ours = _build(path, notes)
    linear = {
        n
        for n, m in AutoModelForCausalLM.from_pretrained(path).named_modules()
        if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in ("gate_proj", "up_proj", "down_proj")
    }
    assert any("shared_experts" in n for n in linear)
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    for name in linear:
        for factor in ("lora_A", "lora_B"):
            assert f"base_model.model.{name}.{factor}.default.weight" in trainable, (name, factor)
        assert isinstance(ours.get_submodule(f"base_model.model.{name}").lora_dropout["default"], torch.nn.Dropout)
    assert not any("left without LoRA" in n for n in notes), notes
    ours.train()
    _randomise_adapter(ours)
    _, grads = _logits_and_grads(ours, _ids())
    for name in linear:
        assert grads[f"base_model.model.{name}.lora_A.weight"].abs().sum() > 0, name

    ours.eval().save_pretrained(tmp_path / "adapter")
    ids = _ids()
    with torch.no_grad():
        want = ours(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", ModelConfig(name_or_path=str(path), dtype="float32"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        for n, p in theirs.named_parameters():
            if "shared_experts" in n and "lora_B" in n:
                p.zero_()
        assert not torch.allclose(theirs(input_ids=ids).logits, want, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------- preference objectives


def test_dpo_with_an_moe_policy_trains_its_experts_with_the_router_aux_loss(
    moe_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """DPO on a tiny Qwen3-MoE: step 1 of a fresh adapter is ln 2 (the reference, the adapter disabled, equals the
    policy) plus coef x the router aux loss (the logged loss is the objective's, as TRL logs it), the routed experts'
    LoRA learns, and the aux loss is reported each step and enters the gradient as for SFT. Control: the same run
    with train.router_aux_loss_coef=0 starts at ln 2 exactly and ends on another adapter."""
    import math

    from test_resume import _cfg, _equal, _losses

    from trainer.training import run

    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=8)
    model = moe_model("qwen3_moe")

    def train(name: str, coef: float) -> dict[str, torch.Tensor]:
        cfg = _cfg(
            tmp_path / name,
            model,
            data,
            tmp_path / "cache",
            2,
            **{"train.objective": "dpo", "train.grad_accum": 1, "train.router_aux_loss_coef": coef},
        )
        assert run.train(cfg) == 0
        return load_file(tmp_path / name / "final" / "adapter_model.safetensors")

    final = train("dpo", 0.01)
    rows = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    aux = [r["router_aux_loss"] for r in rows if "loss" in r]
    assert len(aux) == 2 and all(a > 0 for a in aux)
    losses = _losses(tmp_path / "dpo")
    assert losses[1] == pytest.approx(math.log(2) + 0.01 * aux[0], abs=1e-6)
    first = next(r for r in rows if r.get("step") == 1)
    assert first["rewards/margins"] == 0.0 and first["rewards/chosen"] == 0.0  # the policy is the reference
    expert_b = [v for k, v in final.items() if ".experts." in k and "lora_B" in k]
    assert expert_b and all(v.abs().sum() > 0 for v in expert_b)  # B starts at zero: every expert's LoRA moved
    plain = train("plain", 0.0)
    assert _losses(tmp_path / "plain")[1] == pytest.approx(math.log(2), abs=1e-6)
    assert not _equal(plain, final)


def test_expert_loop_gradients_equal_autograds() -> None:
    """The loop kernel's hand-written backward (`_ExpertLinear`) against autograd over plain per-expert matmuls:
    two adapters, an expert no row is routed to, a transposed weight view, the weight frozen and trainable.
    Control: the same rows split among the experts otherwise give other outputs."""
    gen = torch.Generator().manual_seed(0)
    sizes, rank, d_in, d_out = [3, 0, 5, 2], 2, 6, 4
    x = torch.randn(sum(sizes), d_in, generator=gen, requires_grad=True)
    weight = torch.randn(len(sizes), d_out, d_in, generator=gen)
    factors_ = [
        (torch.randn(len(sizes), rank, d_in, generator=gen), torch.randn(len(sizes), d_out, rank, generator=gen), s)
        for s in (0.5, 2.0)
    ]
    scalings = [s for *_, s in factors_]
    grad_out = torch.randn(sum(sizes), d_out, generator=gen)
    for frozen in (True, False):
        base = weight.clone().requires_grad_(not frozen)
        ab = [t.clone().requires_grad_() for a, b, _ in factors_ for t in (a, b)]
        w = base.transpose(1, 2)  # [experts, in, out], as the kernel reads a weight stored [experts, out, in]
        inputs = [x, *ab] if frozen else [x, base, *ab]
        got = experts._ExpertLinear.apply(x, w, sizes, scalings, *ab)
        got_grads = torch.autograd.grad(got, inputs, grad_out)
        parts, start = [], 0
        for e, n in enumerate(sizes):
            rows = x[start : start + n]
            y = rows @ w[e]
            for i, s in enumerate(scalings):
                y = y + s * (rows @ ab[2 * i][e].t()) @ ab[2 * i + 1][e].t()
            parts.append(y)
            start += n
        want = torch.cat(parts)
        torch.testing.assert_close(got, want)
        for name, a, b in zip(
            ["x", *(["W"] if not frozen else []), "A1", "B1", "A2", "B2"],
            got_grads,
            torch.autograd.grad(want, inputs, grad_out),
            strict=True,
        ):
            torch.testing.assert_close(a, b, msg=name)
    other = experts._ExpertLinear.apply(x, w, [5, 0, 3, 2], scalings, *ab)
    assert not torch.allclose(other, want)


def test_a_packed_linear_weight_is_refused_where_it_would_be_adapted_by_its_weight() -> None:
    """A linear layer adapted through its weight (a name peft renames) whose weight is neither [out, in] nor
    bitsandbytes' 4-bit is refused, naming why, instead of getting LoRA factors of the stored shape. A 4-bit one
    (QLoRA on DeepSeek's or GLM's shared experts) gets factors of the layer's own sizes and computes its LoRA."""
    from peft import LoraConfig

    config = LoraConfig(r=2, target_parameters=["gate_proj.weight"], lora_dropout=0.0)
    plain = torch.nn.Linear(8, 4)
    assert (
        experts._linear_by_parameter(plain, "default", config=config, parameter_name="weight", r=2, lora_alpha=4)
        is not None
    )
    assert experts._linear_by_parameter(plain, "default", config=config, parameter_name=None) is None  # peft's own
    packed = torch.nn.Linear(8, 4)
    packed.weight = torch.nn.Parameter(torch.zeros(16, 1), requires_grad=False)
    with pytest.raises(ValueError, match=r"stores its weight as \(16, 1\), not \[out, in\].*bitsandbytes' 4-bit"):
        experts._linear_by_parameter(packed, "default", config=config, parameter_name="weight")
    bnb = pytest.importorskip("bitsandbytes")
    four = bnb.nn.Linear4bit(8, 4, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    four.load_state_dict({"weight": plain.weight.detach().clone()}, strict=False)
    four = four.to("cpu")  # quantised here: the weight is packed bytes
    assert tuple(four.weight.shape) != (4, 8)
    lora = experts._linear_by_parameter(
        four, "default", config=config, parameter_name="weight", r=2, lora_alpha=4, lora_dropout=0.0
    )
    assert lora.lora_A["default"].weight.shape == (2, 8) and lora.lora_B["default"].weight.shape == (4, 2)
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_()
        x = torch.randn(3, 8)
        want = four(x) + lora.lora_B["default"](lora.lora_A["default"](x)) * lora.scaling["default"]
        torch.testing.assert_close(lora(x), want)
