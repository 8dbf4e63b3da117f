"""The base model, optional bitsandbytes quantisation, LoRA adapters via peft, and
activation (gradient) checkpointing.

`build(model_cfg, adapter_cfg, device=..., autocast=...)` returns a `peft.PeftModel` whose
only trainable parameters are the LoRA matrices. The adapter weights are kept in fp32 (peft's
`autocast_adapter_dtype`) whatever the base dtype, so AdamW state and updates are fp32. Under
mixed precision (`autocast=True`) they are *computed* in the compute dtype: peft's per-layer
cast of the activation to the adapter's fp32 dtype is switched off, so no LoRA layer makes
(and keeps for backward) an fp32 copy of its input; autocast runs the LoRA matmuls in bf16.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

from trainer import progress as progress_lib
from trainer.config import AdapterConfig, ConfigError, ModelConfig, TrainConfig
from trainer.model import attention, experts, experts_nf4, lora_fused, offload, tiling
from trainer.model.reference import InitAdapter, load_init
from trainer.model.wrappers import causal_lm, outside_the_decoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _DropCpuKernelNotice(logging.Filter):
    """`import peft` imports bitsandbytes whenever it is installed (peft/helpers.py), on plain LoRA
    runs too, and bitsandbytes then logs that an optional CPU 4-bit kernel (a hub download) is
    missing. Only that line is dropped: 4-bit runs use the CUDA kernels, and every other
    bitsandbytes message still reaches the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropCpuKernelNotice())


@contextlib.contextmanager
def quiet_hf_progress(downloads: bool = False) -> Iterator[None]:
    """Hide transformers' own "Loading weights" / "Writing model shards" bars, which spotune's
    console replaces; the previous setting is restored on exit. `downloads`: keep the hub's
    download bars (a 16 GB download must not look like a hang). transformers' switch turns the
    hub's bars off too, so the hub's download group is turned back on by name."""
    from huggingface_hub import constants
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    downloads = downloads and not constants.HF_HUB_DISABLE_PROGRESS_BARS  # the user's env switch wins
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if downloads:
        enable_progress_bars("huggingface_hub")  # http_get, xet_get, snapshot_download
    try:
        yield
    finally:
        if downloads:
            disable_progress_bars("huggingface_hub")
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """peft 0.21 asks transformers 5 for the deprecated `is_gradient_checkpointing` (PeftModel.__init__,
    peft/peft_model.py) where transformers 5 names it `is_activation_checkpointing`; that
    FutureWarning is about peft's code, not the user's recipe. Our own code uses the current names."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


@contextlib.contextmanager
def bitsandbytes_only_if_loaded() -> Iterator[None]:
    """`import peft` and peft's LoRA dispatch import bitsandbytes whenever it is installed, and its
    import wraps its CPU kernels in `torch.compile`, which loads TorchInductor: about 1 s of CPU on
    every start (every restart) of a run that quantises nothing. A base model has bitsandbytes
    layers only if bitsandbytes was imported to load it, so while it is not loaded peft is told it
    is absent (`sys.modules[name] = None`: find_spec answers None, `import` raises ImportError),
    and peft's cached answers are forgotten afterwards, so a quantised base built later in the same
    process is dispatched to peft's bitsandbytes layers (tests/test_model.py holds both)."""
    if "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("bitsandbytes", 0) is None:
            del sys.modules["bitsandbytes"]
        peft_imports = sys.modules.get("peft.import_utils")
        for name in ("is_bnb_available", "is_bnb_4bit_available"):
            cached = getattr(peft_imports, name, None)
            if cached is not None and hasattr(cached, "cache_clear"):
                cached.cache_clear()


@dataclass(frozen=True)
class ParamCounts:
    """Logical parameter counts (a 4-bit weight counts as its unpacked size), for FLOPs."""

    trainable: int
    frozen: int


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def resolve_attn_implementation(choice: str, device: torch.device) -> str:
    """The attention kernel: `auto` picks, per device, one that needs no dense [S x S] mask.

    On CUDA: flash_attention_3 (Hopper, flash-attn 3 installed), flash_attention_2 (installed),
    else spotune_varlen (torch's own varlen flash kernel, where the installed torch has it), else
    flex_attention (transformers builds a document block mask from position_ids). sdpa with a
    packed mask falls off torch's fast kernels, so on CUDA it is only used when asked for;
    benchmarks/gpu.py measures the choices. On CPU: sdpa. Every choice keeps packed documents
    apart (trainer/model/attention.py), so the choice changes speed, never the maths.
    """
    if choice == attention.VARLEN:
        attention.register()
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "sdpa"
    from transformers.utils import import_utils

    fa3 = getattr(import_utils, "is_flash_attn_3_available", lambda: False)
    if fa3() and torch.cuda.get_device_capability(device)[0] == 9:
        return "flash_attention_3"
    if import_utils.is_flash_attn_2_available():
        return "flash_attention_2"
    if attention.varlen_available(device):
        attention.register()
        return attention.VARLEN
    warnings.warn(
        f"model.attn_implementation=auto: {attention.varlen_unavailable_reason()}; using flex_attention "
        "(the same maths, documents kept apart by a block mask; set model.attn_implementation to choose)",
        stacklevel=2,
    )
    return "flex_attention"


def quant_compute_dtype(model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """Compute dtype of 4-bit layers: the recipe dtype, but fp16 on a CUDA GPU without bf16."""
    dtype = torch_dtype(model_cfg.dtype)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


def quantization_config(adapter_cfg: AdapterConfig, compute: torch.dtype, *, sharded: bool) -> BitsAndBytesConfig:
    """bitsandbytes settings for `qlora`: NF4 with double quantisation, or LLM.int8.

    `sharded` (FSDP): the packed 4-bit weights are stored in the compute dtype instead of uint8.
    FSDP shards, all-gathers and reduces float tensors only (FSDP2 turns every parameter into a
    DTensor; a uint8 one would not survive it), so the same packed bytes are viewed as bf16, as
    Answer.AI's FSDP+QLoRA work does; bitsandbytes' kernels read them either way.
    """
    if adapter_cfg.quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        bnb_4bit_quant_storage=compute if sharded else torch.uint8,
    )


def load_base(
    model_cfg: ModelConfig,
    adapter_cfg: AdapterConfig,
    *,
    name_or_path: str | None = None,
    device: torch.device | str = "cpu",
    sharded: bool = False,
    progress: bool = False,
    experts_on_host: bool = False,
) -> PreTrainedModel:
    """The frozen base model on `device`, quantised when `adapter.method` is `qlora`; `sharded`:
    laid out for FSDP (see `quantization_config`). `experts_on_host`: a QLoRA model with fused routed
    experts loads on the CPU instead (its linear layers already 4-bit), so that its experts reach the
    device only in NF4 (`quantise_experts` quantises them there and moves the rest)."""
    device = torch.device(device)
    path = name_or_path or model_cfg.name_or_path
    dtype = torch_dtype(model_cfg.dtype)
    attn = resolve_attn_implementation(model_cfg.attn_implementation, device)
    if attn == "sdpa" and model_cfg.attn_implementation == "auto" and _model_type(path, model_cfg) in _NO_SDPA:
        attn = "eager"  # the same maths; packed documents kept apart by the block mask built from position_ids
    kwargs: dict = dict(
        dtype=dtype,
        attn_implementation=attn,
        revision=model_cfg.revision,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    if adapter_cfg.method == "qlora":
        fused = refuse_quantised_experts(path, model_cfg, adapter_cfg, sharded=sharded)
        compute = quant_compute_dtype(model_cfg, device)
        kwargs["dtype"] = compute  # non-quantised modules (embeddings, norms, head) in the compute dtype
        kwargs["quantization_config"] = quantization_config(adapter_cfg, compute, sharded=sharded)
        # Quantised weights are packed as they are placed, so place them on this rank's device while
        # loading; but 16-bit fused experts would not fit where their NF4 form does: those stay on the host.
        kwargs["device_map"] = {"": torch.device("cpu") if fused and experts_on_host else device}
    try:
        # `progress`: the download shows (trainer/progress.py: a bar, or lines in a log file).
        with quiet_hf_progress(downloads=progress):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **(download_bar_kwargs() if progress else {}))
    except OSError as e:
        raise ConfigError(
            [
                f"model.name_or_path: cannot load {path!r}: {e}\n"
                "Give a local directory written by save_pretrained or a hub model id you can reach."
            ]
        ) from e
    return model


def refuse_quantised_experts(path: str, model_cfg: ModelConfig, adapter_cfg: AdapterConfig, *, sharded: bool) -> bool:
    """QLoRA on a model with fused routed experts stores them in NF4 (trainer/model/experts_nf4.py: bitsandbytes'
    `load_in_4bit` quantises linear layers only, and would leave them in 16 bits); what that cannot do is refused
    before the model loads, with the reason: 8-bit experts, FSDP, and experts spotune's expert kernel does not
    run (only it reads NF4 experts). The model's layout is read on the meta device. Returns whether it has fused
    routed experts."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
        )
    except (OSError, ValueError):  # from_pretrained says what is wrong with the path
        return False
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    moe = experts.find(skeleton)
    if not moe.experts:
        return False
    first = moe.expert_parameters()[0]
    why = None
    if adapter_cfg.quant_bits != 4:
        why = (
            f"its routed experts (fused 3-D parameters such as {first}) are quantised to 4 bits (NF4) only. "
            "Set adapter.quant_bits=4"
        )
    elif sharded:
        why = (
            f"its routed experts ({first}) are stored in NF4 outside bitsandbytes' layers, which FSDP does not "
            "shard. Train on one GPU (train.distributed=ddp or none), or set adapter.method=lora"
        )
    elif not all(hasattr(m, "has_gate") for m in moe.experts.values()):
        kind = type(next(m for m in moe.experts.values() if not hasattr(m, "has_gate"))).__name__
        why = (
            f"its experts module {kind} is not one transformers' experts implementation runs, so spotune's expert "
            f"kernel, the only code that reads 4-bit experts, cannot compute it ({first} would stay in 16 bits). "
            "Set adapter.method=lora"
        )
    if why:
        raise ConfigError([f"adapter.method: qlora on {config.model_type}: {why}"])
    return True


_NO_SDPA = {"gpt_oss"}
"""Model types transformers runs without sdpa (gpt-oss's attention sinks): `auto` picks eager where it would pick sdpa."""


def _model_type(path: str, model_cfg: ModelConfig) -> str | None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
        )
    except (OSError, ValueError):  # from_pretrained below says what is wrong with the path
        return None
    return getattr(config, "model_type", None)


def download_bar_kwargs() -> dict[str, Any]:
    """`from_pretrained`'s keyword for the hub download's progress (trainer/progress.py: a bar on a
    terminal, lines in a log file), where this transformers takes one."""
    return {"tqdm_class": progress_lib.hub_download_bar()} if _takes_download_bar() else {}


def build(
    model_cfg: ModelConfig,
    adapter_cfg: AdapterConfig,
    *,
    name_or_path: str | None = None,
    device: torch.device | str = "cpu",
    autocast: bool = False,
    sharded: bool = False,
    progress: bool = False,
    init: InitAdapter | None = None,
    no_dropout: bool = False,
    notes: list[str] | None = None,
):
    """Base model + LoRA adapter (a `peft.PeftModel`), ready for the training loop; `init`: the adapter
    starts from that one (and keeps it, frozen, as the DPO reference: trainer/model/reference.py).
    `no_dropout`: every dropout off, the adapter's whatever `adapter_cfg.dropout` and the model's
    (`config.dropout_off`: the preference objectives). `notes`: what the run's log should say about the
    model (a mixture of experts: which experts are trained, the expert kernel, where dropout applies).

    `autocast`: the loop runs under mixed precision (accelerate's autocast), so the LoRA layers
    may take the bf16/fp16 activation as it is (see the module docstring). `sharded`: the model
    will be sharded by FSDP (trainer/model/distributed.py), which changes how 4-bit weights are stored.

    For `qlora` we deliberately do not call peft's `prepare_model_for_kbit_training`: it
    casts every parameter that is not 4-bit (embeddings, lm_head, norms) to fp32, which for
    a 7B Llama adds ~1 GB of memory and turns the lm_head matmul into fp32, while Llama-style
    RMSNorm already computes in fp32 internally. The other things it does we do here: the
    base is frozen (peft freezes it), and checkpointing is non-reentrant, which needs no
    input-grad hook.
    """
    base = load_base(
        model_cfg,
        adapter_cfg,
        name_or_path=name_or_path,
        device=device,
        sharded=sharded,
        progress=progress,
        experts_on_host=True,
    )
    base.config.use_cache = False  # training never uses the KV cache; avoids warnings with checkpointing
    if model_cfg.gradient_checkpointing is True:  # `auto` is resolved by trainer/training/autofit.py before build
        enable_activation_checkpointing(base)
    model = with_lora(base, adapter_cfg, 0.0 if no_dropout else adapter_cfg.dropout, torch.device(device), notes)
    if init is not None:  # before the runtime views below, which then cover the reference adapter too
        load_init(model, init, adapter_cfg)
    if adapter_cfg.method == "qlora":  # after every adapter is made: peft places a new one by its Parameter's device
        quantise_experts(model, torch.device(device), notes)
    if no_dropout:
        disable_dropout(model)
    if autocast:
        compute_adapters_in_autocast_dtype(model)
    if adapter_cfg.fused:  # before compile: the compiled layers trace the fused view
        lora_fused.fuse(model)
    if model_cfg.tiled_mlp == "on":  # `auto` is resolved by trainer/training/autofit.py before build
        layers = decoder_layers(model, "model.tiled_mlp", "set model.tiled_mlp=off")
        if not tiling.apply(layers, model_cfg.tiled_mlp_tokens, causal_lm(model).get_decoder()):
            raise ConfigError(
                [f"model.tiled_mlp: no decoder layer of {type(layers[0]).__name__} has an `mlp`; set it off"]
            )
    if model_cfg.compile:
        compile_layers(model)
    if model_cfg.activation_offload == "on":
        offload.attach(model)
    return model  # accelerate.prepare places a non-quantised model on its device


def with_lora(
    base: PreTrainedModel, adapter_cfg: AdapterConfig, dropout: float, device: torch.device, notes: list[str] | None
) -> Any:
    """`base` wrapped by peft with the recipe's LoRA (a mixture of experts: its experts too, trainer/model/experts.py)."""
    targets, moe = list(adapter_cfg.target_modules), experts.find(base)
    with bitsandbytes_only_if_loaded():  # a base loaded without bitsandbytes has none of its layers
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=adapter_cfg.r,
            lora_alpha=adapter_cfg.alpha,  # type: ignore[arg-type]  # annotated int; peft scales by alpha / r as a float
            lora_dropout=dropout,  # 0: peft's identity, which lora_fused needs
            target_modules="all-linear" if targets == ["all-linear"] else targets,
            exclude_modules=outside_the_decoder(base),
            bias="none",
            task_type="CAUSAL_LM",
        )
        if moe.experts:  # the experts as target_parameters
            lora = _moe_lora(base, lora, moe, adapter_cfg, notes)
        try:
            with peft_wrapping():
                model = get_peft_model(base, lora, autocast_adapter_dtype=True)
        except ValueError as e:
            raise ConfigError(
                [
                    f"adapter.target_modules: {targets} does not fit this model ({e}); "
                    "use 'all-linear' or names of its linear modules such as q_proj, v_proj"
                ]
            ) from e
    if moe.experts:
        _moe_adapted(model, dropout, device, notes)
    return model


def _moe_lora(
    base: PreTrainedModel,
    lora: Any,
    moe: experts.Moe,
    adapter_cfg: AdapterConfig,
    notes: list[str] | None,
) -> Any:
    """`lora` for a model with fused routed experts: the expert Parameters as peft `target_parameters`
    (computed per routed token by `experts.ExpertLora`), the routers frozen unless `adapter.train_router`,
    and LoRA dropout off in the config (peft's ParamWrapper refuses any: a dropout cannot be factored out of a
    weight change; `_moe_adapted` puts it back on the linear layers). A recipe that leaves every expert
    untrained is refused."""
    chosen = experts.targets(base, moe, adapter_cfg.target_modules, adapter_cfg.train_router)
    if not chosen.parameters:
        raise ConfigError([experts.untrained_message(moe, adapter_cfg.target_modules)])
    exclude = outside = outside_the_decoder(base)
    if chosen.exclude:  # one regex (peft's exclude_modules takes a regex or a list, not both)
        routers = "|".join(re.escape(n) for n in chosen.exclude)
        exclude = f"(?:{outside})|(?:{routers})" if outside else f"(?:{routers})"
    lora.target_modules = chosen.modules
    lora.target_parameters = chosen.parameters
    lora.exclude_modules = exclude
    lora.lora_dropout = 0.0
    if chosen.renamed and notes is not None:
        notes.append(
            f"adapter.target_modules: {', '.join(chosen.renamed)} adapted through their weights (peft's "
            f"target_parameters) on this {base.config.model_type} model: peft reads those module names as the "
            "experts' pre-transformers-5 names when it loads an adapter, and leaves parameter targets as they are"
        )
    lora._register_custom_module(experts.custom_modules(moe))
    return lora


def _moe_adapted(model: torch.nn.Module, dropout: float, device: torch.device, notes: list[str] | None) -> None:
    """After peft wrapped an MoE model: LoRA dropout back on its linear layers, the expert kernel chosen for
    `device`, and what the log says about both and about the trained experts."""
    from peft.tuners.lora.layer import ParamWrapper

    linear_lora = experts.linear_lora_class()
    plain: list[Any] = [
        m
        for m in model.modules()
        if hasattr(m, "lora_dropout") and (not isinstance(m, ParamWrapper) or type(m) is linear_lora)
    ]
    if dropout:
        for module in plain:
            for name in module.lora_dropout:
                module.lora_dropout[name] = torch.nn.Dropout(p=dropout)
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper) and hasattr(m.get_base_layer(), "has_gate")]
    trained = sum(p.numel() for m in wrappers for d in (m.lora_A, m.lora_B) for p in d.parameters() if p.requires_grad)
    total = sum(getattr(m.get_base_layer(), m.parameter_name).numel() for m in wrappers)
    dtype = next(p.dtype for p in causal_lm(model).parameters() if p.dim() == 3)
    layers, how = experts.enable(model, device.type, dtype)
    if notes is None:
        return
    notes.append(
        f"mixture of experts: LoRA on {len(wrappers)} routed-expert projections ({total:,} expert weights, "
        f"{trained:,} trainable adapter parameters); routers frozen unless adapter.train_router; "
        f"expert LoRA kernel: {how}"
    )
    if dropout:
        notes.append(
            f"adapter.dropout={dropout:g} applies to the {len(plain)} linear LoRA layers; the routed experts' LoRA "
            "trains without dropout (a dropout cannot be factored out of a fused expert's weight change)"
        )


def quantise_experts(
    model: torch.nn.Module, device: torch.device, notes: list[str] | None
) -> experts_nf4.Quantised | None:
    """A QLoRA model's fused routed experts in NF4 on `device` (trainer/model/experts_nf4.py), which bitsandbytes'
    `load_in_4bit` left in 16 bits, on the host (`load_base`'s `experts_on_host`); then the rest of the model
    (4-bit linear layers, which bitsandbytes moves with their quantisation state, the adapter, embeddings, norms)
    goes to `device` too. None for a model without them. The log says the bytes before and after."""
    moe = experts.find(model)
    if not moe.experts:
        return None
    cls = experts.expert_lora_class()
    wrapped = {id(m.base_layer) for m in model.modules() if type(m) is cls}
    outermost = [m for m in model.modules() if type(m) is cls and id(m) not in wrapped]
    done = experts_nf4.quantise(moe.experts, experts.EXPERT_PARAMS, outermost, device)
    torch.nn.Module.to(model, device)  # in place; the NF4 experts are no parameters and are there already
    causal_lm(model).hf_device_map = {"": device}  # where it now is, as loading on `device` would have said
    if notes is not None and done.parameters:
        notes.append(
            f"QLoRA: {len(done.parameters)} fused routed-expert parameters stored in NF4 per expert "
            f"({done.dense_bytes / 2**20:,.1f} MiB -> {done.nf4_bytes / 2**20:,.1f} MiB), dequantised per routed "
            "expert in the forward and again in the backward"
        )
    return done


def disable_dropout(model: torch.nn.Module) -> int:
    """Every dropout of `model` off in train mode too: its dropout layers (TRL's `disable_dropout_in_model`)
    and the attention dropout its attention modules hold as a probability (`attention_dropout`, read in
    train mode only; TRL leaves it, most models have it 0). Returns the modules changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p = 0.0
            changed += 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout:
            setattr(module, "attention_dropout", 0.0)  # noqa: B010 (typed as Tensor | Module)
            changed += 1
    return changed


def compute_adapters_in_autocast_dtype(model: torch.nn.Module) -> int:
    """Stop peft casting each LoRA layer's input to the adapter's fp32 dtype (a copy of every
    adapted activation, kept for backward); under autocast the matmuls still run in bf16/fp16
    and the fp32 adapter weights stay the optimizer's master copy. Returns the layers changed.

    `cast_input_dtype_enabled` is the switch behind peft's own `helpers.disable_input_dtype_casting`.
    """
    changed = 0
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            setattr(module, "cast_input_dtype_enabled", False)  # noqa: B010 (typed as Tensor | Module)
            changed += 1
    return changed


def compile_layers(model: torch.nn.Module) -> int:
    """torch.compile every decoder layer in place (`model.compile`); returns how many.

    Per layer rather than the whole model: one compiled graph serves every layer, compile time
    stays short, and the loss's hook and host-side bounds stay outside the graph.
    """
    layers = decoder_layers(model, "model.compile", "set model.compile=false")
    for layer in layers:
        layer.compile(dynamic=True)  # the packed row's document count changes every step
    return len(layers)


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process (0.0 when nothing was compiled).

    Read from dynamo's own timers, which are not a public API: anything unexpected there reads
    as 0.0 rather than failing a run. The compile happens in the first steps, which the meter
    leaves out of sustained tokens/s; the ledger's `compile` phase records it and the forecast
    counts it as an item of its own (trainer/model/compile_cache.py, trainer/plan/pilot.py).
    """
    try:
        from torch._dynamo.utils import compilation_time_metrics

        # Each frame's compile, which includes its backward graph where torch compiles it with the
        # forward (always with dynamic shapes: symbolic sizes saved for backward), plus backward
        # graphs compiled lazily at the first backward. `bw_compiler`'s own timer would count an
        # eager backward twice (it runs inside the frame's compile): 70 s against 54 s of wall time.
        keys = ("_compile.compile_inner", "backward._backward_impl")
        return float(sum(sum(compilation_time_metrics.get(k, [])) for k in keys))
    except Exception:  # noqa: BLE001 (a private timer table: its absence must not fail a run)
        return 0.0


def decoder_layers(model: torch.nn.Module, key: str, fix: str) -> torch.nn.ModuleList:
    """The decoder's list of layers (`layers`, or `h` for GPT-2); a ConfigError naming `key` and `fix` if none."""
    decoder = causal_lm(model).get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None:
        raise ConfigError([f"{key}: no decoder layer list found in {type(decoder).__name__}; {fix}"])
    return layers


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant checkpointing (works with DDP, no_sync and frozen inputs).

    transformers 5 names it activation checkpointing; both spellings also hook the input
    embeddings to require grad, which is what lets gradients reach LoRA layers through a
    frozen, checkpointed block.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers < 5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()


def count_params(model: torch.nn.Module) -> ParamCounts:
    """Trainable and frozen parameter counts; a packed 4-bit tensor (NF4 experts too) counts as its logical shape."""
    trainable = frozen = 0
    for p in model.parameters():
        quant_state = getattr(p, "quant_state", None)
        n = int(torch.Size(quant_state.shape).numel()) if quant_state is not None else p.numel()
        if p.requires_grad:
            trainable += n
        else:
            frozen += n
    frozen += sum(
        math.prod(p.shape) for _, nf4 in experts_nf4.quantised_modules(model) for p in nf4.projections.values()
    )
    return ParamCounts(trainable=trainable, frozen=frozen)


def build_optimizer(
    train: TrainConfig, params: list[torch.nn.Parameter], device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only; bitsandbytes 8-bit (paged) variants on request."""
    kwargs: dict[str, Any] = dict(
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, fused=device.type == "cuda", **kwargs)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if train.optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, **kwargs)


@functools.cache
def _takes_download_bar() -> bool:
    """Whether this transformers reads `tqdm_class` in from_pretrained (later 5.x releases); 5.0, the
    floor, hands an unknown keyword to the model's __init__, which refuses it."""
    from transformers import modeling_utils

    resolve = getattr(modeling_utils, "_get_resolved_checkpoint_files", None)
    return resolve is not None and "tqdm_class" in inspect.signature(resolve).parameters
