"""spotune's GPU fast path against HF Trainer + PEFT on the Llama-3.1-8B shape.

One command on a CUDA machine (about 10 minutes on one H100, no downloads):
    .venv/bin/python benchmarks/gpu.py --json runs/bench-gpu.json
Where one step's time goes, and the speed levers each on and off:
    .venv/bin/python benchmarks/gpu.py --profile --levers compile,fused,mbs2,liger --json runs/bench-gpu.json

What it runs, in one process, on the same packed rows:
- the Llama-3.1-8B architecture (configs/llama-3.1-8b.json), random bf16 weights saved once for both sides;
- LoRA r16 on every linear layer, bf16 autocast, seq 4096; rows best-fit-decreasing packed
  from a real length distribution (benchmarks/configs/lengths-gpteacher-roleplay.json: token
  lengths of the GPTeacher roleplay instruction set, prompt masked);
- spotune: trainer.model.load.build + trainer.model.loss.token_loss_sum (our head and fused loss,
  document bounds to the attention kernel `auto` picks) + fused AdamW (`--model` another shape);
- HF Trainer + PEFT: the same rows flattened by transformers' DataCollatorWithFlattening
  (padding-free, position_ids), sdpa, the model's own head and loss; and with
  `use_liger_kernel=True` (skipped, with the reason printed, without liger-kernel or CUDA);
- each of those as LoRA and as QLoRA (bitsandbytes NF4, bf16 compute, gradient checkpointing;
  CUDA only): the arms of `ARMS`, run in that order (what decides most first), `--arms` a subset;
- `spotune estimate`'s per-device peak (trainer/plan/memory.py, less CUDA context and allocator
  slack) beside spotune's max_memory_allocated, for LoRA and QLoRA (goal: within 10%).

For each arm: real tokens/s, MFU by trainer/model/flops.py's three counts (`mfu`: the published LoRA count,
4*N + attention, NVIDIA's 40.6%; `mfu_lora`; `mfu_6n`), peak memory, step time, first step (compile).
`--json` is rewritten after the estimate and after every arm, so a run cut short keeps what it measured.
`--profile`: one more spotune step under torch.profiler, its time in buckets (gpu_profile.py).
`--levers a,b`: spotune again with each lever on (`compile`: regional torch.compile, `fused`: LoRA
A matmuls of q/k/v and gate/up fused, `liger`: Liger's RMSNorm, SwiGLU and rotary, `mbsN`: N
rows per micro-batch, the same rows per step). `--tiny`: the same code on CPU, a tiny Llama.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_hf  # noqa: E402
import gpu_profile  # noqa: E402

from trainer import atomic  # noqa: E402
from trainer.config import AdapterConfig, ModelConfig  # noqa: E402
from trainer.data.pack import pack_lengths  # noqa: E402
from trainer.data.template import IGNORE_INDEX  # noqa: E402
from trainer.model import flops  # noqa: E402
from trainer.model.load import build, count_params  # noqa: E402
from trainer.model.loss import token_loss_sum  # noqa: E402
from trainer.plan import memory  # noqa: E402
from trainer.training import metrics  # noqa: E402
from trainer.training.batches import micro_batch, to_device  # noqa: E402

CONFIGS = REPO / "benchmarks" / "configs"
Row = list[tuple[list[int], list[int]]]  # a packed row: its documents as (input_ids, labels)


def make_model(root: Path, tiny: bool, shape: Path) -> Path:
    """Random weights of `shape` (a Llama config.json; or a tiny Llama), saved once for both sides."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(shape)
    if tiny:
        config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
        config.update(dict(num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else torch.bfloat16)
    model.save_pretrained(root / "model")
    del model
    free()
    return root / "model"


def packed_rows(seq_len: int, n_rows: int, vocab: int, seed: int = 0) -> list[Row]:
    """Rows packed from the shipped length sample; random token ids, prompts masked."""
    sample = json.loads((CONFIGS / "lengths-gpteacher-roleplay.json").read_text())
    lengths = [min(n, seq_len) for n in sample["lengths"]]
    bins, _ = pack_lengths(lengths, seq_len)
    rng = random.Random(seed)
    rows = []
    for b in bins[:n_rows]:
        docs = []
        for i in b:
            ids = [rng.randrange(3, vocab) for _ in range(lengths[i])]
            prompt = min(sample["prompt_lengths"][i], lengths[i] - 1)
            docs.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
        rows.append(docs)
    return rows


def to_micro(rows: list[Row], seq_len: int, row_pairs: list[int] | None = None) -> dict[str, Any]:
    """spotune's micro-batch of these rows (trailing padding as in `spotune prepare`); `row_pairs`: preference
    rows holding that many pairs each (trainer/training/batches.py)."""
    ids, labels, pos = (torch.zeros(len(rows), seq_len, dtype=torch.int64) for _ in range(3))
    labels.fill_(IGNORE_INDEX)
    for r, docs in enumerate(rows):
        at = 0
        for d_ids, d_labels in docs:
            n = len(d_ids)
            ids[r, at : at + n], labels[r, at : at + n] = torch.tensor(d_ids), torch.tensor(d_labels)
            labels[r, at] = IGNORE_INDEX  # a document's first token is never predicted
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(seq_len - at)
    return micro_batch(ids, labels, pos, row_pairs)


def row_counts(rows: list[Row]) -> tuple[int, int, int]:
    """(real tokens, sum of squared document lengths, labelled tokens) of some rows."""
    docs = [d for row in rows for d in row]
    labelled = sum(sum(1 for y in lab[1:] if y != IGNORE_INDEX) for _, lab in docs)
    return sum(len(i) for i, _ in docs), sum(len(i) ** 2 for i, _ in docs), labelled


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_spotune(path: Path, steps: list[list[Row]], args: argparse.Namespace, qlora: bool = False) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = ModelConfig(
        name_or_path=str(path),
        dtype="float32" if args.tiny else "bfloat16",
        gradient_checkpointing=qlora or args.gradient_checkpointing,
        compile=args.compile,
    )
    adapter = AdapterConfig(method="qlora" if qlora else "lora", r=16, alpha=32, dropout=0.0, fused=args.fused)
    autocast = device.type == "cuda"
    model = build(model_cfg, adapter, device=device, autocast=autocast)
    if getattr(args, "liger", False):  # the `liger` lever: a benchmark-only trial so far
        gpu_hf.apply_liger(model.get_base_model())
    if not qlora:  # a 4-bit model is placed while it loads and cannot be moved
        model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    model.train()

    def step(micros: list[dict[str, Any]], model: Any = model, opt: Any = opt) -> None:
        n = sum(len(m["label_index"]) for m in micros)
        for micro in micros:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = token_loss_sum(model, micro)
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpu_hf.sync()

    times = []
    for rows in steps:
        micros = [to_device(to_micro(rows[i : i + args.mbs], args.seq), device) for i in range(0, len(rows), args.mbs)]
        gpu_hf.sync()
        start = time.perf_counter()
        step(micros)
        times.append(time.perf_counter() - start)
    result = {"attn_implementation": model.get_base_model().config._attn_implementation, "step_seconds": times}
    result["trainable_params"] = count_params(model).trainable
    if getattr(args, "profile", False) and not qlora:
        vocab = model.get_base_model().config.vocab_size
        result["profile"] = gpu_profile.profile_step(
            lambda: step(micros), gpu_profile.lora_widths(16, args.fused), vocab, args.trace
        )
    del model, opt
    return result


def summarise(raw: dict[str, Any], steps: list[list[Row]], args: argparse.Namespace, peak: float | None) -> dict:
    from transformers import LlamaConfig

    shape = flops.model_shape(LlamaConfig.from_pretrained(args.work / "model"))
    kept = list(zip(raw["step_seconds"], steps, strict=False))[args.warmup :]
    seconds = sum(t for t, _ in kept)
    real, doc_sq, labelled = (sum(c) for c in zip(*(row_counts(rows) for _, rows in kept), strict=True))
    counts = flops.mfu_flops(shape, real, doc_sq, flops.lora_params(shape, 16), head_tokens=labelled)
    mem = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    out = {
        "attn_implementation": raw["attn_implementation"],
        "tokens_per_s": real / seconds,
        "step_seconds": seconds / len(kept),
        **{name: n / seconds / peak if peak else None for name, n in counts.items()},
        "peak_memory_gib": mem,
        "first_step_seconds": raw["step_seconds"][0],  # includes compile time under --compile
    }
    return out | ({"profile": raw["profile"]} if "profile" in raw else {})


def measure(fn: Any, path: Path, steps: list[list[Row]], args: argparse.Namespace, peak: float | None) -> dict:
    free()
    out = summarise(fn(path, steps, args), steps, args, peak)
    free()
    return out


QLORA_ON_CPU = "QLoRA arms are timed on CUDA only (the CPU 4-bit path is tested, not benchmarked)"


@dataclass(frozen=True)
class Arm:
    """One row of the table: who trains the rows (a `RUNNERS` name), LoRA or QLoRA, with Liger or not.
    A new comparison (another trainer, another objective) is a runner and an entry of `ARMS`."""

    runner: str
    qlora: bool = False
    liger: bool = False  # HF Trainer's use_liger_kernel=True

    def skip_reason(self, args: argparse.Namespace) -> str | None:
        if self.runner == "hf" and args.skip_hf:
            return "--skip-hf"
        if self.qlora and args.skip_qlora:
            return "--skip-qlora"
        if self.qlora and not torch.cuda.is_available():
            # bitsandbytes' CPU 4-bit path runs (tests/test_train.py trains QLoRA on CPU), but its
            # speed is not what a GPU user pays for: this table's QLoRA rows are CUDA figures.
            return QLORA_ON_CPU
        return gpu_hf.liger_skip_reason() if self.liger else None

    def run(self, path: Path, steps: list[list[Row]], args: argparse.Namespace) -> dict[str, Any]:
        options = {"qlora": self.qlora} | ({"liger": True} if self.liger else {})
        return RUNNERS[self.runner](path, steps, args, **options)


RUNNERS: dict[str, Any] = {"spotune": run_spotune, "hf": gpu_hf.run_hf}
ARMS: dict[str, Arm] = {
    "spotune": Arm("spotune"),
    "hf_peft": Arm("hf"),
    "spotune_qlora": Arm("spotune", qlora=True),
    "hf_peft_qlora": Arm("hf", qlora=True),
    # Liger's patches reach module-level functions of transformers' Llama (rotary), so every arm
    # that must run without them comes first, and the levers (`--levers`) run before these two.
    "hf_peft_liger": Arm("hf", liger=True),
    "hf_peft_liger_qlora": Arm("hf", qlora=True, liger=True),
}
"""The table's arms in the order they run: what decides most first, Liger's last (see above)."""
LABELS = {"spotune": "spotune", "hf_peft": "HF+PEFT", "hf_peft_liger": "HF+PEFT+Liger"}


def chosen_arms(text: str | None) -> list[str]:
    """`--arms a,b` in ARMS's order (the order Liger needs), every arm without it."""
    if not text:
        return list(ARMS)
    wanted = [a for a in text.split(",") if a]
    if unknown := [a for a in wanted if a not in ARMS]:
        raise SystemExit(f"--arms: unknown arm {', '.join(unknown)}; known: {', '.join(ARMS)}")
    return [a for a in ARMS if a in wanted]


def levers(path: Path, steps: list[list[Row]], args: argparse.Namespace, peak: float | None) -> dict:
    """spotune with each lever of `--levers` on, alone (the main spotune run is the 'off' side)."""
    out = {}
    for lever in sorted(filter(None, args.levers.split(",")), key=lambda name: name == "liger"):
        on = argparse.Namespace(**{**vars(args), "profile": False})
        if lever in ("compile", "fused", "liger"):
            setattr(on, lever, True)
            if lever == "liger" and gpu_hf.liger_skip_reason():
                out[lever] = {"skipped": gpu_hf.liger_skip_reason()}
                continue
        elif lever.startswith("mbs") and lever[3:].isdigit():
            on.mbs = int(lever[3:])  # the same rows per step, in fewer micro-batches
        else:
            raise SystemExit(f"--levers: unknown lever {lever!r}; known: compile, fused, liger, mbsN")
        out[lever] = measure(run_spotune, path, steps, on, peak)
    return out


def estimated_peak_gib(path: Path, args: argparse.Namespace, qlora: bool) -> float:
    """What `spotune estimate` says one device needs for this benchmark's LoRA/QLoRA step,
    less the CUDA context and allocator slack (not in torch.cuda.max_memory_allocated)."""
    from transformers import AutoConfig

    shape = flops.model_shape(AutoConfig.from_pretrained(path))
    targets = AdapterConfig().target_modules
    dtype = "float32" if args.tiny else "bfloat16"
    est = memory.estimate_memory(
        shape,
        weight_format="nf4" if qlora else dtype,
        compute_dtype=dtype,
        lora_params=flops.lora_params(shape, 16, targets),
        lora_r=16,
        target_modules=targets,
        lora_dropout=False,
        optimizer="adamw",
        micro_batch_size=args.mbs,
        seq_len=args.seq,
        gradient_checkpointing=qlora or args.gradient_checkpointing,
        device_overhead=0,
        fragmentation=0,
    )
    return est.total / memory.GIB


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny Llama on CPU, a few steps (CI)")
    ap.add_argument("--model", type=Path, default=CONFIGS / "llama-3.1-8b.json", help="a Llama config.json")
    ap.add_argument("--json", type=Path, help="write the results here (rewritten after every arm)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default 12, tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the figures (default 3, tiny 1)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per packed row (default 4096, tiny 256)")
    ap.add_argument("--mbs", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="for the LoRA runs too (QLoRA always)")
    ap.add_argument("--compile", action="store_true", help="spotune: torch.compile each decoder layer")
    ap.add_argument("--profile", action="store_true", help="profile one more spotune step (torch.profiler)")
    ap.add_argument("--trace", help="with --profile: write its Chrome trace here")
    ap.add_argument("--fused", action="store_true", help="spotune: adapter.fused (q/k/v, gate/up A as one matmul)")
    ap.add_argument("--levers", default="", help="spotune again with each lever on: compile, fused, mbs2, ...")
    ap.add_argument("--arms", help=f"these arms only, comma-separated (default all: {','.join(ARMS)})")
    ap.add_argument("--skip-hf", action="store_true", help="no HF Trainer arm")
    ap.add_argument("--skip-qlora", action="store_true", help="no QLoRA arm")
    ap.add_argument(
        "--work", type=Path, help="folder for the random weights (default: a temporary folder; /dev/shm loads fastest)"
    )
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.seq = args.seq or (256 if args.tiny else 4096)
    arms = chosen_arms(args.arms)
    if not args.tiny and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU machine, or pass --tiny for the CPU smoke run")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = metrics.resolve_peak_flops(None, None, device)
    rows_per_step = args.mbs * args.grad_accum
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        args.work = Path(tmp)
        path = make_model(args.work, args.tiny, args.model)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rows = packed_rows(args.seq, args.steps * rows_per_step, vocab)
        steps = [rows[i : i + rows_per_step] for i in range(0, len(rows), rows_per_step)]
        result: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "versions": _versions(),
            "setup": {k: getattr(args, k) for k in ("tiny", "steps", "warmup", "seq", "mbs", "grad_accum")}
            | {"model": args.model.name},
            "memory_estimate_gib": {
                method: {"estimate": estimated_peak_gib(path, args, method == "qlora"), "measured": None}
                for method in ("lora", "qlora")
            },
            "arms": {},
            "pending": list(arms),  # arms not measured yet: what a run cut short lacks
            "levers": {},
        }
        write(args.json, result)
        for name in arms:
            if ARMS[name].liger and args.levers and not result["levers"]:
                result["levers"] = levers(path, steps, args, peak)  # before Liger, which patches rotary module-wide
            result["arms"][name] = run_arm(name, path, steps, args, peak)
            result["pending"].remove(name)
            measured = result["arms"][name].get("peak_memory_gib")
            if name in ("spotune", "spotune_qlora"):
                result["memory_estimate_gib"]["qlora" if ARMS[name].qlora else "lora"]["measured"] = measured
            write(args.json, result)
        if args.levers and not result["levers"]:
            result["levers"] = levers(path, steps, args, peak)
            write(args.json, result)
    print(table(result))
    return result


def run_arm(name: str, path: Path, steps: list[list[Row]], args: argparse.Namespace, peak: float | None) -> dict:
    """One arm's figures, or why it was skipped (printed)."""
    reason = ARMS[name].skip_reason(args)
    if reason:
        print(f"{name} skipped: {reason}", flush=True)
        return {"skipped": reason}
    started = time.monotonic()
    figures = measure(ARMS[name].run, path, steps, args, peak)
    print(f"{name}: {figures['tokens_per_s']:.0f} tokens/s ({time.monotonic() - started:.0f} s)", flush=True)
    return figures


def write(path: Path | None, result: dict[str, Any]) -> None:
    """The JSON as it stands (atomically: a reader never sees half of it), with the ratios so far."""
    result["ratios"] = ratios(result["arms"])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(result, indent=2))


def _versions() -> dict[str, str]:
    import accelerate
    import peft
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}
    out["accelerate"] = accelerate.__version__
    for name in ("liger-kernel", "bitsandbytes", "triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        try:
            import pynvml  # nvidia-ml-py, the `gpu` extra

            pynvml.nvmlInit()
            out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception as e:  # noqa: BLE001 (the driver is reported, never required)
            out["driver"] = f"unknown ({type(e).__name__})"
    return out


def table(result: dict[str, Any]) -> str:
    def fmt(v: Any, spec: str) -> str:
        width = "".join(c for c in spec.split(".")[0] if c.isdigit())
        return (
            ("-".rjust(int(width or 1))) if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
        )

    lines = [
        f"{result['device']}  {result['versions']}  {result['setup']}",
        f"{'':20} {'attention':>16} {'tokens/s':>10} {'step s':>8} {'MFU':>6} {'MFU lora':>9} {'MFU 6N':>7} "
        f"{'peak GiB':>9} {'1st step s':>10}",
    ]
    arms = result["arms"]
    sides = dict(arms) | {f"spotune+{k}": v for k, v in result["levers"].items()}
    for name, r in sides.items():
        if "skipped" in r:
            lines.append(f"{name:20} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{name:20} {r['attn_implementation']:>16} {fmt(r['tokens_per_s'], '10.0f')} {fmt(r['step_seconds'], '8.3f')} "
            f"{fmt(r['mfu'], '6.1%')} {fmt(r['mfu_lora'], '9.1%')} {fmt(r['mfu_6n'], '7.1%')} "
            f"{fmt(r['peak_memory_gib'], '9.1f')} {fmt(r['first_step_seconds'], '10.2f')}"
        )
    if result["pending"]:
        lines.append(f"not measured (cut short): {', '.join(result['pending'])}")
    for name, m in result["memory_estimate_gib"].items():
        ratio = m["estimate"] / m["measured"] if m["measured"] else None
        lines.append(
            f"{name} peak memory GiB: estimate {m['estimate']:.1f}, measured {fmt(m['measured'], '.1f')} "
            f"(estimate/measured {fmt(ratio, '.2f')}; goal 0.90-1.10)"
        )
    lines += ratios(arms)
    if "profile" in arms.get("spotune", {}):
        lines.append(gpu_profile.summary(arms["spotune"]["profile"]))
    return "\n".join(lines)


def ratios(arms: dict[str, dict[str, Any]]) -> list[str]:
    """spotune's tokens/s and peak memory over each HF arm of the same method (LoRA with LoRA, QLoRA with QLoRA)."""
    lines = []
    for method in ("", "_qlora"):
        ours = arms.get("spotune" + method, {})
        for other in ("hf_peft", "hf_peft_liger"):
            theirs = arms.get(other + method, {})
            if "tokens_per_s" not in ours or "tokens_per_s" not in theirs:
                continue
            line = f"{'QLoRA' if method else 'LoRA'} spotune / {LABELS[other]}: tokens/s {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}"
            if ours["peak_memory_gib"] and theirs["peak_memory_gib"]:
                line += f", peak memory {ours['peak_memory_gib'] / theirs['peak_memory_gib']:.2f}"
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
