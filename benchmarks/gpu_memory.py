"""GPU memory: spotune's estimate beside the measured peak, and the longest trainable sequence.

One command on a CUDA machine (no downloads; random weights of the Llama-3.1-8B shape):
    .venv/bin/python benchmarks/gpu_memory.py --json runs/bench-memory.json            # the table
    .venv/bin/python benchmarks/gpu_memory.py --longest --json runs/bench-longest.json  # the search

The table: LoRA and QLoRA (NF4) x {no checkpointing, checkpointing, checkpointing + activation
offloading} x seq 2048 and 4096, one packed row per micro-batch, r16 on every linear layer, bf16
autocast, spotune's own step (trainer.model.build + trainer.model.loss.token_loss_sum + fused AdamW).
Each row: trainer/plan/memory.py's estimate (allocated, and reserved = allocated + the
allocator's headroom) beside torch.cuda.max_memory_allocated and max_memory_reserved, their
ratios (goal 0.90-1.10 on reserved), and tokens/s (the offloading rows' cost is the gap to the
checkpointing rows above them). A row that runs out of memory says so and the table goes on.

`--longest`: 8B QLoRA r32 all linear, checkpointing, activation offloading and tiling of the
norms and the MLP (`model.tiled_mlp`, trainer/model/tiling.py) on, one row: the longest sequence (multiple of
1024) whose optimizer step runs on this GPU, found by bisection between what fits and what does
not, beside the estimate's own longest (with the host memory offloading needs there, and the
estimate without tiling), and the tokens/s the planner's assumed MFU gives at that length.
`--no-tiling` searches without tiling. Published: 342,733 tokens (Unsloth, 8B QLoRA) and
500k (Arctic Long Sequence Training, 8B, one H100) on one 80 GB GPU.

`--probe SEQ`: the same setting, one optimizer step at SEQ tokens only (fits or runs out of
memory; its peak and seconds beside the estimate at SEQ): the search's first probe, in the time
a short GPU window has (131,072 tokens: `bash .gpu-carry/run.sh --slice longest`, docs/gpu.md).

`--tiny` runs the same code on CPU with a tiny Llama (CI keeps it working; CPU has no caching
allocator, so its measured columns are empty and its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu import CONFIGS, free, make_model, packed_rows, to_micro  # noqa: E402
from gpu_hf import sync  # noqa: E402

from trainer.config import AdapterConfig, ModelConfig  # noqa: E402
from trainer.model import flops  # noqa: E402
from trainer.model.load import build  # noqa: E402
from trainer.model.loss import token_loss_sum  # noqa: E402
from trainer.plan import memory  # noqa: E402
from trainer.plan.longest import bisect_longest  # noqa: E402
from trainer.training.batches import to_device  # noqa: E402

GIB = memory.GIB
PUBLISHED_LONGEST = 342_000  # the best published 8B QLoRA figure on one 80 GB GPU (Unsloth: 342,733)
MODES = [(False, False), (True, False), (True, True)]  # (gradient checkpointing, activation offloading)


def estimate(
    path: Path, qlora: bool, r: int, seq: int, ckpt: bool, offload: bool, tiny: bool, tiled: bool = False
) -> memory.MemoryEstimate:
    """What `spotune estimate` says for this step (every position counted as labelled)."""
    shape = _shape(path)
    dtype = "float32" if tiny else "bfloat16"
    targets = AdapterConfig().target_modules
    return memory.estimate_memory(
        shape,
        weight_format="nf4" if qlora else dtype,
        compute_dtype=dtype,
        lora_params=flops.lora_params(shape, r, targets),
        lora_r=r,
        target_modules=targets,
        lora_dropout=False,
        optimizer="adamw",
        micro_batch_size=1,
        seq_len=seq,
        gradient_checkpointing=ckpt,
        activation_offload=offload,
        tiled_mlp=tiled,
    )


def _shape(path: Path) -> flops.ModelShape:
    from transformers import AutoConfig

    return flops.model_shape(AutoConfig.from_pretrained(path))


def assumed_tokens_per_s(path: Path, seq: int, r: int) -> float:
    """Tokens/s of one H100 at the planner's assumed QLoRA MFU (trainer/plan/throughput.py), one
    document filling the row: a guess (+/-30%) to set beside a measurement, not one."""
    from trainer import catalog
    from trainer.plan import throughput
    from trainer.plan.longest import document_tokens_per_s

    shape, h100 = _shape(path), catalog.find_gpu("H100-SXM")
    mfu = throughput.DEFAULT_MFU["qlora"]
    return document_tokens_per_s(shape, flops.lora_params(shape, r), seq, h100.peak_bf16_flops, mfu)


def load(path: Path, qlora: bool, r: int, ckpt: bool, offload: bool, tiny: bool, tiled: bool = False) -> Any:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = ModelConfig(
        name_or_path=str(path),
        dtype="float32" if tiny else "bfloat16",
        gradient_checkpointing=ckpt,
        activation_offload="on" if offload else "off",
        tiled_mlp="on" if tiled else "off",
        tiled_mlp_tokens=16 if tiny else 8192,
    )
    adapter = AdapterConfig(
        method="qlora" if qlora and device.type == "cuda" else "lora", r=r, alpha=2 * r, dropout=0.0
    )
    model = build(model_cfg, adapter, device=device, autocast=device.type == "cuda")
    if adapter.method == "lora":  # a 4-bit model is placed while it loads
        model = model.to(device)
    model.train()
    return model


def document_rows(seq: int, n_rows: int, vocab: int, seed: int = 0) -> list[Any]:
    """Rows of one document each that fills the row, every position labelled: the long legal or code
    document `--longest` is about (packed short documents would leave out most of its attention cost
    and, their prompts masked, part of the head's)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        ids = [rng.randrange(3, vocab) for _ in range(seq)]
        rows.append([(ids, list(ids))])
    return rows


def run_steps(model: Any, seq: int, steps: int, vocab: int, document: bool = False) -> dict[str, Any]:
    """`steps` optimizer steps of one row each (packed from the length sample, or one `document`);
    peak memory and tokens/s of the last ones (of the only one when `steps` is 1)."""
    device = next(p for p in model.parameters() if p.requires_grad).device
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    for p in params:  # AdamW's state exists before the first measured step, as in every later step
        p.grad = torch.zeros_like(p)
    opt.step()  # zero gradients, no weight decay: the weights do not move
    opt.zero_grad(set_to_none=True)
    rows = document_rows(seq, steps, vocab) if document else packed_rows(seq, steps, vocab)
    free()
    times = []
    for row in rows:
        micro = to_device(to_micro([row], seq), device)
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = token_loss_sum(model, micro)
        (loss / max(1, len(micro["label_index"]))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    cuda = device.type == "cuda"
    kept = times[1:] or times
    offload = getattr(model, "spotune_offload", None)
    out = {
        "allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
        "tokens_per_s": seq * len(kept) / sum(kept),
        "offloaded_gib": offload.offloaded_bytes / GIB if offload is not None else 0.0,
    }
    del opt
    return out


def oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (RuntimeError,)


def memory_table(path: Path, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rows = []
    for qlora in (False, True):
        for ckpt, offload in MODES:
            model = load(path, qlora, 16, ckpt, offload, args.tiny)
            for seq in args.seqs:
                e = estimate(path, qlora, 16, seq, ckpt, offload, args.tiny)
                row: dict[str, Any] = {
                    "method": "qlora" if qlora else "lora",
                    "checkpointing": ckpt,
                    "offload": offload,
                    "seq": seq,
                    "estimate": e.as_gib(),
                }
                try:
                    row.update(run_steps(model, seq, args.steps, vocab))
                except oom_types() as exc:
                    row["error"] = f"out of memory: {str(exc).splitlines()[0][:120]}"
                free()
                rows.append(row)
                print(table_line(row), flush=True)
            del model
            free()
    return rows


def longest(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Bisection over sequence lengths (multiples of 1024) for 8B QLoRA r32, checkpointing + offloading,
    one document per row. Each probe is one optimizer step: near 512k tokens about 17 minutes on an
    H100 by the estimate's tokens/s, so the search needs a session of its own (docs/long-context.md)."""
    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory if cuda else args.memory_gib * GIB
    unit = 64 if args.tiny else 1024

    tiled = not args.no_tiling

    def estimated_longest(tiling: bool) -> int:  # the search `spotune estimate --longest` makes
        return bisect_longest(
            lambda seq: estimate(path, True, 32, seq, True, True, args.tiny, tiling).total <= total, unit
        )

    predicted = estimated_longest(tiled)
    at_predicted = estimate(path, True, 32, predicted, True, True, args.tiny, tiled)
    found: dict[str, Any] = {
        "measured_longest": None,
        "estimated_longest": predicted,
        "tiled_mlp": tiled,
        "estimated_longest_without_tiling": estimated_longest(False) if tiled else predicted,
        "estimated_host_gib": at_predicted.offloaded / GIB,
        "estimate_gib": at_predicted.as_gib(),
        "assumed_h100_tokens_per_s": assumed_tokens_per_s(path, predicted, 32),
        "published_target": PUBLISHED_LONGEST,
        "device_memory_gib": total / GIB,
    }
    if args.estimate_only:
        return found
    model = load(path, True, 32, True, True, args.tiny, tiled)
    tried: list[dict[str, Any]] = []

    def fits(seq: int) -> bool:
        try:
            result = run_steps(model, seq, 1, vocab, document=True)
            tried.append({"seq": seq, **result})
            print(f"  seq {seq}: fits, {result}", flush=True)
            return True
        except oom_types() as exc:
            tried.append({"seq": seq, "error": str(exc).splitlines()[0][:120]})
            print(f"  seq {seq}: out of memory", flush=True)
            free()
            return False

    start = min(predicted, args.longest_cap)
    good, bad = (start, None) if fits(start) else (0, start)
    step = max(unit, start // 4)
    while bad is None and good + step <= args.longest_cap:
        if fits(good + step):
            good += step
        else:
            bad = good + step
    while bad is not None and bad - good > unit:
        mid = (good + bad) // 2 // unit * unit
        if mid <= good:
            break
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return {**found, "measured_longest": good, "tried": tried}


def probe(path: Path, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """One 8B QLoRA r32 step at `args.probe` tokens (checkpointing, offloading, tiling as --longest)."""
    tiled = not args.no_tiling
    e = estimate(path, True, 32, args.probe, True, True, args.tiny, tiled)
    found: dict[str, Any] = {"seq": args.probe, "tiled_mlp": tiled, "estimate": e.as_gib()}
    model = load(path, True, 32, True, True, args.tiny, tiled)
    started = time.perf_counter()
    try:
        found.update(run_steps(model, args.probe, 1, vocab, document=True))
    except oom_types() as exc:
        found["error"] = f"out of memory: {str(exc).splitlines()[0][:120]}"
    found["seconds"] = time.perf_counter() - started
    return found


def fmt(v: Any, spec: str) -> str:
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 1)
    return "-".rjust(width) if v is None else format(v, spec)


def table_line(row: dict[str, Any]) -> str:
    e = row["estimate"]
    mode = ("ckpt" if row["checkpointing"] else "no-ckpt") + ("+offload" if row["offload"] else "")
    alloc, res = row.get("allocated_gib"), row.get("reserved_gib")
    ratio_a = e["allocated"] / alloc if alloc else None
    ratio_r = e["reserved"] / res if res else None
    tail = row.get("error") or (
        f"{fmt(alloc, '8.2f')} {fmt(res, '8.2f')} {fmt(ratio_a, '7.2f')} {fmt(ratio_r, '7.2f')} "
        f"{fmt(row.get('tokens_per_s'), '9.0f')} {fmt(row.get('offloaded_gib'), '8.2f')}"
    )
    return f"{row['method']:6} {mode:16} {row['seq']:6d} {e['allocated']:8.2f} {e['reserved']:8.2f} {e['offloaded']:8.2f} {tail}"


HEADER = (
    f"{'method':6} {'mode':16} {'seq':>6} {'est.alloc':>8} {'est.res':>8} {'est.host':>8} "
    f"{'alloc':>8} {'reserved':>8} {'e/alloc':>7} {'e/res':>7} {'tokens/s':>9} {'host GiB':>8}"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny Llama on CPU (CI)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per row (the first is left out of tokens/s)")
    ap.add_argument(
        "--seqs", type=int, nargs="+", default=None, help="sequence lengths (default 2048 4096; tiny 64 128)"
    )
    ap.add_argument("--longest", action="store_true", help="search the longest sequence for 8B QLoRA r32 instead")
    ap.add_argument("--longest-cap", type=int, default=524_288, help="do not try sequences longer than this")
    ap.add_argument("--no-tiling", action="store_true", help="--longest/--probe without tiling (model.tiled_mlp=off)")
    ap.add_argument(
        "--probe", type=int, help="one 8B QLoRA r32 step at this many tokens instead (as --longest's probes)"
    )
    ap.add_argument(
        "--estimate-only", action="store_true", help="--longest: the estimate's figures only (no model, runs on CPU)"
    )
    ap.add_argument(
        "--memory-gib", type=float, default=79.1, help="device memory without CUDA (default: an 80 GB H100's 79.1 GiB)"
    )
    args = ap.parse_args(argv)
    args.seqs = args.seqs or ([64, 128] if args.tiny else [2048, 4096])
    if args.tiny:
        args.longest_cap = min(args.longest_cap, 512)
    if not args.tiny and not torch.cuda.is_available() and not (args.longest and args.estimate_only):
        ap.error("no CUDA device: run on a GPU machine, or pass --tiny for the CPU smoke run")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.estimate_only and not args.tiny:  # the shape is all the estimate reads
            path = Path(tmp) / "model"
            path.mkdir()
            (path / "config.json").write_text((CONFIGS / "llama-3.1-8b.json").read_text())
        else:
            path = make_model(Path(tmp), args.tiny, CONFIGS / "llama-3.1-8b.json")
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        if args.probe:
            result["probe"] = found = probe(path, args, vocab)
            alloc = found.get("allocated_gib")
            print(
                f"{result['device']}: 8B QLoRA r32, one {args.probe}-token row: "
                + (found["error"] if "error" in found else f"fits, {fmt(alloc, '.1f')} GiB allocated")
                + f" in {found['seconds']:.0f} s; estimate {found['estimate']['allocated']:.1f} GiB allocated"
            )
        elif args.longest:
            result["longest"] = found = longest(path, args, vocab)
            print(
                f"{result['device']}: longest 8B QLoRA r32 sequence (checkpointing + offloading"
                f"{' + tiling (norms, MLP)' if found['tiled_mlp'] else ''}, one row, {found['device_memory_gib']:.1f} GiB): "
                f"measured {found['measured_longest']}, "
                f"estimated {found['estimated_longest']} (without tiling {found['estimated_longest_without_tiling']}; "
                f"host memory {found['estimated_host_gib']:.0f} GiB; assumed-MFU H100 tokens/s "
                f"{found['assumed_h100_tokens_per_s']:.0f}), published target {PUBLISHED_LONGEST}"
            )
        else:
            print(f"{result['device']}  torch {torch.__version__}  (GiB; goal: estimate/reserved 0.90-1.10)")
            print(HEADER)
            result["memory_table"] = memory_table(path, args, vocab)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
