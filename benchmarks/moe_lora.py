"""Expert LoRA on a mixture of experts: spotune's per-token kernel against peft's ParamWrapper.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/moe_lora.py [--tokens 2048] [--json out.json]

A CPU-sized Qwen3-MoE shape where the routed experts dominate the flops, as in real MoE models: 64 experts of
width 512 per layer, top-8 routing, hidden 512, 2 layers, a 1k vocabulary; LoRA r=16 on every expert projection
and the attention (`all-linear`), fp32. `--experts 128 --hidden 2048 --intermediate 768 --layers 1` is one layer of
Qwen3-30B-A3B's own shape (128 experts of width 768, top-8, hidden 2048), where the adapter's share of the
expert flops is the real model's. `--device cuda --dtype bfloat16` gives the GPU figure (peak memory from
torch.cuda's counter; spotune's path is then grouped_mm where the probe finds it running). One training step
(forward and backward) is timed per path, each path in a process of its own so its peak resident memory is its
own (Linux's peak-RSS counter, reset after the model is built, so the figure is what a step adds):
- spotune: `trainer.model.load.build` (ExpertLora): each routed token's x @ W_e^T + s * (x @ A_e^T) @ B_e^T,
  rows grouped by expert through grouped_mm where the torch in use runs it (on a GPU, the kernel the run's log
  names);
- spotune_loop: the same with the per-expert loop (what a run chooses on CPU, and where grouped_mm does not run);
- peft: the adapter spotune saved, loaded by `PeftModel.from_pretrained` (peft's ParamWrapper, which builds
  W_e + s * B_e @ A_e for every expert on every forward and keeps it for backward).
Before timing, each path's loss is checked against peft's on the same adapter and batch, so the table cannot
compare different maths. The paths' steps run in turn (a step of each, then the next) and tokens/s is of each
path's fastest step: other work on a shared machine slows every path alike, and only adds time.
Ratios divide by peft's tokens/s and peak memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PATHS = ("spotune", "spotune_loop", "peft")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model(path: str, kind: str, adapter_dir: Path, device: str, dtype: str) -> Any:
    from trainer.config import AdapterConfig, ModelConfig
    from trainer.model import experts, load

    if kind == "peft":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        with load.peft_wrapping():
            return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    model = load.build(ModelConfig(name_or_path=path, dtype=dtype), AdapterConfig(dropout=0.0), device=device)
    set_peft_model_state_dict(model, load_file(adapter_dir / "adapter_model.safetensors"))
    model.to(device)
    grouped = experts.probe(torch.device(device).type, getattr(torch, dtype))[0] == experts.GROUPED
    for module in model.modules():
        if type(module) is experts.expert_lora_class():
            module.use_grouped_mm = kind == "spotune" and grouped
    return model


def _step(model: Any, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss.backward()
    return float(loss)


def run_path(
    path: str, kind: str, adapter_dir: Path, tokens: int, steps: int, device: str, dtype: str
) -> dict[str, Any]:
    """One path's figures (run in its own process). Each timed step waits for a line on stdin and answers one on
    stdout, so the parent runs the paths' steps in turn: a machine's other work then slows every path alike."""
    torch.manual_seed(0)
    model = _model(path, kind, adapter_dir, device, dtype)
    model.train()
    ids = torch.randint(4, 500, (tokens // 512, 512), generator=torch.Generator().manual_seed(1)).to(device)
    loss = _step(model, ids)  # warm-up (and the loss the paths must agree on)
    cuda = torch.device(device).type == "cuda"
    if cuda:  # the device's own peak counter: what a step adds to the allocated memory
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() // 1024
    else:
        _reset_peak()
        before = _rss_kib("VmRSS")
    print("ready", flush=True)
    times = []
    for _ in range(steps):
        sys.stdin.readline()
        start = time.perf_counter()
        _step(model, ids)
        times.append(time.perf_counter() - start)
        print("done", flush=True)
    seconds = min(times)  # the best step, as timeit reports: other work on a shared machine only adds time
    return {
        "path": kind,
        "loss": loss,
        "tokens_per_s": ids.numel() / seconds,
        "step_peak_mib": ((torch.cuda.max_memory_allocated() // 1024 if cuda else _rss_kib("VmHWM")) - before) / 1024,
    }


def _expect(proc: subprocess.Popen[str], kind: str, start: str, log: Path) -> str:
    """The next line a path's process prints, which must start with `start` (else its log's end, and stop)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(start):
        proc.kill()
        raise SystemExit(f"{kind}: exit {proc.wait()}\n{line}{log.read_text()[-3000:]}")
    return line


def build(out: Path, shape: dict[str, int]) -> tuple[str, Path]:
    """The benchmark model and an adapter with every factor non-zero (so every term is computed)."""
    from trainer import builtin_assets
    from trainer.config import AdapterConfig, ModelConfig
    from trainer.model import load

    model_dir = builtin_assets.build_model(out / "model", "qwen3_moe", tokenizer_dir=None, **shape)
    model = load.build(ModelConfig(name_or_path=str(model_dir), dtype="float32"), AdapterConfig(dropout=0.0))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    model.save_pretrained(out / "adapter")
    return str(model_dir), out / "adapter"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step (rows of 512)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=512, help="each expert's width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cuda: the GPU figure (peak memory from torch.cuda's counter)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)  # internal: one path in this process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--adapter", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        print(
            json.dumps(run_path(args.model, args.path, args.adapter, args.tokens, args.steps, args.device, args.dtype))
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        shape = dict(
            experts=args.experts,
            top_k=args.top_k,
            hidden=args.hidden,
            intermediate=args.intermediate,
            layers=args.layers,
        )
        model_dir, adapter = build(Path(tmp), shape)
        common = ["--model", model_dir, "--adapter", str(adapter), "--tokens", str(args.tokens)]
        common += ["--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype]
        procs = {}
        logs = {kind: Path(tmp) / f"{kind}.log" for kind in PATHS}
        for kind in PATHS:  # one at a time up to its first step: model building is not what is compared
            procs[kind] = subprocess.Popen(
                [sys.executable, __file__, "--path", kind, *common],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[kind].open("w"),  # a file: a pipe nobody reads could fill and block
                text=True,
            )
            _expect(procs[kind], kind, "ready", logs[kind])
        for _ in range(args.steps):  # the paths' steps in turn
            for kind, proc in procs.items():
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                _expect(proc, kind, "done", logs[kind])
        rows = [json.loads(_expect(proc, kind, "{", logs[kind])) for kind, proc in procs.items()]
        for proc in procs.values():
            proc.wait()
    peft = rows[-1]
    print(f"{'path':<14}{'loss':>12}{'tokens/s':>12}{'step peak MiB':>16}{'speed x':>10}{'memory x':>10}")
    for row in rows:
        if abs(row["loss"] - peft["loss"]) > (1e-4 if args.dtype == "float32" else 2e-2) * abs(peft["loss"]):
            raise SystemExit(f"{row['path']}: loss {row['loss']} differs from peft's {peft['loss']}")
        row["speedup"] = row["tokens_per_s"] / peft["tokens_per_s"]
        row["memory_ratio"] = row["step_peak_mib"] / peft["step_peak_mib"]
        print(
            f"{row['path']:<14}{row['loss']:>12.6f}{row['tokens_per_s']:>12.0f}{row['step_peak_mib']:>16.1f}"
            f"{row['speedup']:>10.2f}{row['memory_ratio']:>10.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
