"""Resume cost: start-up time at step 10 against step 10,000, and checkpoint save time and size.

1. Start-up (process start to the first optimizer step, from the ledger) of
   `python -m trainer train` resuming at step 10 and at step 10,000 over the same large
   packed dataset (default 20,000 synthetic alpaca examples -> ~17,000 rows of 128 tokens,
   one row a step, so step 10,000 lies deep inside epoch 0). The step-10,000 checkpoint
   is the step-10 one with its trainer_state saying step 10,000, re-sealed with a new
   manifest. The sampler jumps to a step without reading the rows before it, so the
   goal is a ratio <= 1.1.
2. Checkpoint save time and size for the tiny recipe (recipes/tiny-cpu.yaml model,
   LoRA r=16 on all linear layers, AdamW state after one step).
3. An 8B Llama adapter (Llama-3-8B shapes, r=16 on q,k,v,o,gate,up,down): parameter count
   by formula, checkpoint size by calculation (fp32 adapter + two fp32 AdamW moments),
   and a measured save of exactly those tensors through the same writer (safetensors,
   fsync, sha256 manifest, rename) unless --no-8b-save.

    .venv/bin/python benchmarks/resume.py [--examples 20000] [--repeats 3] [--no-8b-save]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from safetensors.torch import save_file  # noqa: E402

from trainer import builtin_assets  # noqa: E402
from trainer import config as C  # noqa: E402
from trainer.data.sampler import StepSampler  # noqa: E402
from trainer.restart.local.checkpoint import CheckpointManager  # noqa: E402
from trainer.restart.local.rng import gather_rng  # noqa: E402
from trainer.restart.local.state import TrainState, optimizer_to_tensors, write_training_state  # noqa: E402
from trainer.training import inputs  # noqa: E402

FAR = 10_000
NEAR = 10


def _recipe(work: Path, model: Path, data: Path) -> dict[str, Any]:
    return {
        "output_dir": str(work / "seed-run"),
        "seed": 0,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 8, "alpha": 16, "dropout": 0.05},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(work / "cache")},
        "train": {"max_steps": NEAR, "micro_batch_size": 1, "grad_accum": 1, "schedule": "constant"},
        "checkpoint": {"every_steps": NEAR, "every_minutes": None},
        "metrics": {"progress": False, "log_every": 1},
    }


def _train(recipe: Path, *overrides: str, world: int = 1, env: dict[str, str] | None = None) -> None:
    """`spotune train` in a new process; on `world` CPU ranks through torchrun when above 1."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)] if world > 1 else []
    proc = subprocess.run(
        [sys.executable, *launch, "-m", "trainer", "train", str(recipe), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _reseal_at(src: Path, root: Path, step: int, rows: int, seed: int) -> Path:
    """A copy of checkpoint `src` whose trainer_state says `step` (with the matching sampler position)."""
    st = TrainState.from_json((src / "trainer_state.json").read_text())
    st.step = step
    st.epoch, st.cursor = StepSampler(rows, 1, seed).position(step)

    def write(d: Path) -> None:
        for f in src.iterdir():
            if f.name not in ("MANIFEST.json", "trainer_state.json"):
                shutil.copy2(f, d / f.name)
        (d / "trainer_state.json").write_text(st.to_json())

    return CheckpointManager(root, keep_last=2).save(step, write).path


def startup_benchmark(work: Path, examples: int, repeats: int) -> dict[str, Any]:
    tok = builtin_assets.build_tokenizer(work / "tok")
    model = builtin_assets.build_model(work / "model", "llama", tokenizer_dir=tok)
    data = builtin_assets.write_dataset(work / "train.jsonl", n=examples)
    raw = _recipe(work, model, data)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    t0 = time.perf_counter()
    prepared = inputs.prepare_data(C.from_dict(raw), progress=False)
    prep_s = time.perf_counter() - t0
    from datasets import load_from_disk

    rows = len(load_from_disk(str(prepared.train_path)))
    print(f"dataset: {examples} examples -> {rows} packed rows of 128 tokens (prepared once in {prep_s:.1f}s)")
    if rows <= FAR:
        raise SystemExit(f"need more than {FAR} rows for step {FAR} to lie in epoch 0; raise --examples")

    _train(recipe)  # the seed run: 10 steps, checkpoint step-000010
    near_ck = work / "seed-run" / "checkpoints" / f"step-{NEAR:06d}"
    far_ck = _reseal_at(near_ck, work / "far-template", FAR, rows, seed=0)

    startups: dict[int, list[float]] = {NEAR: [], FAR: []}
    for r in range(repeats):
        for step, ck in ((NEAR, near_ck), (FAR, far_ck)):
            out = work / f"r{r}-{step}"
            shutil.copytree(ck, out / "checkpoints" / ck.name)
            _train(recipe, f"output_dir={out}", f"train.max_steps={step + 1}")
            rows_ = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines()]
            startups[step].append(rows_[-1]["startup_seconds"])
            print(f"  repeat {r}: resume at step {step:>6}: start-up {startups[step][-1]:.2f}s")
    near_s, far_s = statistics.median(startups[NEAR]), statistics.median(startups[FAR])
    print(
        f"start-up to first step, median of {repeats}: step {NEAR}: {near_s:.2f}s, step {FAR}: {far_s:.2f}s, "
        f"ratio {far_s / near_s:.3f} (goal <= 1.1)"
    )
    return {"rows": rows, "near_s": near_s, "far_s": far_s, "ratio": far_s / near_s, "all": startups}


def _timed_saves(root: Path, write, n: int) -> tuple[float, int, float]:
    manager = CheckpointManager(root, keep_last=2)
    times, size = [], 0
    for i in range(n):
        res = manager.save(i + 1, write)
        times.append(res.seconds)
        size = res.bytes
    t0 = time.perf_counter()
    assert manager.verify(manager.committed()[-1]) == []
    return statistics.median(times), size, time.perf_counter() - t0


def tiny_recipe_save(work: Path, repeats: int = 5) -> dict[str, Any]:
    from trainer.model.load import build, build_optimizer

    cfg = C.load(REPO / "recipes" / "tiny-cpu.yaml", [f"output_dir={work / 'tiny-run'}"])
    model = build(cfg.model, cfg.adapter, name_or_path=inputs.model_path(cfg), device=torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(cfg.train, params, torch.device("cpu"))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    rng = gather_rng(1)
    seconds, size, verify_s = _timed_saves(
        work / "tiny-ck",
        lambda d: write_training_state(d, model=model, optimizer=opt, state=TrainState(), rng=rng),
        repeats,
    )
    n = sum(p.numel() for p in params)
    print(
        f"tiny recipe ({n:,} trainable params): save {seconds * 1000:.1f} ms, {size / 1e6:.2f} MB, "
        f"verify {verify_s * 1000:.1f} ms"
    )
    return {"params": n, "seconds": seconds, "bytes": size, "verify_s": verify_s}


# Llama-3-8B: hidden 4096, 32 layers, MLP 14336, 32 query heads and 8 KV heads of 128.
LLAMA_8B = {"hidden": 4096, "layers": 32, "intermediate": 14336, "kv_dim": 8 * 128}


def lora_8b_shapes(r: int = 16) -> list[tuple[int, int]]:
    """(in, out) of every adapted linear layer; LoRA adds A [r, in] and B [out, r] to each."""
    h, i, kv = LLAMA_8B["hidden"], LLAMA_8B["intermediate"], LLAMA_8B["kv_dim"]
    per_layer = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    return per_layer * LLAMA_8B["layers"]


def llama_8b(work: Path, measure: bool, r: int = 16) -> dict[str, Any]:
    shapes = lora_8b_shapes(r)
    n = sum(r * (fan_in + fan_out) for fan_in, fan_out in shapes)
    # adapter in fp32 + AdamW exp_avg and exp_avg_sq in fp32 (+ a scalar step per tensor).
    calc = n * 4 + n * 8 + 2 * len(shapes) * 4
    print(
        f"8B Llama, LoRA r={r} on all linear layers: {n:,} adapter params = r * sum(in + out) "
        f"= {r} * {n // r:,}; checkpoint = 12 bytes/param = {calc / 1e6:.0f} MB (adapter {n * 4 / 1e6:.0f} MB, "
        f"AdamW {n * 8 / 1e6:.0f} MB)"
    )
    out: dict[str, Any] = {"params": n, "calc_bytes": calc}
    if not measure:
        return out
    g = torch.Generator().manual_seed(0)
    params = []
    for fan_in, fan_out in shapes:
        params += [
            torch.nn.Parameter(torch.randn(r, fan_in, generator=g) * 0.01),
            torch.nn.Parameter(torch.randn(fan_out, r, generator=g) * 0.01),
        ]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    for p in params:
        p.grad = None

    def write(d: Path) -> None:  # the same files write_training_state writes, without a peft model
        save_file({f"lora.{i}": p.detach() for i, p in enumerate(params)}, d / "adapter_model.safetensors")
        tensors, meta = optimizer_to_tensors(opt)
        save_file(tensors, d / "optimizer.safetensors")
        (d / "optimizer.json").write_text(json.dumps(meta))
        save_file(gather_rng(1), d / "rng.safetensors")
        (d / "trainer_state.json").write_text(TrainState().to_json())

    seconds, size, verify_s = _timed_saves(work / "8b-ck", write, 3)
    print(
        f"8B adapter checkpoint measured here: save {seconds:.2f}s ({size / seconds / 1e6:.0f} MB/s incl. fsync and "
        f"sha256), {size / 1e6:.0f} MB on disk, verify on resume {verify_s:.2f}s; "
        f"share of the default 30 s preemption notice: {seconds / 30:.2f}"
    )
    out.update(seconds=seconds, bytes=size, verify_s=verify_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-8b-save", action="store_true", help="calculate the 8B checkpoint size only")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--work", type=Path, help="keep the work files here (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="spotune-resume-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    if not args.skip_startup:
        results["startup"] = startup_benchmark(work, args.examples, args.repeats)
    results["tiny"] = tiny_recipe_save(work)
    results["llama_8b"] = llama_8b(work, measure=not args.no_8b_save)
    if "seconds" in results["llama_8b"]:
        ratio = results["llama_8b"]["seconds"] / results["tiny"]["seconds"]
        print(
            f"save time ratio 8B / tiny: {ratio:.0f}x for {results['llama_8b']['bytes'] / results['tiny']['bytes']:.0f}x the bytes"
        )
    shutil.rmtree(work / "8b-ck", ignore_errors=True)  # half a gigabyte of random numbers
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
