"""Wiring for `spotune train`: the only module that sees the whole RunConfig.

`train(cfg)` builds the accelerator, data, model, optimizer, sampler, checkpoint manager,
ledger and meter, resumes from the newest checkpoint that verifies, hands everything to
`loop.train_loop`, writes `final/` and returns the process exit code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import builtin_assets, exit_codes
from trainer import config as C
from trainer.data.cache import data_cache_root, in_turns
from trainer.exit_codes import StopReason
from trainer.export import write_final
from trainer.model import distributed, flops
from trainer.model.load import build, count_params
from trainer.restart import notice, preemption
from trainer.restart.checkpoint import CheckpointManager
from trainer.restart.ledger import Ledger, timed
from trainer.restart.remote import RemoteRun
from trainer.restart.rng import gather_rng
from trainer.restart.state import (
    Counters,
    TrainState,
    check_compatible,
    restore_training_state,
    snapshot,
    write_training_state,
)
from trainer.training import loop, metrics
from trainer.training.batches import StepDataset, step_loader
from trainer.training.sampler import StepSampler, run_steps
from trainer.training.telemetry import Budget, Telemetry


def model_path(cfg: C.RunConfig) -> str:
    return builtin_assets.resolve_model(cfg.model.name_or_path)


def tokenizer_path(cfg: C.RunConfig) -> str:
    return cfg.data.tokenizer or model_path(cfg)


def prepare_data(cfg: C.RunConfig, progress: bool = True) -> Any:
    """Prepare (or reuse) the packed dataset of `cfg` and print its summary."""
    from trainer import data

    data_cfg = dataclasses.replace(cfg.data, path=builtin_assets.resolve_data(cfg.data.path))
    cache_root = data_cache_root(cfg.data.cache_dir, cfg.output_dir)
    prepared = data.prepare(data_cfg, tokenizer_path(cfg), cache_root, progress=progress, seed=cfg.seed)
    if progress:
        print(prepared.summary(), flush=True)
    return prepared


def make_accelerator(cfg: C.RunConfig) -> Any:
    """Accelerate owns device placement, autocast (+ fp16 grad scaler) and DDP wrapping; FSDP
    sharding is ours (trainer/distributed.py says why).

    Gradient accumulation stays ours (loop.py counts tokens over the whole step), so the
    accelerator runs with gradient_accumulation_steps=1. Under `torchrun` on a CPU-only
    machine, `cpu=True` still gives one gloo rank per process.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    if cfg.train.mixed_precision == "fp16" and not cuda:
        raise C.ConfigError(["train.mixed_precision: fp16 needs a CUDA GPU; use bf16 or no on CPU"])
    trackers = list(cfg.metrics.trackers)
    missing = [t for t in trackers if importlib.util.find_spec(t) is None]
    if missing:  # accelerate would only log a warning and drop the tracker
        raise C.ConfigError(
            [
                f"metrics.trackers: {', '.join(missing)} is not installed; pip install {' '.join(missing)} "
                "(or pip install 'spotune[trackers]'), or remove it from metrics.trackers"
            ]
        )
    backend = distributed.process_group_backend(cfg.train.distributed, cfg.train.fsdp_cpu_offload, cuda)
    return Accelerator(
        cpu=not cuda,
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers or None,
        project_dir=cfg.output_dir,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend)] if backend else None,
    )


def build_optimizer(
    train: C.TrainConfig, params: list[torch.nn.Parameter], device: torch.device
) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only; bitsandbytes 8-bit (paged) variants on request."""
    kwargs: dict[str, Any] = dict(
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    if train.optimizer == "adamw":
        return torch.optim.AdamW(params, fused=device.type == "cuda", **kwargs)
    import bitsandbytes as bnb

    cls = bnb.optim.AdamW8bit if train.optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, **kwargs)


def train(cfg: C.RunConfig) -> int:
    """Train (resuming when a checkpoint verifies) and return the process exit code."""
    entered = time.time()
    phases: dict[str, float] = {}  # fixed costs for the ledger, timed before it can open
    with timed(phases, "imports"):  # the rest of the libraries train() needs (the ledger adds the time before)
        from datasets import load_from_disk

    out = Path(cfg.output_dir)
    accelerator = make_accelerator(cfg)
    rank, world, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    t = cfg.train
    # DDP, or FSDP from the recipe or an accelerate FSDP config; refuses DeepSpeed and the like.
    sharding = distributed.choose(t.distributed, t.fsdp_cpu_offload, accelerator)
    ck = cfg.checkpoint
    remote = RemoteRun(
        ck.remote,
        ck.storage_options,
        out,
        keep_last=ck.keep_last,
        is_main=is_main,
        is_local_main=accelerator.is_local_main_process,
    )
    with timed(phases, "store"):
        remote.connect()  # first: a fresh machine fetches the run's config, ledger and metrics before writing any
    stop = preemption.Preemption().install()
    ck = cfg.checkpoint  # a cloud notice sets the same flag as SIGTERM; one poller per machine
    watcher = notice.NoticeWatcher(ck.preemption_notice, stop.request, ck.notice_endpoint, ck.notice_poll_seconds)
    if accelerator.is_local_main_process:
        watcher.start()
    show = is_main and cfg.metrics.progress

    with timed(phases, "data"):
        prepared = in_turns(  # rank 0, then one rank per other node, then the rest reuse their node's cache
            lambda: prepare_data(cfg, progress=show),
            is_main=is_main,
            is_local_main=accelerator.is_local_main_process,
            barrier=accelerator.wait_for_everyone,
        )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "config.yaml").exists():
            (out / "config.yaml").write_text(C.to_yaml(cfg))

    from accelerate.utils import set_seed

    # Resolved before the model loads, so a bad metrics.gpu fails in a second, not a minute.
    peak_flops = metrics.resolve_peak_flops(cfg.metrics.peak_flops, cfg.metrics.gpu, accelerator.device)
    set_seed(cfg.seed)  # same LoRA init on every rank (DDP also broadcasts rank 0's weights)
    with timed(phases, "model"):
        model = build(
            dataclasses.replace(cfg.model, gradient_checkpointing=True)
            if sharding.activation_checkpointing
            else cfg.model,
            cfg.adapter,
            name_or_path=model_path(cfg),
            device=accelerator.device,
            autocast=cfg.train.mixed_precision != "no",
            sharded=sharding.fsdp,
        )
    counts = count_params(model)
    rows = load_from_disk(str(prepared.train_path))
    with timed(phases, "resolve"):
        resume_dir, notes = remote.resolve(cfg.checkpoint.resume)  # local or remote, chosen on rank 0
    notes = [*sharding.notes, *notes]
    saved = TrainState.from_json((resume_dir / "trainer_state.json").read_text()) if resume_dir is not None else None
    # The run is defined by its global batch: a resume on another device count keeps it and only
    # the per-device split changes (trainer/sampler.py: the same rows every step).
    split = C.batch_split(t, world, saved.structural.get("global_batch_rows") if saved is not None else None)
    structural = C.structural_fields(cfg, world, split.global_rows)
    if saved is not None:
        notes += check_compatible(saved, structural, prepared.fingerprint, cfg.checkpoint.allow_config_change)
        if saved.world_size != world:
            notes.append(split.resume_note(saved.world_size, cfg.adapter.dropout))
    sampler = StepSampler(len(rows), split.global_rows, seed=cfg.seed, shuffle=cfg.data.shuffle)
    steps = run_steps(len(rows), split.global_rows, t.max_steps, t.epochs)
    optimizer_device = torch.device("cpu") if sharding.cpu_offload else accelerator.device  # where it steps
    model, optimizer = distributed.prepare(
        accelerator, model, lambda params: build_optimizer(t, params, optimizer_device), sharding
    )
    set_seed(cfg.seed + rank)  # distinct dropout streams per rank from here on

    state = TrainState(
        structural=structural,
        data_fingerprint=prepared.fingerprint,
        config=cfg.to_dict(),
        world_size=world,
        seed=cfg.seed,
    )
    ledger = Ledger.open(
        out,
        world,
        price_per_hour=cfg.metrics.price_per_hour,
        carried_totals=saved.ledger if saved is not None else None,
        enabled=is_main,
        phases=phases,
    )
    ledger.data_reused = bool(prepared.reused)
    ledger.phases["imports"] += entered - ledger.start  # interpreter, CLI and config before train()
    manager = CheckpointManager(out / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    console = metrics.Console(steps, 0, enabled=cfg.metrics.progress, is_main=is_main)
    for note in notes:
        console.message(f"spotune: {note}")
    remote.message = console.message
    remote.start_uploads()

    meter = metrics.Meter(
        world_size=world,
        warmup_steps=cfg.metrics.warmup_steps,
        flops_fn=_flops_fn(accelerator.unwrap_model(model).config, counts.trainable),
        peak_flops=peak_flops,
        price_per_hour=cfg.metrics.price_per_hour,
        total_steps=steps,
        device_seconds_fn=lambda: float(ledger.totals()["device_seconds"]),  # one source of truth: the ledger
    )
    if cfg.metrics.trackers:
        accelerator.init_trackers("spotune", config=metrics.flat_config(cfg.to_dict()))
    telemetry = Telemetry(
        meter,
        console,
        ledger,
        metrics.JsonlSink(out / "metrics.jsonl") if is_main else None,
        log_every=cfg.metrics.log_every,
        total_steps=steps,
        budget=Budget(max_gpu_hours=t.max_gpu_hours, max_cost=t.max_cost),
        epoch_of=lambda step: round(step / sampler.steps_per_epoch, 4),
        digest_of=sampler.digest,
        tracker_log=(lambda row, step: accelerator.log(row, step=step)) if cfg.metrics.trackers else None,
        row_extras=remote.metrics,
    )

    def save(counters: Counters) -> float:
        started = time.monotonic()
        rng = gather_rng(world)  # collective: every rank's generators
        tensors = snapshot(model, optimizer, keep=is_main)  # collective under FSDP: whole adapter + optimizer
        state_now = dataclasses.replace(state, **vars(counters.counters()), ledger=ledger.totals(), scaler=None)
        state_now.epoch, state_now.cursor = sampler.position(counters.step)
        if is_main:
            result = manager.save(
                counters.step,
                lambda tmp: write_training_state(
                    tmp,
                    model=model,
                    optimizer=optimizer,
                    state=state_now,
                    rng=rng,
                    scaler=accelerator.scaler,
                    tensors=tensors,
                ),
            )
            if not result.skipped:
                remote.submit(counters.step, result.path)  # returns at once; uploads in the background
            warning = preemption.save_fits_notice(result.seconds, cfg.checkpoint.notice_seconds)
            if warning:
                console.message(f"spotune: {warning}")
        accelerator.wait_for_everyone()  # nobody runs ahead of a checkpoint that is not committed yet
        seconds = time.monotonic() - started
        telemetry.saved(counters.step, seconds)
        return seconds

    counters = Counters()
    if resume_dir is not None:  # last before the first step: it restores the RNG
        with ledger.timed("restore"):
            counters = _restore(resume_dir, model, optimizer, accelerator)
        console.message(f"spotune: resuming from {resume_dir} at step {counters.step} of {steps}")
    meter.start_step = counters.step
    console.update(counters.step)

    plan = loop.LoopPlan(
        total_steps=steps,
        lr=loop.LrSchedule(
            peak=t.lr, total_steps=steps, warmup_steps=t.warmup_steps, kind=t.schedule, min_lr_ratio=t.min_lr_ratio
        ),
        max_grad_norm=t.max_grad_norm,
        max_bad_steps=t.max_bad_steps,
        eval_every=t.eval_every if prepared.eval_path is not None else None,
        save_every_steps=cfg.checkpoint.every_steps,
        save_every_minutes=cfg.checkpoint.every_minutes,
    )
    hooks = loop.Hooks(
        save=save,
        on_step=telemetry.on_step,
        message=console.message,
        stop_requested=lambda: stop.due(counters.step),
        over_budget=telemetry.over_budget,
        evaluate=_evaluator(cfg, prepared, model, accelerator, telemetry, counters) if plan.eval_every else None,
    )
    reason: StopReason = "finished"
    try:
        if counters.step < steps:
            dataset = StepDataset(rows, sampler, rank, world, t.micro_batch_size, steps)
            batches = step_loader(dataset, counters.step, accelerator.device, cfg.seed)
            ledger.mark_first_step()
            reason = loop.train_loop(accelerator, model, optimizer, batches, plan, counters, hooks)
        ledger.winding_down(reason)
        if reason in ("finished", "budget"):
            with ledger.timed("final"):
                write_final(out / "final", model, tokenizer_path(cfg), is_main)  # collective under FSDP
        accelerator.wait_for_everyone()
        summary = meter.summary()
        with ledger.timed("flush"):
            remote.finish(preempted=reason == "preempted", notice_seconds=cfg.checkpoint.notice_seconds)
        if is_main:  # after the flush: a preempted machine spends its notice on the upload first
            # Before the ledger row, so the ledger counts what the user pays for: the page shows
            # this attempt from the heartbeat, ended and up to date but for the page's own time.
            ledger.reporting()
            from trainer.report import report_after_train

            report_after_train(out, console.message)
        if cfg.metrics.trackers:
            accelerator.end_training()
        # Closed while the signal handlers are still installed: a late SIGTERM (torchrun
        # forwards one after a sibling exits) must not kill us before this row is written.
        ledger.close(reason)
        remote.close()
    except BaseException as e:  # the ledger row says how this attempt ended, whatever happened
        ledger.close("aborted" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "error")
        raise
    finally:
        remote.stop()
        console.close()
        watcher.stop()
        stop.uninstall()
        if telemetry.sink is not None:
            telemetry.sink.close()
    if is_main:
        console.message(telemetry.final_summary(reason, steps, summary, out))
    return exit_codes.FOR_STOP[reason]


# ---------------------------------------------------------------------------- pieces


def _restore(resume_dir: Path, model: torch.nn.Module, optimizer: Any, accelerator: Any) -> Counters:
    """Adapter, optimizer, grad scaler and this rank's RNG from `resume_dir`, every field; returns
    the checkpoint's counters. The ledger totals it carried were read when the ledger opened."""
    saved = restore_training_state(
        resume_dir,
        model=model,
        optimizer=optimizer,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        scaler=accelerator.scaler,
    )
    return saved.counters()


def _evaluator(
    cfg: C.RunConfig, prepared: Any, model: torch.nn.Module, accelerator: Any, telemetry: Telemetry, counters: Counters
) -> Callable[[], float | None] | None:
    from datasets import load_from_disk

    evaluate = loop.make_evaluator(
        load_from_disk(str(prepared.eval_path)), model, accelerator, cfg.train.micro_batch_size
    )
    if evaluate is None:
        return None

    def run_and_report() -> float | None:
        started = time.monotonic()
        loss = evaluate()
        telemetry.evaluated(counters.step, loss, time.monotonic() - started)
        return loss

    return run_and_report


def _flops_fn(hf_config: Any, trainable: int) -> metrics.FlopsFn | None:
    try:
        shape = flops.model_shape(hf_config)
    except ValueError:
        return None  # an architecture the FLOP model does not know: MFU stays null
    frozen = shape.matmul_params()

    def fn(tokens: float, doc_sq: float, head_tokens: float) -> float:
        # trainer.loss applies the head to labelled positions only: head_tokens = trainable tokens.
        return flops.train_flops(shape, tokens, doc_sq, frozen, trainable, head_tokens=head_tokens)

    return fn
