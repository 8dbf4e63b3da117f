"""Where one optimizer step's time goes: `benchmarks/gpu.py --profile`.

One step runs under torch.profiler (CPU ops with their input shapes, plus CUDA kernels on a
GPU). Every kernel is put in one bucket by `bucket`, a pure function of the kernel's name, the
ops that launched it (innermost first) and the input shapes of the nearest matmul op:

    optimizer      anything under `Optimizer.step` / `Optimizer.zero_grad`, fused Adam kernels
    head_loss      cross-entropy / log-softmax / Liger's loss kernels; matmuls with a vocab-sized dim
    attention      the attention kernels and everything under them (sdpa, flash, varlen, flex)
    lora_matmul    matmuls with a dim equal to the LoRA rank (A: [T, in] x [in, r], B: [T, r] x [r, out],
                   and their gradients), or to 2r / 3r under adapter.fused (`lora_widths`)
    base_matmul    every other matmul: the frozen q/k/v/o and MLP projections
    cast_copy      dtype casts, copies, fills, memcpy/memset, concatenation and gathers
    norm_act_rope  the remaining elementwise maths: RMSNorm, SwiGLU, rotary, residual adds, LoRA scaling
    other          what no rule names (embedding lookup, reductions, ...)
    idle           time inside the step where the device runs no kernel (launch gaps, host syncs)

On CUDA the times are kernel times and `idle` is the step's span on the device timeline less
the union of its kernels. On CPU (the `--tiny` smoke run, and the tests) each op's own time
(less its children's) stands for a kernel, and `idle` is host time between top-level ops. Buckets plus idle sum to the span.

Limits of a name rule: a base matmul with a dim equal to a LoRA width would be counted as LoRA
(a token count of r; under adapter.fused a projection 2r or 3r wide, which only tiny models have); LoRA's scaling multiply and its add into the base output are elementwise
ops and land in norm_act_rope. Both are small against what the buckets are for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

BUCKETS = (
    "base_matmul",
    "lora_matmul",
    "attention",
    "norm_act_rope",
    "head_loss",
    "optimizer",
    "cast_copy",
    "other",
)
IDLE = "idle"

_MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_scaled_mm",
}
_MATMUL_KERNEL = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sgemm", "hgemm")
_OPTIMIZER = ("optimizer.", "adam")
_LOSS = ("cross_entropy", "crossentropy", "log_softmax", "logsumexp", "nll_loss", "liger_fused_linear")
_ATTENTION = ("attention", "flash", "fmha", "sdpa", "varlen", "flex_", "spotune_varlen")
_CAST_COPY = ("copy", "_to_copy", "aten::to", "clone", "contiguous", "cast", "memcpy", "memset", "fill", "zero")
_CAST_COPY += ("aten::cat", "cat_", "index_select", "aten::index", "gather", "scatter", "aten::empty")
_ELEMENTWISE = ("rms", "norm", "silu", "swiglu", "gelu", "sigmoid", "rope", "rotary", "rsqrt", "pow", "mul")
_ELEMENTWISE += ("add", "sub", "neg", "sin", "cos", "mean", "div", "exp", "elementwise", "triton_poi")


@dataclass(frozen=True)
class Kernel:
    """One kernel (or, on CPU, one leaf op) of the profiled step."""

    name: str
    ops: tuple[str, ...]
    """The op that launched it, then its parents outward (autograd nodes and annotations too)."""
    dims: frozenset[int]
    """Sizes in the input shapes of the nearest matmul op in `ops` (else of the launching op)."""
    us: float


def lora_widths(rank: int, fused: bool) -> frozenset[int]:
    """The matmul widths that mark LoRA work: r, and under `adapter.fused` the 2r / 3r of the fused A."""
    return frozenset({rank, 2 * rank, 3 * rank} if fused else {rank})


def bucket(kernel: Kernel, lora: frozenset[int], vocab: int) -> str:
    """The bucket of one kernel (see the module docstring for the rules, first match wins)."""
    names = [kernel.name.lower(), *(op.lower() for op in kernel.ops)]

    def any_has(words: Iterable[str], within: list[str] = names) -> bool:
        return any(w in n for n in within for w in words)

    if any_has(_OPTIMIZER):
        return "optimizer"
    if any_has(_LOSS):
        return "head_loss"
    if any_has(_ATTENTION):
        return "attention"
    if any(op in _MATMUL_OPS for op in kernel.ops) or any_has(_MATMUL_KERNEL, names[:1]):
        if vocab in kernel.dims:
            return "head_loss"
        return "lora_matmul" if lora & kernel.dims else "base_matmul"
    leaf = names[:2]  # the kernel and the op that launched it decide what elementwise work it is
    if any_has(_CAST_COPY, leaf):
        return "cast_copy"
    if any_has(_ELEMENTWISE, leaf):
        return "norm_act_rope"
    return "other"


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def breakdown(
    kernels: list[Kernel], intervals: list[tuple[float, float]], lora: frozenset[int], vocab: int
) -> dict[str, float]:
    """Microseconds per bucket plus `idle` and `total` (the span of `intervals`).

    Where kernels overlap (several streams) their summed time exceeds the busy time; buckets are
    then scaled by busy / summed. Busy time no op launched (kernels the profiler links to no op)
    goes to `other`. Either way buckets + idle = total.
    """
    out = dict.fromkeys(BUCKETS, 0.0)
    for k in kernels:
        out[bucket(k, lora, vocab)] += k.us
    span = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0
    busy = union_us(intervals)
    summed = sum(out.values())
    if summed > busy:
        out = {b: t * busy / summed for b, t in out.items()}
    else:
        out["other"] += busy - summed
    out[IDLE] = span - busy
    out["total"] = span
    return out


def _chain(evt: Any) -> tuple[str, ...]:
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return tuple(names)


def _dims(evt: Any) -> frozenset[int]:
    at = evt
    while at is not None and at.name not in _MATMUL_OPS:
        at = at.cpu_parent
    shapes = (at or evt).input_shapes or []
    return frozenset(d for s in shapes if isinstance(s, list) for d in s if isinstance(d, int))


def kernels_of(prof: Any, cuda: bool) -> tuple[list[Kernel], list[tuple[float, float]]]:
    """(kernels, their [start, end) intervals in µs) of a finished torch.profiler run."""
    events = prof.events()
    if cuda:
        kernels = [
            Kernel(k.name, _chain(e), _dims(e), float(k.duration))
            for e in events
            if e.device_type == torch.autograd.DeviceType.CPU
            for k in e.kernels
        ]
        device = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
        return kernels, [(e.time_range.start, e.time_range.end) for e in device]
    # On CPU an op's own time (less its children's) is its kernel; top-level ops cover the busy time.
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async]
    kernels = [Kernel(e.name, _chain(e), _dims(e), float(e.self_cpu_time_total)) for e in ops]
    return kernels, [(e.time_range.start, e.time_range.end) for e in ops if e.cpu_parent is None]


def profile_step(
    step: Callable[[], None], lora: frozenset[int], vocab: int, trace: str | None = None
) -> dict[str, Any]:
    """Run `step` (one optimizer step, synchronised at its end) under torch.profiler: ms and share
    per bucket, idle, and the ten kernels that took longest with their buckets."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step()
    if trace:
        prof.export_chrome_trace(trace)
    kernels, intervals = kernels_of(prof, cuda)
    us = breakdown(kernels, intervals, lora, vocab)
    total = us["total"] or 1.0
    by_name: dict[tuple[str, str], float] = {}
    for k in kernels:
        key = (k.name[:80], bucket(k, lora, vocab))
        by_name[key] = by_name.get(key, 0.0) + k.us
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {
        "timeline": "cuda kernels" if cuda else "cpu ops, self time",
        "total_ms": total / 1000,
        "ms": {b: t / 1000 for b, t in us.items() if b != "total"},
        "share": {b: t / total for b, t in us.items() if b != "total"},
        "top_kernels": [{"name": n, "bucket": b, "ms": t / 1000} for (n, b), t in top],
    }


def summary(profile: dict[str, Any]) -> str:
    """One line per bucket, largest first: the profile summary (docs/gpu.md)."""
    rows = sorted(profile["share"].items(), key=lambda kv: -kv[1])
    lines = [f"profile of one step ({profile['timeline']}): {profile['total_ms']:.1f} ms"]
    lines += [f"  {b:14} {profile['ms'][b]:9.2f} ms {s:7.1%}" for b, s in rows]
    return "\n".join(lines)
