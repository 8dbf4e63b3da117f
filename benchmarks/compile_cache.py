"""How much of `model.compile` does a resumed attempt pay, with the compiled artifacts the
checkpoint carries (docs/compile.md)?

Three `spotune train` processes, each with Inductor's and Triton's caches in fresh directories
(so the on-disk cache of an earlier process cannot explain a speed-up):

1. the first attempt compiles from scratch and is stopped after step 2 (it saves, as on a
   preemption notice; the checkpoint goes to a `checkpoint.remote` directory);
2. a resume on an empty output_dir (a new machine) from a copy of that store, loading the artifacts;
3. the same resume with `model.compile_cache=false`, compiling from scratch (`--skip-control` skips it).

Prints each attempt's compile seconds (the ledger's `compile` phase) and the ratios side by side:
resumed with the artifacts over the first attempt (goal: a small fraction), and over the control.
The same command runs on a GPU (the recipe takes the GPU when there is one):

    .venv/bin/python benchmarks/compile_cache.py [--model builtin:tiny-llama] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.restart.books.ledger import read_rows  # noqa: E402


def recipe(work: Path, name: str, remote: Path, args: argparse.Namespace, **model: Any) -> Path:
    out = work / name
    body = {
        "output_dir": str(out),
        "model": {"name_or_path": args.model, "dtype": args.dtype, "compile": True} | model,
        "adapter": {"r": 16, "dropout": 0.0},
        "data": {"path": "builtin:tiny-instruct", "seq_len": args.seq_len, "cache_dir": str(work / "data")},
        "train": {"max_steps": 4, "micro_batch_size": 2, "grad_accum": 1},
        "checkpoint": {"every_steps": 2, "every_minutes": None, "remote": str(remote)},
        "metrics": {"progress": False, "log_every": 1},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def attempt(path: Path, work: Path, name: str, stop_after: int | None = None) -> dict[str, Any]:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{name}"),
        "TRITON_CACHE_DIR": str(work / f"triton-{name}"),
    }
    if stop_after is not None:
        env["SPOTUNE_STOP_AFTER_STEP"] = str(stop_after)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", str(path)], cwd=REPO, env=env, capture_output=True, text=True
    )
    if done.returncode not in (0, 143):
        sys.exit(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    row = read_rows(work / name)[-1]
    row["outside_seconds"] = time.monotonic() - started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--skip-control", action="store_true", help="no resume without the artifacts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        store = work / "remote"
        first = attempt(recipe(work, "first", store, args), work, "first", stop_after=2)
        shutil.copytree(store, work / "remote-control")
        hit = attempt(recipe(work, "resumed", store, args), work, "resumed")
        rows = [("first attempt (from scratch)", first), ("resumed, with the artifacts", hit)]
        if not args.skip_control:
            control = recipe(work, "control", work / "remote-control", args, compile_cache=False)
            rows.append(("resumed, model.compile_cache=false", attempt(control, work, "control")))
    print(f"device: {first.get('device')}; model {args.model} ({args.dtype}), seq_len {args.seq_len}")
    for label, row in rows:
        compiled = row["phases"].get("compile", 0.0)
        print(
            f"  {label:<36} compile {compiled:7.1f} s   process {row['outside_seconds']:6.1f} s   "
            f"{row.get('compile_cache')}"
        )
    base = first["phases"]["compile"]
    ratios = [f"resumed / first {hit['phases']['compile'] / base:.2f}"]
    if len(rows) > 2:
        ratios.append(f"resumed / resumed without {hit['phases']['compile'] / rows[2][1]['phases']['compile']:.2f}")
    print("compile seconds: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
