"""Wiring for `spotune train`: the only module that sees the whole RunConfig.

`train(cfg)` reads top to bottom in the order a run goes: the process and its store
(trainer/training/process.py), the data, the model and its optimizer, the resume, the loop
(trainer/training/loop.py), then the final adapter, the upload flush and the report. One `ExitStack`
closes what each step opened, on every exit path (trainer/training/shutdown.py says why that matters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer import config as C
from trainer import exit_codes
from trainer.data.packed import PackedRows
from trainer.data.read import DataError
from trainer.data.sampler import StepSampler, run_steps
from trainer.exit_codes import StopReason
from trainer.model import compile_cache, distributed, flops
from trainer.model.balance import balanced
from trainer.model.load import build, build_optimizer, count_params
from trainer.model.objective import Objective, Sft
from trainer.model.preference import Kto, Preference, regime_notes
from trainer.restart.books.ledger import Ledger, timed
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.saving import Saver
from trainer.restart.local.state import Counters, TrainState, check_compatible
from trainer.restart.ownership import owner
from trainer.serve.final import write_final
from trainer.training import attempts, autofit, determinism, loop, metrics, process, shutdown, trackers
from trainer.training.batches import StepDataset, identical_pairs, prefetching, step_loader
from trainer.training.console import Console
from trainer.training.inputs import (
    init_adapter,
    init_structural,
    keep_init_adapter,
    model_path,
    pin_data,
    prepare_once_per_node,
    tokenizer_path,
)
from trainer.training.telemetry import Budget, JsonlSink, Telemetry, flat_config


def train(cfg: C.RunConfig, wait: float | None = None, held: owner.Holding | None = None) -> int:
    """Train (resuming when a checkpoint verifies); the exit code. Each attempt holds the run's lock and lease
    throughout (RunBusy after `wait`s): the first the one `held` (`spotune train` takes it before importing
    this module), if given; an `auto` setting that ran out of memory is retried once here on one rank."""
    code, retry = _attempt(cfg, wait, held)
    if retry:  # autofit.after_out_of_memory: from the last checkpoint, with the next smaller setting
        shutdown.release_memory()
        code, _ = _attempt(cfg, wait, None)  # the first attempt released its hold: taken again
    return code


def _attempt(cfg: C.RunConfig, wait: float | None, held: owner.Holding | None) -> tuple[int, bool]:
    """One attempt: its exit code, and whether to run again in this process (an `auto` setting ran out)."""
    entered = time.time()
    phases: dict[str, float] = {}  # fixed costs for the ledger, timed before it can open
    with timed(phases, "imports"):  # the rest of the libraries train() needs (the ledger adds the time before)
        from accelerate.utils import set_seed

    with determinism.kernels(cfg.train.deterministic) as notes, contextlib.ExitStack() as closing:
        # One writer per run, before anything touches output_dir or the store (trainer/restart/ownership/owner.py).
        holding = held if held is not None else owner.take_run(cfg, wait)
        assert not holding.released, "an attempt starts only on a hold no earlier attempt gave back"
        closing.callback(holding.release)  # released last, when everything the attempt opened is closed
        phases["store"] = holding.seconds  # its lease requests; a `held` one's are not imports (below)
        proc = process.start(
            process_settings(cfg), phases, closing, fence=holding.lease
        )  # accelerator, DDP/FSDP, store, stop paths
        cfg = resolved_precision(cfg, proc.accelerator)  # `auto`: what the accelerator runs on this GPU
        device = proc.accelerator.device
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        if holding.lease is not None:  # a kill before the ledger opens is still booked with its device and rate
            holding.lease.device, holding.lease.price_per_hour = device_name, cfg.metrics.price_per_hour
        with timed(phases, "data"):
            cfg = pin_data(cfg, proc.is_main)  # hub datasets stay at the commit of the run's first start
            prepared = prepare_once_per_node(cfg, proc)
        # Resolved before the model loads, so a bad metrics.gpu fails in a second, not a minute.
        peak_flops = metrics.resolve_peak_flops(cfg.metrics.peak_flops, cfg.metrics.gpu, device)
        # `auto` micro-batch / checkpointing / offloading: the fastest the estimate fits, all ranks together.
        cfg, auto_notes, auto = autofit.resolve_for_device(
            cfg, model_path(cfg), device, proc.world, proc.sharding.fsdp, proc.out
        )
        rows = PackedRows(prepared.train_path)
        refuse_identical_pairs(rows, prepared.train_path)  # a preference objective never trains on them
        with timed(phases, "resolve"):
            # local or remote, on rank 0; a request applied already (a rerun of the same command) resumes as auto
            resume_dir, resume_notes = proc.remote.resolve(proc.remote.request.acts_on)
            keep_init_adapter(cfg, proc)  # adapter.init_from: the run's own copy, here and in the store
        sched = _schedule(cfg, proc, prepared, len(rows), resume_dir)
        if attempts.finished_already(
            proc, sched.steps, resume_dir, holding.lease
        ):  # before the model loads: no attempt, no hours
            return exit_codes.EXIT_FINISHED, False
        set_seed(cfg.seed)  # same LoRA init on every rank (DDP also broadcasts rank 0's weights)
        with timed(phases, "model"):
            model_notes: list[str] = []  # what the log says about the model (a mixture of experts: its experts)
            model = _build_model(cfg, proc, model_notes)
        counts = count_params(model)
        optimizer_device = torch.device("cpu") if proc.sharding.cpu_offload else device  # where it steps
        model, optimizer = distributed.prepare(
            proc.accelerator, model, lambda params: build_optimizer(cfg.train, params, optimizer_device), proc.sharding
        )
        set_seed(cfg.seed + proc.rank)  # distinct dropout streams per rank from here on

        books = _open_books(cfg, proc, sched, model, counts.trainable, peak_flops, phases, closing, holding)
        # interpreter, CLI and config before train(), less the hold taken before it
        books.ledger.phases["imports"] += entered - books.ledger.start - (held.seconds if held is not None else 0.0)
        books.ledger.data_reused = bool(prepared.reused)
        books.ledger.device = device_name
        for note in [*notes, *proc.sharding.notes, *auto_notes, *resume_notes, *sched.notes, *model_notes]:
            books.console.message(f"spotune: {note}")
        saver = _saver(cfg, proc, sched, model, optimizer, books, resume_dir)  # loads compiled artifacts
        counters = Counters()
        if resume_dir is not None:  # last before the first step: it restores the RNG
            with books.ledger.timed("restore"):
                counters = attempts.restore(resume_dir, model, optimizer, proc.accelerator)
        attempts.account_resume(books.ledger, books.console.message, proc, counters.step, resume_dir, sched.steps)
        books.meter.start_step = counters.step
        books.console.start(counters.step)  # rate and ETA count this attempt's steps only

        try:
            reason = _train_steps(cfg, proc, sched, rows, prepared, model, optimizer, counters, saver, books)
        except shutdown.OutOfMemory as e:  # exit 5 with the figures, or an `auto` setting retried smaller
            books.ledger.close("out_of_memory")
            hf_config = proc.accelerator.unwrap_model(model).config
            outcome = autofit.after_out_of_memory(e, cfg, hf_config, proc.accelerator, auto, proc.out)
            proc.remote.push_run_files(cfg.checkpoint.notice_seconds)  # a new VM skips the setting that ran out
            return outcome
        return _finish(cfg, proc, sched, model, reason, books), False


# ---------------------------------------------------------------------------- the stages


def process_settings(cfg: C.RunConfig) -> process.Settings:
    """What the process's resources are built from (trainer/training/process.py `start`): a few values, not the run."""
    t = cfg.train
    return process.Settings(
        cfg.output_dir,
        cfg.checkpoint,
        t.mixed_precision,
        t.distributed,
        t.fsdp_cpu_offload,
        tuple(cfg.metrics.trackers),
    )


def resolved_precision(cfg: C.RunConfig, accelerator: Any) -> C.RunConfig:
    """`cfg` with `train.mixed_precision: auto` replaced by what `make_accelerator` chose for this GPU."""
    if cfg.train.mixed_precision != "auto":
        return cfg
    return cfg.replace(**{"train.mixed_precision": accelerator.mixed_precision})


def refuse_identical_pairs(rows: PackedRows, where: Path) -> None:
    """DataError (exit 2) when prepared preference rows hold a pair of identical answers (batches.py
    `identical_pairs`: prepared by a version that did not drop them)."""
    found = identical_pairs(rows)
    if found:
        raise DataError(
            f"{where}: {len(found)} packed row(s) hold a pair whose chosen and rejected answers are the same tokens "
            f"(first: row {found[0]}); such a pair has no gradient but counts in the step and as a wrong ranking. "
            "Prepare the data again (delete this folder): preparation drops them as identical_answers"
        )


def objective_for(train: C.TrainConfig) -> Objective:
    """The objective `train.objective` names, with its settings (here: objective.py's contract does not
    import its implementations)."""
    if train.objective == "kto":
        return Kto.of(train)
    return Sft() if train.objective == "sft" else Preference.of(train)


def _build_model(cfg: C.RunConfig, proc: process.Process, notes: list[str]) -> torch.nn.Module:
    model_cfg = cfg.model
    if proc.sharding.activation_checkpointing:  # asked for by an accelerate FSDP config
        model_cfg = dataclasses.replace(model_cfg, gradient_checkpointing=True)
    return build(
        model_cfg,
        cfg.adapter,
        name_or_path=model_path(cfg),
        device=proc.accelerator.device,
        autocast=cfg.train.mixed_precision != "no",
        sharded=proc.sharding.fsdp,
        progress=proc.accelerator.is_local_main_process,  # a download shows, once per machine
        init=init_adapter(cfg),  # adapter.init_from (a DPO run's reference too)
        no_dropout=C.dropout_off(cfg.train),
        notes=notes,
    )


@dataclass
class Schedule:
    """Which rows each step trains on and how many steps the run has, and what a checkpoint must match."""

    split: C.BatchSplit
    sampler: StepSampler
    steps: int
    state: TrainState
    """What every checkpoint of the run records: structure, data fingerprint, config."""
    saved: TrainState | None
    notes: list[str]


def _schedule(cfg: C.RunConfig, proc: process.Process, prepared: Any, n_rows: int, resume_dir: Path | None) -> Schedule:
    saved = TrainState.from_json((resume_dir / "trainer_state.json").read_text()) if resume_dir is not None else None
    # The run is defined by its global batch: a resume on another device count keeps it and only
    # the per-device split changes (trainer/data/sampler.py: the same rows every step).
    split = C.batch_split(cfg.train, proc.world, saved.structural.get("global_batch_rows") if saved else None)
    structural = C.structural_fields(cfg, proc.world, split.global_rows) | init_structural(cfg)
    notes: list[str] = regime_notes(cfg.train)
    if saved is not None:
        notes += check_compatible(saved, structural, prepared.fingerprint, cfg.checkpoint.allow_config_change)
        if saved.world_size != proc.world:
            notes.append(split.resume_note(saved.world_size, C.lora_dropout(cfg)))
    sampler = StepSampler(n_rows, split.global_rows, seed=cfg.seed, shuffle=cfg.data.shuffle)
    steps = run_steps(n_rows, split.global_rows, cfg.train.max_steps, cfg.train.epochs)
    state = TrainState(
        structural=structural,
        data_fingerprint=prepared.fingerprint,
        config=cfg.to_dict(),
        world_size=proc.world,
        seed=cfg.seed,
    )
    return Schedule(split, sampler, steps, state, saved, notes)


@dataclass
class Books:
    """Where the run's account goes: the ledger (device-hours, cost), the meter, the console, the sinks."""

    ledger: Ledger
    meter: metrics.Meter
    console: Console
    telemetry: Telemetry
    trackers: trackers.Trackers | None


def _open_books(
    cfg: C.RunConfig,
    proc: process.Process,
    sched: Schedule,
    model: torch.nn.Module,
    trainable: int,
    peak_flops: float | None,
    phases: dict[str, float],
    closing: contextlib.ExitStack,
    holding: owner.Holding,
) -> Books:
    saved = sched.saved
    lease = holding.lease
    ledger = Ledger.open(
        proc.out,
        proc.world,
        price_per_hour=cfg.metrics.price_per_hour,
        carried_totals=saved.ledger if saved is not None else None,
        enabled=proc.is_main,
        phases=phases,
        process_start=holding.clock_start(),  # after a --wait: from when this attempt got the run
        attempt_id=lease.id if lease is not None else None,
        lost_attempts=lease.hand_over() if lease is not None else (),  # killed attempts the lease names
        resume_request=proc.remote.request.recorded,  # applies once: a rerun finds it (restart/remote/new_run.py)
    )
    closing.push(_ledger_row_on_error(ledger))
    console = Console(sched.steps, bar=cfg.metrics.progress, is_main=proc.is_main)
    closing.callback(console.close)
    proc.remote.message = console.message
    proc.remote.start_uploads()
    meter = metrics.Meter(
        world_size=proc.world,
        warmup_steps=cfg.metrics.warmup_steps,
        flops_fn=flops.meter_flops_fn(
            proc.accelerator.unwrap_model(model).config, trainable, C.runs_reference(cfg.train.objective)
        ),
        peak_flops=peak_flops,
        price_per_hour=cfg.metrics.price_per_hour,
        total_steps=sched.steps,
        device_seconds_fn=lambda: float(ledger.totals()["device_seconds"]),  # one source of truth: the ledger
    )
    tracked = None
    if cfg.metrics.trackers and proc.is_main:  # the same tracker runs on every attempt (trackers.py)
        tracked = trackers.start(cfg.metrics, proc.out, flat_config(cfg.to_dict()), saved, ledger.attempt, closing)
        sched.state.trackers = tracked.ids  # every checkpoint carries them to the next machine
    sink = JsonlSink(proc.out / "metrics.jsonl") if proc.is_main else None
    if sink is not None:
        closing.callback(sink.close)
    telemetry = Telemetry(
        meter,
        console,
        ledger,
        sink,
        log_every=cfg.metrics.log_every,
        total_steps=sched.steps,
        budget=Budget(max_gpu_hours=cfg.train.max_gpu_hours, max_cost=cfg.train.max_cost),
        epoch_of=lambda step: round(step / sched.sampler.steps_per_epoch, 4),
        digest_of=sched.sampler.digest,
        tracker_log=tracked.log if tracked is not None else None,
        row_extras=proc.remote.metrics,
    )
    return Books(ledger, meter, console, telemetry, tracked)


def _ledger_row_on_error(ledger: Ledger) -> Callable[..., bool]:
    """The ledger row says how this attempt ended, whatever ended it (an ExitStack exit callback)."""

    def close(exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is not None:  # close is idempotent: a row already written stays
            ledger.close("aborted" if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) else "error")
        return False  # the exception goes on

    return close


def _saver(
    cfg: C.RunConfig, proc: process.Process, sched: Schedule, model: Any, optimizer: Any, books: Books, resume: Any
) -> Saver:
    stage = proc.out / compile_cache.FOLDER if proc.is_main else None  # the artifacts each checkpoint carries
    compiled = compile_cache.start(cfg.model, cfg.adapter, cfg.train.mixed_precision, model, resume, stage)
    if compiled is not None:  # model.compile: an earlier attempt's artifacts, loaded when the key matches
        books.ledger.compile_cache, books.telemetry.compiling = compiled.outcome, compiled.account
        books.console.message(f"spotune: model.compile: compiled artifacts {compiled.outcome}")
    return Saver(
        model=model,
        optimizer=optimizer,
        accelerator=proc.accelerator,
        state=sched.state,
        position=sched.sampler.position,
        manager=CheckpointManager(proc.out / "checkpoints", keep_last=cfg.checkpoint.keep_last),
        remote=proc.remote,
        ledger_totals=books.ledger.totals,
        notice_seconds=cfg.checkpoint.notice_seconds,
        message=books.console.message,
        on_saved=books.telemetry.saved,
        compiled=compiled,
    )


def _train_steps(
    cfg: C.RunConfig,
    proc: process.Process,
    sched: Schedule,
    rows: PackedRows,
    prepared: Any,
    model: torch.nn.Module,
    optimizer: Any,
    counters: Counters,
    saver: Saver,
    books: Books,
) -> StopReason:
    """The loop over the remaining steps, its loader's workers ending with it."""
    t = cfg.train
    if counters.step >= sched.steps:
        return "finished"
    # A mixture of experts' router load-balancing term, added to whichever objective trains (model/balance.py).
    objective, balance_note = balanced(objective_for(t), model, t.router_aux_loss_coef)
    if balance_note:
        books.console.message(f"spotune: {balance_note}")
    plan = loop.LoopPlan(
        total_steps=sched.steps,
        lr=loop.LrSchedule(
            peak=t.lr,
            total_steps=sched.steps,
            warmup_steps=t.warmup_steps,
            kind=t.schedule,
            min_lr_ratio=t.min_lr_ratio,
        ),
        max_grad_norm=t.max_grad_norm,
        max_bad_steps=t.max_bad_steps,
        eval_every=t.eval_every if prepared.eval_path is not None else None,
        save_every_steps=cfg.checkpoint.every_steps,
        save_every_minutes=cfg.checkpoint.every_minutes,
        objective=objective,
    )
    evaluate = None
    if plan.eval_every:
        evaluate = loop.make_evaluator(
            PackedRows(prepared.eval_path),
            model,
            proc.accelerator,
            int(t.micro_batch_size),
            report=lambda *result: books.telemetry.evaluated(counters.step, *result),
            objective=plan.objective,
        )
    timeout = distributed.CollectiveTimeout(t.collective_timeout_seconds)

    def on_step(record: loop.StepRecord) -> None:
        timeout.arm()  # after the first step: start-up may keep the other ranks waiting longer
        books.telemetry.on_step(record)

    hooks = loop.Hooks(
        save=saver,
        on_step=on_step,
        message=books.console.message,
        stop_requested=lambda: proc.stop.due(counters.step),
        over_budget=books.telemetry.over_budget,
        evaluate=evaluate,
    )
    dataset = StepDataset(rows, sched.sampler, proc.rank, proc.world, sched.split.micro_batch_size, sched.steps)
    workers = None if cfg.data.loader_workers == "auto" else cfg.data.loader_workers
    loader = step_loader(dataset, counters.step, proc.accelerator.device, cfg.seed, workers)
    books.ledger.mark_first_step()
    with prefetching(loader) as batches:  # its workers end with the block, whatever ends it
        reason = loop.train_loop(proc.accelerator, model, optimizer, batches, plan, counters, hooks)
    timeout.disarm()  # final/, the merge and the report may keep the other ranks waiting longer
    return reason


def _finish(
    cfg: C.RunConfig, proc: process.Process, sched: Schedule, model: Any, reason: StopReason, books: Books
) -> int:
    """final/, the upload flush, the report, the ledger row; returns the exit code."""
    ledger = books.ledger
    ledger.winding_down(reason)
    if reason in ("finished", "budget"):
        with ledger.timed("final"):  # a collective under FSDP
            write_final(proc.out / "final", model, tokenizer_path(cfg), proc.is_main, cfg.data)
    proc.accelerator.wait_for_everyone()
    with ledger.timed("flush"):
        proc.remote.finish(preempted=reason == "preempted", notice_seconds=cfg.checkpoint.notice_seconds)
    if proc.is_main:  # after the flush: a preempted machine spends its notice on the upload first
        # Before the ledger row (it counts what the user pays for): the page shows this attempt from the heartbeat.
        ledger.reporting()
        if cfg.metrics.report:
            from trainer.report import report_after_train

            report_after_train(proc.out, books.console.message)
    if books.trackers is not None:
        books.trackers.finish(reason, exit_codes.FOR_STOP[reason])
    # Closed while the signal handlers are still installed: a late SIGTERM (torchrun
    # forwards one after a sibling exits) must not kill us before this row is written.
    ledger.close(proc.remote.exit_reason(reason))  # a refused store write stopped it: an error, exit 1
    # After the row is written: the closing line's device-hours and cost are the ledger's, as `status` and
    # the report read them (taken before final/, the flush and the report, they fell short of the row).
    summary = books.meter.summary()
    proc.remote.close()
    books.console.close()
    if proc.is_main:
        books.console.message(
            books.telemetry.final_summary(
                reason, sched.steps, summary, proc.out, proc.stop.reason, proc.stop.planned, cfg.metrics.report
            )
        )
    return proc.remote.exit_code(exit_codes.FOR_STOP[reason], proc.out / "final")
