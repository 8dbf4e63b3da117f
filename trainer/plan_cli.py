"""The `estimate` and `pilot` commands: glue between the command line, the run and trainer/plan/.

trainer/plan/ takes numbers and config sections; this module is where the world is read for
it (the model's config.json, the data or its prepared manifest, pilot.json, the catalogue
file) and where the pilot, which is a real training run, is started.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from trainer import catalog as cat
from trainer import exit_codes, flops, run, tiny
from trainer.config import BUILTIN_TINY_DATA, BUILTIN_TINY_MODEL, RunConfig
from trainer.data.cache import data_cache_root
from trainer.plan import PlanError, pilot
from trainer.plan import workload as wl
from trainer.plan.estimate import Constraints, Job, Measured, estimate
from trainer.plan.pilot import DEFAULT_STEPS
from trainer.plan.table import format_estimate
from trainer.plan.throughput import choose


def estimate_for_run(
    cfg: RunConfig,
    *,
    throughput: float | None = None,
    pilot_json: Path | None = None,
    gpus: int = 1,
    deadline_hours: float | None = None,
    budget: float | None = None,
    catalog_path: Path | None = None,
    gpu: str | None = None,
    mfu: float | None = None,
    manifest: dict[str, Any] | None = None,
    sample_size: int = 2000,
) -> dict[str, Any]:
    """The estimate of the run `cfg` describes (schema `spotune.estimate/1`)."""
    constraints = Constraints(gpus=gpus, gpu=gpu, deadline_hours=deadline_hours, budget=budget)
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    try:
        catalog = cat.load_catalog(catalog_path)
    except cat.CatalogError as e:
        raise PlanError(str(e)) from None
    shape, hf_name = _shape(cfg, tiny.resolve_model(cfg.model.name_or_path))
    job = Job(
        name_or_path=cfg.model.name_or_path,
        shape=shape,
        hf_model_type=hf_name,
        model=cfg.model,
        adapter=cfg.adapter,
        train=cfg.train,
        checkpoint=cfg.checkpoint,
        seq_len=cfg.data.seq_len,
        price_per_hour=cfg.metrics.price_per_hour,
    )
    work = _workload(cfg, manifest, sample_size)
    measured = json.loads(Path(pilot_json).read_text()) if pilot_json else None
    rate = choose(cfg.adapter.method, measured, throughput, cfg.metrics.gpu, mfu)
    return estimate(job, work, rate, catalog, constraints, Measured.from_pilot(measured) if measured else None)


def estimate_command(cfg: RunConfig, args: Any) -> int:
    """`spotune estimate`: print the table (or JSON); exit 0."""
    pilot_json = args.pilot
    if pilot_json is None:
        default = pilot_dir(cfg) / "pilot.json"
        pilot_json = default if default.is_file() else None
    result = estimate_for_run(
        cfg,
        throughput=args.throughput,
        pilot_json=pilot_json,
        gpus=args.gpus,
        deadline_hours=args.deadline_hours,
        budget=args.budget,
        catalog_path=args.catalog,
        gpu=args.gpu,
        mfu=args.mfu,
    )
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))
    return 0


def pilot_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir) / "pilot"


def pilot_config(cfg: RunConfig, steps: int | None = None, minutes: float | None = None) -> RunConfig:
    """The run's config, changed only in what a pilot must change."""
    if steps is not None and minutes is not None:
        raise PlanError("give --steps or --minutes, not both")
    if minutes is not None and minutes <= 0:
        raise PlanError(f"--minutes must be above 0, got {minutes}")
    warm = cfg.metrics.warmup_steps
    n = steps if steps is not None else DEFAULT_STEPS
    if minutes is None and n < warm + 3:
        raise PlanError(
            f"--steps {n} leaves fewer than 3 steps after metrics.warmup_steps={warm}; give at least {warm + 3}"
        )
    budget_hours = None
    if minutes is not None:
        # Stop by time through the budget guard. It counts device-hours from process start,
        # so what this process has used already is added: the pilot gets `minutes` from now
        # (its own startup included). The step cap is just "more than will fit".
        n = 10**9 if cfg.train.max_steps is None else cfg.train.max_steps
        world = int(os.environ.get("WORLD_SIZE", "1"))
        budget_hours = (_seconds_since_process_start() + 60.0 * minutes) * world / 3600.0
    return cfg.replace(
        **{
            "output_dir": str(pilot_dir(cfg)),
            "data.cache_dir": str(data_cache_root(cfg.data.cache_dir, cfg.output_dir)),  # share the run's prepared data
            "train.max_steps": n,
            "train.max_gpu_hours": budget_hours,
            "train.max_cost": None,
            "train.eval_every": None,  # evaluation time is forecast from token counts instead
            "checkpoint.resume": "never",
            "checkpoint.every_steps": None,
            "checkpoint.every_minutes": None,  # one save, at the end: the one we time
            "metrics.log_every": 1,  # one row per step: the step-time distribution
        }
    )


def _seconds_since_process_start() -> float:
    """The ledger's clock starts at process start (psutil); 0 where that cannot be read."""
    try:
        import psutil

        return max(0.0, time.time() - float(psutil.Process().create_time()))
    except Exception:  # psutil missing: the ledger then starts its own clock at open
        return 0.0


def run_pilot(
    cfg: RunConfig, steps: int | None = None, minutes: float | None = None, *, fresh_process: bool = True
) -> dict[str, Any]:
    """Run the pilot, write `<output_dir>/pilot/pilot.json`, return its content.

    `fresh_process`: this process was started for the pilot (the CLI), so its time so far
    (interpreter, imports, config) is startup that `spotune train` pays too. Pass False from
    a long-lived process (tests, notebooks): startup then counts from this call, and the
    imports already done are not measured."""
    earlier = 0.0 if fresh_process else _seconds_since_process_start()
    pcfg = pilot_config(cfg, steps, minutes)
    out = pilot_dir(cfg)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank and out.exists():
        # A pilot is always fresh: old metrics or ledger rows would mix in. Under torchrun the
        # other ranks cannot run ahead of this: train() starts with the process-group rendezvous.
        shutil.rmtree(out)
    prepare_seconds = 0.0
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # Preparing the data is a one-off that the real run will not repeat (it reuses the
        # cache): time it here so it can be taken out of the measured startup. The imports
        # come first, untimed: the real run pays for them too.
        import datasets  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoTokenizer  # noqa: F401

        from trainer import data  # noqa: F401

        started = time.monotonic()
        prepared = run.prepare_data(pcfg, progress=cfg.metrics.progress)
        prepare_seconds = 0.0 if prepared.reused else time.monotonic() - started
    code = run.train(pcfg)
    # With --minutes the pilot ends through the budget guard, which also saves: both are fine.
    if code not in (exit_codes.EXIT_FINISHED, exit_codes.EXIT_BUDGET):
        raise PlanError(f"the pilot run in {out} stopped with exit code {code}; see the messages above")
    if not main_rank:
        return {}  # rank 0 writes the logs, and summarises them
    result = pilot.summarise(out, cfg.metrics.warmup_steps, pilot.device_name(), prepare_seconds, earlier)
    (out / "pilot.json").write_text(json.dumps(result, indent=2))
    return result


def pilot_command(cfg: RunConfig, steps: int | None = None, minutes: float | None = None) -> int:
    """`spotune pilot`: measure, write pilot.json, print the measurement and the forecast."""
    p = run_pilot(cfg, steps=steps, minutes=minutes)
    if not p:
        return 0  # not rank 0
    print(pilot.format_pilot(p))
    print(f"  written to {pilot_dir(cfg) / 'pilot.json'}\n")
    print(format_estimate(estimate_for_run(cfg, pilot_json=pilot_dir(cfg) / "pilot.json", gpus=p["world_size"])))
    return 0


# ---------------------------------------------------------------------------- reading the world


def _shape(cfg: RunConfig, path: str) -> tuple[flops.ModelShape, str]:
    """The model's shape from a local path, a shipped config.json (trainer/plan/models/), or the
    hub's config.json alone (no weights)."""
    from trainer.plan.models import load_config

    hf = load_config(path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    text = hf.get_text_config()  # a vision-language model (Gemma 3 4B+) is planned for its language model
    return flops.model_shape(text), str(getattr(hf, "model_type", ""))


def _workload(cfg: RunConfig, manifest: dict[str, Any] | None, sample_size: int) -> wl.Workload:
    if manifest is not None:
        return wl.from_manifest(manifest)
    data_path = tiny.resolve_data(cfg.data.path)
    found = wl.find_manifest(cfg.data, data_path, data_cache_root(cfg.data.cache_dir, cfg.output_dir))
    if found is not None:
        return wl.from_manifest(*found)
    tok = cfg.data.tokenizer or tiny.resolve_model(cfg.model.name_or_path)
    if cfg.data.tokenizer is None and cfg.data.path == BUILTIN_TINY_DATA and not Path(tok).exists():
        # `spotune estimate <hub id>` plans on the built-in demo data: count it with the demo
        # tokenizer it was made with, so planning needs no tokenizer download either.
        tok = tiny.resolve_model(BUILTIN_TINY_MODEL)
    return wl.from_sample(cfg.data, data_path, tok, sample_size=sample_size, seed=cfg.seed)
