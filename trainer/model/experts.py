"""Mixture-of-experts models under LoRA: which parameters are routed experts, which modules route, and the
expert LoRA kernel.

transformers 5 stores a layer's routed experts as one 3-D Parameter per projection (`gate_up_proj`,
`up_proj`, `down_proj`: [experts, out, in], or [experts, in, out] where the class says `is_transposed`),
in a module its `use_experts_implementation` decorator marks (`has_gate`, `has_bias`, `_apply_gate`).
peft adapts such a Parameter with `target_parameters` (`lora.ParamWrapper`), whose forward builds
W_e + s * B_e @ A_e for every expert on every call. `ExpertLora` is that same ParamWrapper (same
modules, same state-dict names, same merge, saved in peft's layout, so `PeftModel.from_pretrained` loads
what it saves) with one forward of its own: each routed (token, expert) row gets x @ W_e^T + s * (x @ A_e^T)
@ B_e^T, the rows sorted by expert and multiplied per expert group (`torch.nn.functional.grouped_mm` where
the torch in use runs it on the device and dtype, else a loop over the experts hit, `_ExpertLinear`, whose
backward is written out), so no expert's weight change is ever built. Disabled or merged adapters take peft's own
path. `LinearLora` does the same for the linear layers adapted through their weight (see `targets`).

peft's layout, read in one place (`factors`): lora_A.weight is [experts * r, in] expert-major
(reshape [experts, r, in]); lora_B.weight is [out, r * experts] rank-major (reshape [out, r, experts]).

Routers (`mlp.gate`, gpt-oss's `mlp.router`, Qwen2-MoE's `shared_expert_gate`) are frozen unless
`adapter.train_router`: a LoRA on the router changes which experts see which tokens, which every peer
advises against for fine-tuning.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trainer.model import experts_nf4

EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")
"""The fused expert projections transformers 5 stores as 3-D Parameters."""
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
"""Children of an MoE block that route (or gate the shared expert), beside its `experts`."""
_ALIASES = {
    "gate_up_proj": ("gate_up_proj", "gate_proj", "up_proj", "experts"),
    "up_proj": ("up_proj", "experts"),
    "down_proj": ("down_proj", "experts"),
}
"""target_modules names that select each expert projection: its own, the per-expert names it fuses (a dense
model's list, gate_proj/up_proj/down_proj, keeps meaning every MLP projection), and `experts`."""

GROUPED, LOOP = "grouped_mm", "loop"


@dataclass
class Moe:
    """The routed experts and routers of a model (empty for a dense one)."""

    experts: dict[str, torch.nn.Module] = field(default_factory=dict)
    """Module name -> fused experts module (holding 3-D expert Parameters)."""
    routers: dict[str, torch.nn.Module] = field(default_factory=dict)
    """Module name -> router (or shared-expert gate) of a block with routed experts."""

    def expert_parameters(self) -> list[str]:
        """Full names of every 3-D expert Parameter."""
        return [f"{name}.{p}" for name, module in self.experts.items() for p in _params_of(module)]


def find(model: torch.nn.Module) -> Moe:
    """The fused routed experts of `model` and the routers beside them."""
    moe = Moe()
    names = {id(m): n for n, m in model.named_modules()}
    for name, module in model.named_modules():
        if _params_of(module) and not hasattr(module, "lora_A"):  # the experts, not a peft wrapper around them
            moe.experts[_unwrapped(name)] = module
    for name in list(moe.experts):
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        for child in ROUTER_NAMES:
            router = getattr(parent, child, None)
            if isinstance(router, torch.nn.Module) and id(router) in names:
                moe.routers[_unwrapped(names[id(router)])] = router
    return moe


def _params_of(module: torch.nn.Module) -> list[str]:
    return [
        p
        for p in EXPERT_PARAMS
        if isinstance(getattr(module, p, None), torch.nn.Parameter) and getattr(module, p).dim() == 3
    ]


def _unwrapped(name: str) -> str:
    """A module's name without peft's `base_layer` levels (what target_parameters are matched against)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


@dataclass(frozen=True)
class Targets:
    """What peft adapts on an MoE model."""

    modules: list[str]
    """target_modules: leaf names of the linear layers adapted (attention, shared experts, dense MLPs)."""
    parameters: list[str]
    """target_parameters: each expert Parameter (as `experts.gate_up_proj`, matched as a suffix) adapted, and with
    train_router each non-linear router's weight."""
    exclude: list[str]
    """Router modules kept frozen (full names)."""
    renamed: list[str]
    """Linear layers asked for whose names peft reads as pre-v5 expert names for this model type (DeepSeek's and GLM's
    shared experts and dense layers: gate_proj, up_proj, down_proj): adapted through target_parameters instead (their
    `weight`, as `gate_proj.weight`), which peft's rewrite leaves alone, by `LinearLora`."""


def targets(model: Any, moe: Moe, target_modules: Iterable[str], train_router: bool) -> Targets:
    """peft's targets for `target_modules` (`all-linear` or names) on a model with routed experts.

    Always explicit names, never peft's `all-linear`: on transformers 5, peft rewrites a config's target names for
    the model types whose experts transformers fused (`peft.utils.transformers_weight_conversion`, written to load
    adapters trained on transformers 4), both when the adapter is made and when `PeftModel.from_pretrained` loads
    it: `all-linear` then adapts the router, and a linear layer named like a pre-v5 expert projection (DeepSeek's
    shared experts' `gate_proj`) is dropped or renamed. So such layers are adapted through their `weight` as a
    target parameter (`LinearLora`, the same factors and state-dict names as a linear layer's LoRA), which peft's
    rewrite leaves alone, and the adapter peft loads back is the one that trained."""
    wanted = list(target_modules)
    everything = wanted == ["all-linear"]
    parameters = {
        f"{name.rpartition('.')[2]}.{p}"
        for name, module in moe.experts.items()
        for p in _params_of(module)
        if everything or any(w in _ALIASES[p] for w in wanted)
    }
    router_leaves = {n.rpartition(".")[2] for n in moe.routers}
    if train_router:
        parameters |= {
            f"{n.rpartition('.')[2]}.weight" for n, r in moe.routers.items() if not isinstance(r, torch.nn.Linear)
        }
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    leaves = {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    }
    chosen = {leaf for leaf in leaves if everything or leaf in wanted}
    if not train_router:
        chosen -= router_leaves
    renamed = chosen & _renamed_by_peft(model)
    return Targets(
        modules=sorted(chosen - renamed),
        parameters=sorted(parameters | {f"{leaf}.weight" for leaf in renamed}),
        exclude=[] if train_router else sorted(moe.routers),
        renamed=sorted(renamed),
    )


def _renamed_by_peft(model: torch.nn.Module) -> set[str]:
    """The target names peft rewrites for this model type (see `targets`); empty where it rewrites none."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft without the conversion rewrites nothing
        return set()
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)  # peft's own table (no public accessor)
    if pattern is None or not conversion._MOE_FUSED_TARGETS.get(pattern):
        return set()
    return set(conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {}))


def untrained_message(moe: Moe, target_modules: Iterable[str]) -> str:
    """Why a model with routed experts none of which is adapted is refused, and the fix."""
    names = moe.expert_parameters()
    shown = ", ".join(names[:4]) + (f" ... ({len(names)} in all)" if len(names) > 4 else "")
    return (
        f"adapter.target_modules: {list(target_modules)} puts no LoRA adapter on this model's routed experts "
        f"({shown}), so every expert would stay untrained. Set adapter.target_modules to all-linear, or add "
        "gate_up_proj and down_proj (the fused expert projections) to it"
    )


# ---------------------------------------------------------------------------- the kernel


@functools.cache
def kernel(device_type: str, dtype: torch.dtype) -> tuple[str, str]:
    """(`grouped_mm` or `loop`, why) for expert LoRA on this device type and dtype: grouped_mm where the torch in
    use has it and a probe's forward and backward run and agree with the loop (`probe`), but on CPU."""
    if device_type == "cpu" and hasattr(F, "grouped_mm"):
        return LOOP, (
            "on CPU the per-expert loop measured as fast as grouped_mm or faster (benchmarks/moe_lora.py), "
            "with no alignment rule on the rank"
        )
    return probe(device_type, dtype)


@functools.cache
def probe(device_type: str, dtype: torch.dtype) -> tuple[str, str]:
    """(`grouped_mm` or `loop`, why): whether grouped_mm runs on this device type and dtype, forward and backward,
    and agrees with the per-expert loop."""
    grouped = getattr(F, "grouped_mm", None)
    if grouped is None:
        return LOOP, "this torch has no torch.nn.functional.grouped_mm"
    device = torch.device(device_type)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(3, 48, 32, generator=gen).to(device, dtype).requires_grad_()
    counts = torch.tensor([5, 0, 19])
    try:
        y = _grouped(x, w.transpose(1, 2), counts.cumsum(0).to(device, torch.int32))
        y.backward(torch.ones_like(y))
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        ref = torch.cat([a @ w[e].t() for e, a in enumerate(x.split(counts.tolist()))])
        ref.backward(torch.ones_like(ref))
        assert gx is not None and gw is not None and x.grad is not None and w.grad is not None
    except (RuntimeError, NotImplementedError) as e:  # no kernel for this device/dtype/shape
        return LOOP, f"grouped_mm does not run on {device_type} {dtype}: {str(e).splitlines()[0]}"
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if not all(
        torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in ((y, ref), (gx, x.grad), (gw, w.grad))
    ):
        return LOOP, f"grouped_mm disagrees with the per-expert loop on {device_type} {dtype}"
    return GROUPED, f"torch.nn.functional.grouped_mm on {device_type} {dtype}"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward refuses an expanded one
    (strides 0, as `y.sum()` gives)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (sorted by group, group g ending at offsets[g]) times w[g] ([groups, in, out])."""
    return _ContiguousGrad.apply(F.grouped_mm(x, w, offs=offsets))


def _aligned(a: torch.Tensor, w: torch.Tensor) -> bool:
    """grouped_mm's layout rule: every row of each operand starts on a 16-byte boundary (a hidden size of 2,880
    in bf16 is; a rank of 6 in fp32 is not, and goes through the loop)."""
    return all(t.size(-1) * t.element_size() % 16 == 0 for t in (a, w))


def _per_group(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same as `_grouped`, one matmul per non-empty group."""
    parts = [part @ w[e] for e, part in enumerate(x.split(counts)) if part.size(0)]
    return torch.cat(parts) if parts else x.new_zeros(0, w.size(-1))


Factors = list[tuple[torch.Tensor, torch.Tensor, float]]
"""Per expert Parameter: (A [experts, r, in], B [experts, out, r], scaling) of each active adapter."""


class _ExpertLinear(torch.autograd.Function):
    """Rows sorted by expert (group e: `sizes[e]` rows) times w[e] ([experts, in, out]) plus each adapter's
    s * (x @ A_e^T) @ B_e^T, one loop over the experts hit, forward and backward.

    Why not autograd over per-expert matmuls: indexing A[e] and B[e] makes autograd build a zero tensor the size of
    the whole factor per expert and add it up (a memset and an add of every factor per expert hit), and the per-group
    outputs are concatenated and rescaled in more full-size passes. Here every result is written in place into one
    output (`mm(out=)`, `addmm_`), factor gradients go straight into their expert's slice, and the backward saves
    only the sorted input and the thin x @ A_e^T (rows x r); the frozen expert weight gets no gradient unless it
    requires one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sizes: list[int], scalings: list[float], *ab: Any) -> Any:
        out = x.new_empty(x.size(0), w.size(-1))
        lows = [x.new_empty(x.size(0), a.size(1)) for a in ab[0::2]]
        start = 0
        for e, n in enumerate(sizes):
            if not n:
                continue
            rows = slice(start, start + n)
            torch.mm(x[rows], w[e], out=out[rows])
            for low, a, b, s in zip(lows, ab[0::2], ab[1::2], scalings, strict=True):
                torch.mm(x[rows], a[e].t(), out=low[rows])
                out[rows].addmm_(low[rows], b[e].t(), alpha=s)
            start += n
        ctx.sizes, ctx.scalings = sizes, scalings
        ctx.save_for_backward(x, w, *lows, *ab)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w, *rest = ctx.saved_tensors
        lows, ab = rest[: len(ctx.scalings)], rest[len(ctx.scalings) :]
        grad = grad.contiguous()
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros_like(w) if want_w else None
        # B's gradient is built as [experts, r, out] and handed on transposed: low^T @ g into a contiguous [r, out]
        # runs at twice the speed of g^T @ low into [out, r] (measured on CPU at rank 16).
        grad_ab: list[torch.Tensor | None] = []
        for i, t in enumerate(ab):
            if not ctx.needs_input_grad[4 + i]:
                grad_ab.append(None)
            else:  # A: [experts, r, in]; B: [experts, r, out]
                grad_ab.append(t.new_zeros(t.size(0), t.size(2), t.size(1)) if i % 2 else torch.zeros_like(t))
        start = 0
        for e, n in enumerate(ctx.sizes):
            if not n:
                continue
            rows = slice(start, start + n)
            g = grad[rows]
            if grad_x is not None:
                torch.mm(g, w[e].t(), out=grad_x[rows])
            if grad_w is not None:
                torch.mm(x[rows].t(), g, out=grad_w[e])
            for i, (low, s) in enumerate(zip(lows, ctx.scalings, strict=True)):
                a, b = ab[2 * i][e], ab[2 * i + 1][e]
                grad_low = torch.mm(g, b).mul_(s)  # [rows, r]
                if grad_x is not None:
                    grad_x[rows].addmm_(grad_low, a)
                if (grad_a := grad_ab[2 * i]) is not None:
                    torch.mm(grad_low.t(), x[rows], out=grad_a[e])
                if (grad_b := grad_ab[2 * i + 1]) is not None:
                    torch.mm(low[rows].t(), g, out=grad_b[e]).mul_(s)
            start += n
        grads = [t if t is None or i % 2 == 0 else t.transpose(1, 2) for i, t in enumerate(grad_ab)]
        return grad_x, grad_w, None, None, *grads


def experts_forward(
    experts: Any,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: dict[str, Factors],
    grouped: bool,
) -> torch.Tensor:
    """The experts module's output with LoRA on its expert Parameters, per routed token (see the module
    docstring); the same maths as transformers' grouped_mm experts forward plus each adapter's term."""
    tokens, top_k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    x = hidden[order // top_k]
    counts = torch.bincount(expert_ids, minlength=experts.num_experts)
    offsets = counts.cumsum(0).to(torch.int32)
    # Under QLoRA the experts with rows are dequantised (trainer/model/experts_nf4.py): the counts are read once
    # for both projections (on a GPU the grouped path's only host sync); 16-bit grouped experts never read them.
    quantised = experts_nf4.storage(experts) is not None
    sizes = counts.tolist() if quantised or not grouped else None
    hit = [e for e, n in enumerate(sizes) if n] if sizes is not None and quantised else []

    def matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # w: [experts, in, out]
        if grouped and _aligned(a, w):
            return _grouped(a, w, offsets)
        return _per_group(a, w, sizes if sizes is not None else counts.tolist())

    def project(name: str, a: torch.Tensor) -> torch.Tensor:
        weight = experts_nf4.weight(experts, name, hit)  # the Parameter, or under QLoRA the experts hit, dequantised
        a = a.to(weight.dtype)
        w = weight if experts.is_transposed else weight.transpose(1, 2)
        adapters = [(la.to(weight.dtype), lb.to(weight.dtype), s) for la, lb, s in lora.get(name, ())]
        if sizes is not None:  # the loop: one pass over the experts hit, its backward written out
            flat = [t for la, lb, _ in adapters for t in (la, lb)]
            out = _ExpertLinear.apply(a, w, sizes, [s for *_, s in adapters], *flat)
        else:
            out = matmul(a, w)
            for lora_a, lora_b, scaling in adapters:
                low = matmul(a, lora_a.transpose(1, 2))  # [rows, r]
                out = torch.add(out, matmul(low, lora_b.transpose(1, 2)), alpha=scaling)  # one pass, not two
        if experts.has_bias:
            out = out + getattr(experts, f"{name}_bias")[expert_ids]
        return out

    up = project("gate_up_proj" if experts.has_gate else "up_proj", x)
    act = experts._apply_gate(up) if experts.has_gate else experts.act_fn(up)
    out = project("down_proj", act)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    unsorted = torch.empty_like(out).index_copy(0, order, out)  # back to (token, k) order
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def factors(wrapper: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [experts, r, in], B [experts, out, r], scaling) of one adapter of a peft ParamWrapper, read from
    peft's layout: lora_A expert-major, lora_B rank-major (peft's `get_delta_factors`)."""
    experts = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    return (
        a.reshape(experts, -1, a.shape[-1]),
        b.reshape(b.shape[0], -1, experts).permute(2, 0, 1).contiguous(),  # grouped_mm reads it row by row
        float(wrapper.scaling[adapter]),
    )


@functools.cache
def expert_lora_class() -> type:
    """`ExpertLora`: peft's ParamWrapper with the per-token forward. Defined on first use, because importing
    peft imports bitsandbytes (trainer/model/load.py imports peft only under `bitsandbytes_only_if_loaded`)."""
    from peft.tuners.lora.layer import ParamWrapper

    class ExpertLora(ParamWrapper):
        """peft's `ParamWrapper` on a fused expert Parameter, computing LoRA per routed token."""

        # peft nests a second expert Parameter's wrapper around the first only when the first's class is *named*
        # ParamWrapper (tuners_utils.create_and_replace_param compares names to avoid an import); a subclass is one.

        use_grouped_mm = False
        """Set per model by `enable` (the kernel `kernel` chose for its device and dtype)."""

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            chain: list[Any] = [self]
            inner: Any = self.base_layer
            while isinstance(inner, ParamWrapper):
                chain.append(inner)
                inner = inner.base_layer
            quantised = experts_nf4.storage(inner) is not None  # NF4 experts: only this kernel reads them
            fast = (
                (quantised or not self.disable_adapters)
                and "adapter_names" not in kwargs
                and all(type(w) is type(self) and not w.merged for w in chain)
                and hasattr(inner, "has_gate")
            )
            if not fast and quantised:
                raise NotImplementedError(
                    "this model's routed experts are NF4 (QLoRA), which only spotune's expert kernel reads: peft's "
                    "merge and mixed-adapter batches need 16-bit experts. A merged model: `spotune export --merge`, "
                    "which merges into the 16-bit base"
                )
            if not fast:
                return super().forward(x, *args, **kwargs)
            routing = [*args, *kwargs.values()]
            lora = {
                w.parameter_name: [factors(w, a) for a in w.active_adapters if a in w.lora_A]
                for w in chain
                if not self.disable_adapters
            }
            return experts_forward(inner, x, routing[0], routing[1], lora, self.use_grouped_mm)

    ExpertLora.__name__ = "ParamWrapper"
    return ExpertLora


@functools.cache
def linear_lora_class() -> type:
    """`LinearLora`: peft's ParamWrapper on a linear layer's 2-D `weight` (a layer `targets` adapts through
    target_parameters) computing what peft's `lora.Linear` computes, x @ W^T + s * B(A(dropout(x))), instead of
    building W + s * B @ A on every forward and a gradient the size of W. Same factors and names as the
    ParamWrapper peft loads back (which gives the same outputs without dropout); the dropout is the linear layers'
    (`load._moe_adapted` sets it)."""
    from peft.tuners.lora.layer import ParamWrapper

    class LinearLora(ParamWrapper):
        """peft's `ParamWrapper` on an `nn.Linear`'s weight, computed as peft's `lora.Linear`."""

        def _get_in_out_features(self, module: Any) -> tuple[int, int]:
            # The layer's own sizes, not its weight's shape: under QLoRA the weight is bitsandbytes' packed 4-bit
            # bytes ([n, 1]), the layer still maps in_features to out_features.
            linear = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            self.num_experts, self._param_ndim = 1, 2
            return int(linear.in_features), int(linear.out_features)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            base = self.base_layer
            if (
                self.disable_adapters
                or self.merged
                or "adapter_names" in kwargs
                or not isinstance(base, torch.nn.Linear)
            ):
                return super().forward(x, *args, **kwargs)
            out = base(x, *args, **kwargs)
            dtype = out.dtype
            for name in self.active_adapters:
                if name in self.lora_A:
                    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                    low = lora_a(self.lora_dropout[name](x.to(next(lora_a.parameters()).dtype)))
                    out = out + lora_b(low) * self.scaling[name]
            return out.to(dtype)

    LinearLora.__name__ = "ParamWrapper"  # as ExpertLora: peft recognises its wrappers by class name
    return LinearLora


def _linear_by_parameter(target: Any, adapter_name: str, **kwargs: Any) -> Any:
    """peft's dispatch for a linear layer: a `LinearLora` where it is adapted through target_parameters, else None
    (peft then makes its own `lora.Linear`, as for the attention)."""
    if kwargs.get("parameter_name") is None:
        return None
    linear = target.get_base_layer() if hasattr(target, "get_base_layer") else target
    packed_4bit = hasattr(linear.weight, "quant_state")  # bitsandbytes' Params4bit: its forward dequantises
    if tuple(linear.weight.shape) != (linear.out_features, linear.in_features) and not packed_4bit:
        raise ValueError(
            f"{type(linear).__name__} stores its weight as {tuple(linear.weight.shape)}, not [out, in]: a linear layer "
            "peft renames on loading (gate_proj, up_proj, down_proj) can be adapted through its weight only where "
            "that weight is [out, in] or bitsandbytes' 4-bit"
        )
    return linear_lora_class()(target, adapter_name, **kwargs)


def custom_modules(moe: Moe) -> dict[type, Any]:
    """peft's custom-module mapping (`LoraConfig._register_custom_module`) that makes each fused experts class's
    wrapper an `ExpertLora`, and a linear layer's adapted through its weight a `LinearLora`."""
    mapping: dict[type, Any] = {type(module): expert_lora_class() for module in moe.experts.values()}
    mapping[torch.nn.Linear] = _linear_by_parameter
    return mapping


def enable(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> tuple[int, str]:
    """Choose the kernel for `model`'s ExpertLora layers; returns (layers, the choice and why)."""
    choice, why = kernel(device_type, dtype)
    cls = expert_lora_class()
    layers: list[Any] = [m for m in model.modules() if type(m) is cls]
    for layer in layers:
        layer.use_grouped_mm = choice == GROUPED
    return len(layers), f"{choice} ({why})"
