"""`make gpu-check`: everything a CUDA machine must show about spotune, in one command, offline.

    .venv/bin/python scripts/gpu_check.py --out runs/gpu-check          # on a GPU machine (< 9 min on one H100)
    .venv/bin/python scripts/gpu_check.py --dry --out runs/gpu-check    # the same parts, CPU-sized (CI)

Parts (each reports pass/fail with its figure; one failing part does not stop the others):
  environment   GPU, driver, torch/CUDA and library versions, the attention `auto` picks and why
  gpu-tests     pytest -m gpu: packed attention per implementation in bf16, the varlen kernel with
                GQA, fused linear cross-entropy against the plain computation, a QLoRA step,
                NVML utilisation, SIGTERM -> save -> resume on CUDA, deterministic bit-identity
  exit-paths    tests/test_exit_paths.py on this machine (a failure in forward/save/report, OOM,
                signals: the process ends, no child left)
  resume-drill  `spotune train` on a ~1B random Llama (meta-llama/Llama-3.2-1B's shipped config)
                with real instruction data -> SIGKILL after a checkpoint -> the same command:
                resumes, finishes, one ledger row per attempt, report.html
  benchmark     benchmarks/gpu.py: the 8B table (spotune against HF + PEFT), estimate beside
                measured peak memory
Writes gpu-check.md and gpu-check.json into --out and prints where. Nothing is downloaded: models
are random-initialised from shipped configs; data and tokenizer come from --data/--tokenizer
(default: the data folder beside the repository when present, `SHARED` below; else spotune's
built-in tiny assets).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
PY = sys.executable


class Part:
    """One part's outcome: status pass / fail / skip, its figure (one line) and the log's tail."""

    def __init__(self, name: str) -> None:
        self.name, self.status, self.figure, self.log, self.seconds = name, "fail", "", "", 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "figure": self.figure,
            "seconds": round(self.seconds, 1),
            "log": self.log[-6000:],
        }


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """(exit code or None on time-out, combined output)."""
    try:
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out + f"\n(timed out after {timeout:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def _pytest_figure(out: str) -> str:
    m = re.findall(r"=+ (.*(?:passed|failed|skipped|error|deselected).*?) in [\d.]+s", out)
    return m[-1] if m else out.strip().splitlines()[-1] if out.strip() else "no output"


# ---------------------------------------------------------------------------- parts


def environment(args: argparse.Namespace, part: Part) -> None:
    code, out = _run([PY, "-c", ENV_PROBE, ENV_MARKER], 120)
    part.log = out
    if code != 0:
        part.figure = "the environment probe failed"
        return
    # Found by its marker: a library may log after it (bitsandbytes 0.50 names a missing optional
    # package on stderr at import), and the output is stdout then stderr.
    found = [line for line in out.splitlines() if line.startswith(ENV_MARKER)]
    if not found:
        part.figure = "the environment probe printed no result"
        return
    env = json.loads(found[-1].removeprefix(ENV_MARKER))
    part.figure = (
        f"{env['gpu']} (driver {env['driver']}), torch {env['torch']} (CUDA {env['cuda']}), transformers "
        f"{env['transformers']}, peft {env['peft']}, accelerate {env['accelerate']}, bitsandbytes "
        f"{env['bitsandbytes']}, liger {env['liger']}; attention auto: {env['attention']}"
    )
    args.environment = env
    part.status = "pass" if env["cuda_available"] or args.dry else "fail"


ENV_MARKER = "gpu-check-environment: "
"""Starts the probe's one result line (the probe is given it as its argument)."""
ENV_PROBE = """
import json, subprocess, sys, warnings
import torch, transformers, peft, accelerate
from importlib.metadata import PackageNotFoundError, version
from trainer.model import attention, load as model
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    choice = model.resolve_attn_implementation("auto", device)
why = "; ".join(str(w.message) for w in caught) or attention.varlen_unavailable_reason() or "its first choice"
driver = "none"
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.strip() or "none"
except OSError:
    pass
print(sys.argv[1] + json.dumps({"gpu": torch.cuda.get_device_name(0) if cuda else "no GPU (CPU)", "driver": driver,
    "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
    "transformers": transformers.__version__, "peft": peft.__version__, "accelerate": accelerate.__version__,
    "bitsandbytes": v("bitsandbytes"), "liger": v("liger-kernel"), "attention": f"{choice} ({why})"}))
"""


def gpu_tests(args: argparse.Namespace, part: Part) -> None:
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    if args.dry:
        cmd.append("--collect-only")  # CPU: every one of them skips; collecting proves they import
    code, out = _run(cmd, args.budget["gpu-tests"])
    part.log, part.figure = out, _pytest_figure(out)
    part.status = "pass" if code == 0 else "fail"


def exit_paths(args: argparse.Namespace, part: Part) -> None:
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_exit_paths.py", "-m", "not slow"]
    if args.dry:
        cmd += ["-k", "forward or end_child"]  # CI runs the whole file in the suite already
    code, out = _run(cmd, args.budget["exit-paths"])
    part.log, part.figure = out, _pytest_figure(out)
    part.status = "pass" if code == 0 else "fail"


def resume_drill(args: argparse.Namespace, part: Part) -> None:
    from resume_drill import drill  # scripts/resume_drill.py: the drill itself

    ok, figure, log = drill(args.work / "drill", data=args.data, tokenizer=args.tokenizer, dry=args.dry)
    part.status, part.figure, part.log = ("pass" if ok else "fail"), figure, log


def benchmark(args: argparse.Namespace, part: Part) -> None:
    bench_json = args.out / "bench-gpu.json"
    cmd = [PY, "benchmarks/gpu.py", "--json", str(bench_json)]
    cmd += ["--tiny", "--steps", "2", "--seq", "128"] if args.dry else ["--steps", "8", "--warmup", "2"]
    code, out = _run(cmd, args.budget["benchmark"])
    part.log = out
    if code == 0 and bench_json.exists():
        r = json.loads(bench_json.read_text())
        hf = r.get("hf_peft") or {}
        ratio = r["spotune"]["tokens_per_s"] / hf["tokens_per_s"] if hf.get("tokens_per_s") else None
        mem = r["memory_estimate_gib"]["lora"]
        part.figure = (
            f"spotune {r['spotune']['tokens_per_s']:.0f} tokens/s ({r['spotune']['attn_implementation']})"
            + (f", {ratio:.2f}x HF+PEFT" if ratio else "")
            + f"; LoRA peak estimate {mem['estimate']:.1f} GiB vs measured "
            + (f"{mem['measured']:.1f} GiB" if mem.get("measured") else "n/a")
        )
        part.status = "pass"
    else:
        part.figure = "benchmarks/gpu.py failed" if code is not None else "benchmarks/gpu.py timed out"


PARTS: dict[str, Callable[[argparse.Namespace, Part], None]] = {
    "environment": environment,
    "gpu-tests": gpu_tests,
    "exit-paths": exit_paths,
    "resume-drill": resume_drill,
    "benchmark": benchmark,
}
BUDGET_S = {"environment": 60, "gpu-tests": 180, "exit-paths": 120, "resume-drill": 150, "benchmark": 300}
"""Seconds each part may take on one H100 (9 minutes together at most, set-up aside)."""


# ---------------------------------------------------------------------------- report


def summary(parts: list[Part], args: argparse.Namespace) -> str:
    env = getattr(args, "environment", {})
    lines = [
        f"# spotune gpu-check ({'dry run on CPU' if args.dry else 'CUDA'}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Machine: {env.get('gpu', '?')}, driver {env.get('driver', '?')}; torch {env.get('torch', '?')} "
        f"(CUDA {env.get('cuda', '?')}). Command: `{' '.join(sys.argv)}`",
        "",
        "| part | result | figure | seconds |",
        "|---|---|---|---|",
    ]
    lines += [f"| {p.name} | {p.status} | {p.figure.replace('|', '/')} | {p.seconds:.0f} |" for p in parts]
    failed = [p.name for p in parts if p.status == "fail"]
    lines += ["", "All parts passed." if not failed else f"Failed: {', '.join(failed)} (logs in gpu-check.json)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu-check.md and gpu-check.json")
    ap.add_argument("--dry", action="store_true", help="CPU-sized parts (CI): proves the command still works")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), help="run these parts only")
    default_data = SHARED / "gpteacher-roleplay.json"
    ap.add_argument("--data", type=Path, default=default_data if default_data.exists() else None)
    default_tok = SHARED / "llama2-tokenizer"
    ap.add_argument("--tokenizer", type=Path, default=default_tok if default_tok.exists() else None)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.out / "work"
    args.budget = dict(BUDGET_S)
    sys.path.insert(0, str(REPO / "scripts"))
    parts = []
    for name, fn in PARTS.items():
        if args.only and name not in args.only:
            continue
        part = Part(name)
        started = time.monotonic()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            fn(args, part)
        except Exception as e:  # a part that breaks is a failed part, not a failed check
            part.status, part.figure = "fail", f"{type(e).__name__}: {e}"
        part.seconds = time.monotonic() - started
        print(f"gpu-check: {name}: {part.status}: {part.figure}", flush=True)
        parts.append(part)
    text = summary(parts, args)
    (args.out / "gpu-check.md").write_text(text)
    (args.out / "gpu-check.json").write_text(
        json.dumps(
            {
                "dry": args.dry,
                "environment": getattr(args, "environment", {}),
                "parts": {p.name: p.as_dict() for p in parts},
            },
            indent=2,
        )  # fmt: skip
    )
    print(text)
    print(f"gpu-check: wrote {args.out / 'gpu-check.md'} and {args.out / 'gpu-check.json'}")
    return 0 if all(p.status != "fail" for p in parts) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
