"""QLoRA's frozen NF4 base matmul: bitsandbytes' dequantise-then-matmul against the alternatives.

On a CUDA machine (random weights; not yet run on a GPU: most of its time will be the
max-autotune path tuning a forward and a backward GEMM per shape and token count):
    .venv/bin/python -m pip install --no-deps torchao   # in no extra: see docs/benchmarks.md
    .venv/bin/python benchmarks/nf4_matmul.py --json runs/bench-nf4.json

What a QLoRA step does at every frozen linear layer, forward and backward (the input's gradient
is needed, the NF4 weight is frozen; the LoRA adapter on top is the same work on every path and
is left out), on the Llama-3.1-8B shapes (weight out x in: q/o 4096x4096, gate/up 14336x4096,
down 4096x14336, k/v 1024x4096) at 4096, 16384 and 65536 tokens per micro-batch, bf16:
- bnb_matmul_4bit: `bnb.matmul_4bit`, what peft's LoRA Linear4bit runs (it calls
  bitsandbytes' Linear4bit.forward, which calls matmul_4bit). bitsandbytes 0.50 has a fused
  4-bit GEMM only for at most 1536 rows (on an H100 at most 32 on these shapes, by its
  dispatch heuristic); past that, and in every backward, it dequantises the whole weight to
  bf16 and calls cuBLAS. The ratio column divides by this path.
- bnb_dequant_linear: that fallback written out (dequantize_4bit + F.linear, dequantised again
  in backward): checks that the path above is what it says at these sizes.
- torchao_nf4: torchao's NF4Tensor + linear_nf4 (what torchtune uses): NF4 dequantised by
  PyTorch ops (a LUT gather and scale), then F.linear; again in backward.
- torchao_nf4_compiled: the same under torch.compile: Inductor should generate the
  dequantisation as one Triton kernel; the matmul stays cuBLAS.
- torchao_nf4_autotune: torch.compile(mode="max-autotune-no-cudagraphs"): Inductor tunes Triton
  GEMM templates against cuBLAS, and could fuse the dequantisation into a template's prologue
  (`prologue_fusion`, on by default), which would be a fused NF4 dequant+matmul from kept
  libraries, forward and backward; by reading its heuristic, it will not (next path).
- torchao_nf4_invoke_quant: Inductor's prologue fusion refuses a dequantisation that does
  arithmetic in bf16 (torch/_inductor/scheduler.py, check_prologue_fusion_heuristics_fusable)
  unless it is marked with PyTorch's InvokeQuant (torch._higher_order_ops, a private API); this
  path marks torchao's NF4 dequantisation (its ops written out, bit-exact with torchao's) so,
  under max-autotune, the GEMM reads the 4-bit weight itself.
- bnb_invoke_quant: the same marking on bitsandbytes' own storage (its dequantize_4bit written
  out in plain ops, bit-exact with it on CPU): the path spotune could take without changing how
  QLoRA loads, checkpoints or shards, only the frozen linears' forward.
- bf16_dense: F.linear on the bf16 weight: the floor no dequantising path can beat.
The gap between bnb_matmul_4bit and bf16_dense is the most any fused kernel can win.

Before timing, every path's output and input gradient are checked against a dense matmul of
that path's own dequantised weight, and torchao's NF4 against bitsandbytes' NF4 (the two round
the block scales differently: they agree to ~2% where NF4 itself is ~9% off the bf16 weight),
so the table cannot silently compare different maths. Paths whose library is absent are
skipped with the reason. Without CUDA it runs a tiny shape on CPU, eager paths only, labelled
as CPU figures that say nothing about GPU speed, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# Llama-3.1-8B's frozen linear weights, (out_features, in_features).
SHAPES: dict[str, tuple[int, int]] = {
    "q_o": (4096, 4096),
    "gate_up": (14336, 4096),
    "down": (4096, 14336),
    "k_v": (1024, 4096),
}
TOKENS = (4096, 16384, 65536)
CPU_SHAPES = {"tiny": (256, 512)}
CPU_TOKENS = (64, 256)
BASELINE = "bnb_matmul_4bit"
PATHS = (
    "bf16_dense",
    BASELINE,
    "bnb_dequant_linear",
    "bnb_invoke_quant",
    "torchao_nf4",
    "torchao_nf4_compiled",
    "torchao_nf4_autotune",
    "torchao_nf4_invoke_quant",
)
SELF_TOL = 1e-2  # a path against a dense matmul of its own dequantised weight: bf16 matmul noise
CROSS_TOL = 5e-2  # torchao NF4 against bitsandbytes NF4 (measured ~2.3% in bf16; FP4 is ~15% off)

Forward = Callable[[torch.Tensor], torch.Tensor]


class _DequantLinear(torch.autograd.Function):
    """bitsandbytes' training fallback written out: dequantise, F.linear; dequantise again for
    the input's gradient (the 4-bit weight is frozen, so it gets none)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, state: Any) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        ctx.packed, ctx.state = packed, state
        return F.linear(x, dequantize_4bit(packed, state).to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        from bitsandbytes.functional import dequantize_4bit

        return grad @ dequantize_4bit(ctx.packed, ctx.state).to(grad.dtype), None, None


def _torchao_nf4() -> tuple[Callable[..., Any], Callable[..., torch.Tensor]]:
    """torchao's to_nf4 and linear_nf4 (moved out of torchao.dtypes.nf4tensor in later releases)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4  # type: ignore[no-redef]
    return to_nf4, linear_nf4


def nf4_dequant(
    qdata: torch.Tensor, qscalers: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor, lut: torch.Tensor
) -> torch.Tensor:
    """torchao's NF4Tensor.get_original_weight in plain ops (blocks of 64, scaler blocks of 256),
    flat: InvokeQuant needs a function of tensors only. The caller views it to the weight's shape."""
    scalers = (qscalers.view(factor.numel(), -1) / factor.unsqueeze(-1)).flatten().to(lut.dtype) + mean
    per_byte = scalers.unsqueeze(-1).expand(-1, 32).flatten()  # two 4-bit values per byte
    high = lut[(qdata >> 4).long()] * per_byte
    low = lut[(qdata & 0xF).long()] * per_byte
    return torch.stack([high, low], dim=-1)


def bnb_nf4_dequant(
    packed: torch.Tensor,
    absmax_u8: torch.Tensor,
    code2: torch.Tensor,
    absmax2: torch.Tensor,
    offset: torch.Tensor,
    code: torch.Tensor,
) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit of a double-quantised weight (blocks of 64, the 8-bit block
    scales in blocks of 256) in plain fp32 ops, flat, high nibble first; bf16 like the compute."""
    absmax = (code2[absmax_u8.long()].view(absmax2.numel(), -1) * absmax2.unsqueeze(-1)).flatten() + offset
    per_byte = absmax.unsqueeze(-1).expand(-1, 32).flatten()
    flat = packed.flatten()
    high = code[(flat >> 4).long()] * per_byte
    low = code[(flat & 0xF).long()] * per_byte
    return torch.stack([high, low], dim=-1).to(torch.bfloat16)


def invoke_quant_path(
    dequant: Callable[..., torch.Tensor], inner: tuple, shape: tuple[int, ...], **compile_kwargs: Any
) -> Forward | str:
    """F.linear on `dequant(*inner)` marked with InvokeQuant, compiled with `compile_kwargs`, by
    default max-autotune (only it tries Triton GEMM templates, and so prologue fusion)."""
    try:
        from torch._higher_order_ops import InvokeQuant
    except ImportError:
        return f"skipped: torch {torch.__version__} has no torch._higher_order_ops.InvokeQuant"
    mark = InvokeQuant()  # codegen_low_precision: the prologue is generated in the dtypes it names

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, mark(dequant, *inner).view(shape))

    return torch.compile(forward, dynamic=False, **(compile_kwargs or {"mode": "max-autotune-no-cudagraphs"}))


NOT_COMPILED = "skipped: torch.compile's fusion is what this path measures, and only on CUDA"


def build_paths(weight: torch.Tensor, *, compiled: bool, quant_type: str = "nf4") -> dict[str, Any]:
    """Each path as (forward, its own dequantised weight), or a string saying why it was skipped.
    `quant_type="fp4"` quantises bitsandbytes' side as FP4: the control the checks must catch."""
    paths: dict[str, Any] = {"bf16_dense": (lambda x: F.linear(x, weight), weight)}
    return paths | _bnb_paths(weight, compiled, quant_type) | _torchao_paths(weight, compiled)


def _bnb_paths(weight: torch.Tensor, compiled: bool, quant_type: str) -> dict[str, Any]:
    names = (BASELINE, "bnb_dequant_linear", "bnb_invoke_quant")
    try:
        import bitsandbytes as bnb
        from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    except ImportError as e:
        return dict.fromkeys(names, f"skipped: bitsandbytes not importable ({e})")
    # QLoRA's settings (trainer/model/load.py): NF4, blocks of 64, double-quantised scales.
    packed, state = quantize_4bit(weight, quant_type=quant_type, blocksize=64, compress_statistics=True)
    own = dequantize_4bit(packed, state).to(weight.dtype)
    paths: dict[str, Any] = {
        BASELINE: (lambda x: bnb.matmul_4bit(x, packed.t(), quant_state=state), own),
        "bnb_dequant_linear": (lambda x: _DequantLinear.apply(x, packed, state), own),
    }
    if not compiled:
        return paths | {"bnb_invoke_quant": NOT_COMPILED}
    if weight.dtype != torch.bfloat16 or state.absmax.numel() % state.state2.blocksize:
        return paths | {"bnb_invoke_quant": "skipped: written for bf16 and whole blocks of 256 scales"}
    inner = (packed, state.absmax, state.state2.code, state.state2.absmax, state.offset, state.code)
    fused = invoke_quant_path(bnb_nf4_dequant, inner, tuple(state.shape))
    return paths | {"bnb_invoke_quant": fused if isinstance(fused, str) else (fused, own)}


def _torchao_paths(weight: torch.Tensor, compiled: bool) -> dict[str, Any]:
    compiled_names = ("torchao_nf4_compiled", "torchao_nf4_autotune", "torchao_nf4_invoke_quant")
    try:
        to_nf4, linear_nf4 = _torchao_nf4()
    except ImportError as e:
        return dict.fromkeys(("torchao_nf4", *compiled_names), f"skipped: torchao not importable ({e})")
    nf4 = to_nf4(weight, 64, 256)  # QLoRA's block of 64, double-quantised scales in blocks of 256
    own = nf4.to(weight.dtype)
    paths: dict[str, Any] = {"torchao_nf4": (lambda x: linear_nf4(x, nf4), own)}
    if not compiled:
        return paths | dict.fromkeys(compiled_names, NOT_COMPILED)
    # A fresh compiled function per weight: each shape is its own static-shape graph.
    plain = torch.compile(lambda x: linear_nf4(x, nf4), dynamic=False)
    tuned = torch.compile(lambda x: linear_nf4(x, nf4), dynamic=False, mode="max-autotune-no-cudagraphs")
    paths["torchao_nf4_compiled"] = (plain, own)
    paths["torchao_nf4_autotune"] = (tuned, own)
    inner = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean, nf4.nf4)
    fused = invoke_quant_path(nf4_dequant, inner, tuple(nf4.shape))
    paths["torchao_nf4_invoke_quant"] = fused if isinstance(fused, str) else (fused, own)
    return paths


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _run(fn: Forward, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    y = fn(x)
    y.backward(g)
    assert x.grad is not None
    return y.detach(), x.grad


def check_paths(
    paths: dict[str, Any],
    x: torch.Tensor,
    g: torch.Tensor,
    seconds: dict[str, float] | None = None,
    failed: dict[str, str] | None = None,
) -> dict[str, dict[str, float]]:
    """Each path's output and input gradient against a dense matmul of its own dequantised weight
    (within SELF_TOL), and torchao's NF4 against bitsandbytes' (within CROSS_TOL); raises where
    a path computes something else. `seconds` gets each path's first call (its compile time);
    with `failed`, a path that raises (a compile error, say) is recorded there and left out."""
    found: dict[str, dict[str, float]] = {}
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, path in paths.items():
        if isinstance(path, str):
            continue
        fn, own = path
        _sync(x.device)
        t0 = time.perf_counter()
        try:
            y, dx = outputs[name] = _run(fn, x, g)
        except Exception as e:  # noqa: BLE001 (one path failing must not lose the others' figures)
            if failed is None:
                raise
            failed[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            continue
        _sync(x.device)
        if seconds is not None:
            seconds[name] = time.perf_counter() - t0
        ref_y, ref_dx = _run(lambda t, w=own: F.linear(t, w), x, g)
        found[name] = {"output": _rel(y, ref_y), "input_grad": _rel(dx, ref_dx)}
        if max(found[name].values()) > SELF_TOL:
            raise AssertionError(
                f"{name} is not a matmul with its own dequantised weight: relative error {found[name]} "
                f"over {SELF_TOL} (benchmarks/nf4_matmul.py would time different maths)"
            )
    if BASELINE in outputs and "torchao_nf4" in outputs:
        (by, bdx), (ay, adx) = outputs[BASELINE], outputs["torchao_nf4"]
        cross = {"output": _rel(ay, by), "input_grad": _rel(adx, bdx)}
        found["torchao_vs_bnb"] = cross
        if max(cross.values()) > CROSS_TOL:
            raise AssertionError(
                f"torchao's NF4 and bitsandbytes' 4-bit path disagree by {cross}, over the NF4 rounding "
                f"({CROSS_TOL}): they do not quantise to the same format (benchmarks/nf4_matmul.py)"
            )
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_path(fn: Forward, x: torch.Tensor, g: torch.Tensor, warmup: int, iters: int) -> dict[str, Any]:
    """Median ms of one forward + backward, the first call's seconds (a compiled path compiles
    again for each new token count), and on CUDA the peak memory above what was allocated
    before (the weights, x and g)."""
    device = x.device
    x = x.detach().requires_grad_(True)
    _sync(device)
    t0 = time.perf_counter()
    fn(x).backward(g)
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        fn(x).backward(g)
    x.grad = None
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn(x).backward(g)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        x.grad = None
    extra = None
    if device.type == "cuda":
        extra = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return {"ms": statistics.median(times), "first_call_s": first, "extra_peak_gib": extra}


def bench_shape(
    label: str, shape: tuple[int, int], tokens: tuple[int, ...], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    weight = (torch.randn(shape, device=device) * 0.02).to(dtype)  # an initialiser's scale
    paths = build_paths(weight, compiled=device.type == "cuda")
    if args.paths:
        paths = {k: v for k, v in paths.items() if k in args.paths}
    # At the smallest timed count: the kernels checked are those timed (bitsandbytes picks its
    # fused GEMM or the dequantise fallback by the row count), and the compiled graph is reused.
    check_x = torch.randn(min(tokens), shape[1], device=device, dtype=dtype)
    check_g = torch.randn(min(tokens), shape[0], device=device, dtype=dtype)
    first: dict[str, float] = {}
    failed: dict[str, str] = {}
    check = check_paths(paths, check_x, check_g, first, failed)
    paths |= failed
    out: dict[str, Any] = {"shape": f"{label} {shape[0]}x{shape[1]}", "weight": list(shape), "check": check}
    out["first_call_s"] = first  # at the smallest count: the compiled paths' compile time
    out["rows"] = []
    for m in tokens:
        x = torch.randn(m, shape[1], device=device, dtype=dtype)
        g = torch.randn(m, shape[0], device=device, dtype=dtype)
        row: dict[str, Any] = {"tokens": m}
        for name, path in paths.items():
            row[name] = path if isinstance(path, str) else _timed(path[0], x, g, args)
        base = row.get(BASELINE)
        for r in row.values():
            if isinstance(r, dict) and isinstance(base, dict) and "ms" in r and "ms" in base:
                r["ratio_to_bnb"] = r["ms"] / base["ms"]
        out["rows"].append(row)
        del x, g
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _timed(fn: Forward, x: torch.Tensor, g: torch.Tensor, args: argparse.Namespace) -> dict[str, Any] | str:
    try:
        return time_path(fn, x, g, args.warmup, args.iters)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "out of memory"


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("bitsandbytes", "torchao", "triton", "peft"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']}  {result['versions']}"]
    if result["device"] == "cpu":
        lines.append("CPU FIGURES: no CUDA device; they check the paths run, and say nothing about GPU speed")
    for shape in result["shapes"]:
        lines.append(f"\n{shape['shape']}  (check: {_fmt_check(shape['check'])})")
        lines.append("first call s: " + ", ".join(f"{k} {v:.2f}" for k, v in shape["first_call_s"].items()))
        lines.append(f"{'tokens':>7} {'path':22} {'ms':>9} {'x bnb':>7} {'extra GiB':>10} {'1st call s':>10}")
        for row in shape["rows"]:
            for name, r in row.items():
                if name == "tokens":
                    continue
                if isinstance(r, str):
                    lines.append(f"{row['tokens']:>7} {name:22} {r}")
                    continue
                gib = "-" if r["extra_peak_gib"] is None else f"{r['extra_peak_gib']:.2f}"
                ratio = f"{r['ratio_to_bnb']:.3f}" if "ratio_to_bnb" in r else "-"
                lines.append(
                    f"{row['tokens']:>7} {name:22} {r['ms']:9.3f} {ratio:>7} {gib:>10} {r['first_call_s']:10.2f}"
                )
    return "\n".join(lines)


def _fmt_check(check: dict[str, dict[str, float]]) -> str:
    return ", ".join(f"{k} {max(v.values()):.1e}" for k, v in check.items())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tokens", type=int, nargs="+", help=f"rows per matmul (default {TOKENS}; CPU {CPU_TOKENS})")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="a subset of the weight shapes")
    ap.add_argument("--paths", nargs="+", choices=PATHS, help="a subset of the paths (the baseline is always kept)")
    ap.add_argument("--warmup", type=int, default=3, help="calls before timing")
    ap.add_argument("--iters", type=int, default=10, help="timed calls; the median is reported")
    args = ap.parse_args(argv)
    if args.paths:
        args.paths = set(args.paths) | {BASELINE}
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        import torch._dynamo as dynamo

        # Every (shape, token count) is its own static graph of the same compiled function.
        dynamo.config.recompile_limit = 64
        shapes = {k: SHAPES[k] for k in args.shapes} if args.shapes else SHAPES
    else:
        print("no CUDA device: timing a tiny shape on CPU, eager paths only; these figures say nothing about GPU speed")
        shapes = CPU_SHAPES
    tokens = tuple(args.tokens or (TOKENS if cuda else CPU_TOKENS))
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "versions": versions(),
        "setup": {"tokens": list(tokens), "warmup": args.warmup, "iters": args.iters, "dtype": "bfloat16"},
        "shapes": [bench_shape(label, shape, tokens, args, device) for label, shape in shapes.items()],
    }
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
