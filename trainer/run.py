"""Wiring for `spotune train`: the only module that sees the whole RunConfig.

`train(cfg)` builds the accelerator, data, model, optimizer, sampler, checkpoint manager,
ledger and meter, resumes from the newest checkpoint that verifies, hands everything to
`loop.train_loop`, writes `final/` and returns the process exit code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch

from trainer import config as C
from trainer import exit_codes, flops, loop, metrics, tiny
from trainer.atomic import fsync_tree, publish_dir, remove_temp_siblings, temp_sibling
from trainer.batches import StepDataset, step_loader
from trainer.loss import accepts_logits_to_keep
from trainer.model import build, count_params
from trainer.restart import preemption
from trainer.restart.checkpoint import CheckpointManager, resolve_resume
from trainer.restart.ledger import Ledger
from trainer.restart.state import (
    TrainState,
    check_compatible,
    gather_rng,
    restore_training_state,
    unwrap_peft,
    write_training_state,
)
from trainer.sampler import StepSampler


def model_path(cfg: C.RunConfig) -> str:
    return tiny.resolve_model(cfg.model.name_or_path)


def tokenizer_path(cfg: C.RunConfig) -> str:
    return cfg.data.tokenizer or model_path(cfg)


def prepare_data(cfg: C.RunConfig, progress: bool = True) -> Any:
    """Prepare (or reuse) the packed dataset of `cfg` and print its summary."""
    from trainer import data

    data_cfg = dataclasses.replace(cfg.data, path=tiny.resolve_data(cfg.data.path))
    cache_root = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.output_dir) / "data"
    prepared = data.prepare(data_cfg, tokenizer_path(cfg), cache_root, progress=progress, seed=cfg.seed)
    if progress:
        print(prepared.summary(), flush=True)
    return prepared


def make_accelerator(cfg: C.RunConfig) -> Any:
    """Accelerate owns device placement, autocast (+ fp16 grad scaler) and DDP wrapping.

    Gradient accumulation stays ours (loop.py counts tokens over the whole step), so the
    accelerator runs with gradient_accumulation_steps=1. Under `torchrun` on a CPU-only
    machine, `cpu=True` still gives one gloo rank per process.
    """
    from accelerate import Accelerator

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
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers or None,
        project_dir=cfg.output_dir,
    )
    from accelerate.utils import DistributedType

    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        # Checkpoints are written by rank 0 from full (unsharded) adapter and optimizer state,
        # which holds for DDP only; an FSDP/DeepSpeed run would silently save one shard.
        raise C.ConfigError(
            [
                f"accelerate is configured for {accelerator.distributed_type.value}; spotune supports one process or "
                "DDP (torchrun / accelerate launch --multi_gpu). A LoRA adapter's state fits on every GPU; for a base "
                "model that does not, use adapter.method=qlora"
            ],
            "accelerate config",
        )
    return accelerator


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


def total_steps(train: C.TrainConfig, sampler: StepSampler) -> int:
    return train.max_steps if train.max_steps is not None else sampler.steps_for_epochs(train.epochs)


def train(cfg: C.RunConfig) -> int:
    """Train (resuming when a checkpoint verifies) and return the process exit code."""
    from datasets import load_from_disk

    out = Path(cfg.output_dir)
    accelerator = make_accelerator(cfg)
    rank, world, is_main = accelerator.process_index, accelerator.num_processes, accelerator.is_main_process
    stop = preemption.Preemption().install()
    show = is_main and cfg.metrics.progress

    with accelerator.main_process_first():  # rank 0 prepares; the others then reuse its cache
        prepared = prepare_data(cfg, progress=show)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "config.yaml").exists():
            (out / "config.yaml").write_text(C.to_yaml(cfg))

    from accelerate.utils import set_seed

    # Resolved before the model loads, so a bad metrics.gpu fails in a second, not a minute.
    peak_flops = metrics.resolve_peak_flops(cfg.metrics.peak_flops, cfg.metrics.gpu, accelerator.device)
    set_seed(cfg.seed)  # same LoRA init on every rank (DDP also broadcasts rank 0's weights)
    model = build(cfg.model, cfg.adapter, name_or_path=model_path(cfg), device=accelerator.device)
    counts = count_params(model)
    rows = load_from_disk(str(prepared.train_path))
    t = cfg.train
    sampler = StepSampler(len(rows), t.micro_batch_size * t.grad_accum * world, seed=cfg.seed, shuffle=cfg.data.shuffle)
    steps = total_steps(t, sampler)
    optimizer = build_optimizer(t, [p for p in model.parameters() if p.requires_grad], accelerator.device)
    model, optimizer = accelerator.prepare(model, optimizer)
    set_seed(cfg.seed + rank)  # distinct dropout streams per rank from here on

    structural = C.structural_fields(cfg, world)
    resume_dir, notes = resolve_resume(out / "checkpoints", cfg.checkpoint.resume, clean=is_main)
    state = TrainState(
        config_fingerprint=C.fingerprint(cfg, world),
        structural=structural,
        data_fingerprint=prepared.fingerprint,
        config=cfg.to_dict(),
        world_size=world,
        seed=cfg.seed,
    )
    if resume_dir is not None:
        saved = TrainState.from_json((resume_dir / "trainer_state.json").read_text())
        notes += check_compatible(saved, structural, prepared.fingerprint, cfg.checkpoint.allow_config_change)
    ledger = Ledger.open(
        out,
        world,
        price_per_hour=cfg.metrics.price_per_hour,
        carried_totals=saved.ledger if resume_dir is not None else None,
        enabled=is_main,
    )
    manager = CheckpointManager(out / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    console = metrics.Console(steps, 0, enabled=cfg.metrics.progress, is_main=is_main)
    for note in notes:
        console.message(f"spotune: {note}")

    meter = metrics.Meter(
        world_size=world,
        warmup_steps=cfg.metrics.warmup_steps,
        flops_fn=_flops_fn(
            accelerator.unwrap_model(model).config, counts.trainable, selects_logits=accepts_logits_to_keep(model)
        ),
        peak_flops=peak_flops,
        price_per_hour=cfg.metrics.price_per_hour,
        total_steps=steps,
        device_seconds_fn=lambda: float(ledger.totals()["device_seconds"]),  # one source of truth: the ledger
    )
    sink = metrics.JsonlSink(out / "metrics.jsonl") if is_main else None
    if cfg.metrics.trackers:
        accelerator.init_trackers("spotune", config=_flat(cfg.to_dict()))

    def save(progress: loop.Progress) -> float:
        started = time.monotonic()
        rng = gather_rng(world)  # collective: every rank's generators
        for ours, theirs in _COUNTERS.items():
            setattr(state, theirs, getattr(progress, ours))
        state.epoch, state.cursor = sampler.position(progress.step)
        state.ledger = ledger.totals()
        if is_main:
            result = manager.save(
                progress.step,
                lambda tmp: write_training_state(
                    tmp, model=model, optimizer=optimizer, state=state, rng=rng, scaler=accelerator.scaler
                ),
            )
            warning = preemption.save_fits_notice(result.seconds, cfg.checkpoint.notice_seconds)
            if warning:
                console.message(f"spotune: {warning}")
        accelerator.wait_for_everyone()  # nobody runs ahead of a checkpoint that is not committed yet
        seconds = time.monotonic() - started
        ledger.add_checkpoint(seconds)
        ledger.checkpointed()
        ledger.heartbeat(progress.step)
        return seconds

    def log(row: dict[str, Any]) -> None:
        ledger.heartbeat(row.get("step"))
        if is_main:
            sink.write(row)
            if cfg.metrics.trackers:
                accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    progress = loop.Progress()
    if resume_dir is not None:  # last before the first step: it restores the RNG
        state, progress = _restore(resume_dir, model, optimizer, accelerator, fresh=state)
        console.message(f"spotune: resuming from {resume_dir} at step {progress.step} of {steps}")
    meter.start_step = progress.step
    console.update(progress.step)

    plan = loop.LoopPlan(
        total_steps=steps,
        lr=loop.LrSchedule(
            peak=t.lr, total_steps=steps, warmup_steps=t.warmup_steps, kind=t.schedule, min_lr_ratio=t.min_lr_ratio
        ),
        max_grad_norm=t.max_grad_norm,
        max_bad_steps=t.max_bad_steps,
        log_every=cfg.metrics.log_every,
        eval_every=t.eval_every if prepared.eval_path is not None else None,
        save_every_steps=cfg.checkpoint.every_steps,
        save_every_minutes=cfg.checkpoint.every_minutes,
        max_gpu_hours=t.max_gpu_hours,
        max_cost=t.max_cost,
    )
    hooks = loop.Hooks(
        save=save,
        log=log,
        message=console.message,
        meter=meter,
        console=console,
        stop_requested=lambda: stop.requested,
        epoch_of=lambda step: round(step / sampler.steps_per_epoch, 4),
        step_done=lambda seconds: ledger.add_productive(seconds),
        evaluate=_evaluator(cfg, prepared, model, accelerator) if plan.eval_every else None,
    )
    reason: loop.StopReason = "finished"
    try:
        if progress.step < steps:
            dataset = StepDataset(
                rows,
                sampler,
                rank,
                world,
                t.micro_batch_size,
                t.grad_accum,
                steps,
                select_logits=accepts_logits_to_keep(model),
            )
            batches = step_loader(dataset, progress.step, accelerator.device, cfg.seed)
            ledger.mark_first_step()
            reason = loop.train_loop(accelerator, model, optimizer, batches, plan, progress, hooks)
        if reason in ("finished", "budget") and is_main:
            write_final(out / "final", model, tokenizer_path(cfg))
        accelerator.wait_for_everyone()
        summary = meter.summary()
        # Closed while the signal handlers are still installed: a late SIGTERM (torchrun
        # forwards one after a sibling exits) must not kill us before this row is written.
        ledger.close(reason)
    except BaseException as e:  # the ledger row says how this attempt ended, whatever happened
        ledger.close("aborted" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "error")
        raise
    finally:
        console.close()
        stop.uninstall()
        if sink is not None:
            sink.close()
    if cfg.metrics.trackers:
        accelerator.end_training()
    if is_main:
        console.message(_final_summary(reason, progress, steps, summary, out))
    return exit_codes.FOR_STOP[reason]


# ---------------------------------------------------------------------------- pieces


def _final_summary(reason: str, progress: loop.Progress, steps: int, summary: dict[str, Any], out: Path) -> str:
    """The run's last words for a person: status, loss, speed, money and where to look next."""

    def num(value: float | None, fmt: str, missing: str = "n/a") -> str:
        return missing if value is None else format(value, fmt)

    loss = num(progress.last_loss, ".4f")
    cost = summary["cost"]
    lines = [
        f"spotune: {reason} at step {progress.step}/{steps}",
        f"  {'final' if reason == 'finished' else 'last'} loss {loss}; sustained {num(summary['sustained_tokens_per_s'], ',.0f')} tokens/s; "
        f"{summary['device_hours']:.4f} GPU-hours (devices x wall time, all attempts); "
        f"cost {'n/a (set metrics.price_per_hour)' if cost is None else f'{cost:.4f}'}",
    ]
    if (out / "final").is_dir():
        lines.append(f"  adapter: {out / 'final'}")
    if (out / "report.html").is_file():
        lines.append(f"  report:  {out / 'report.html'}")
    return "\n".join(lines)


# loop.Progress field -> TrainState field: the one map used to save and to restore the counters.
_COUNTERS = {
    "step": "step",
    "trainable_tokens": "tokens",
    "real_tokens": "real_tokens",
    "skipped_steps": "skipped_steps",
    "bad_in_a_row": "consecutive_bad_steps",
}
# A counter added to Progress but not mapped would silently restart at 0 on resume.
_NOT_SAVED = {"last_loss", "last_eval_loss"}  # reported, not state
if {f.name for f in dataclasses.fields(loop.Progress)} != set(_COUNTERS) | _NOT_SAVED:
    raise ImportError("trainer/run.py: map every loop.Progress counter in _COUNTERS")


def _restore(
    resume_dir: Path, model: torch.nn.Module, optimizer: Any, accelerator: Any, fresh: TrainState
) -> tuple[TrainState, loop.Progress]:
    """Adapter, optimizer, grad scaler and this rank's RNG from `resume_dir`, every field.

    The returned state keeps the checkpoint's counters and ledger totals but describes this
    run (config, fingerprints, world size), since that is what the next save records.
    """
    saved = restore_training_state(
        resume_dir,
        model=model,
        optimizer=optimizer,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        scaler=accelerator.scaler,
    )
    counters = {theirs: getattr(saved, theirs) for theirs in _COUNTERS.values()}
    progress = loop.Progress(**{ours: counters[theirs] for ours, theirs in _COUNTERS.items()})
    state = dataclasses.replace(fresh, **counters, epoch=saved.epoch, cursor=saved.cursor, ledger=saved.ledger)
    return state, progress


def _evaluator(cfg: C.RunConfig, prepared: Any, model: torch.nn.Module, accelerator: Any) -> Any:
    from datasets import load_from_disk

    return loop.make_evaluator(load_from_disk(str(prepared.eval_path)), model, accelerator, cfg.train.micro_batch_size)


def _flops_fn(hf_config: Any, trainable: int, selects_logits: bool) -> metrics.FlopsFn | None:
    try:
        shape = flops.model_shape(hf_config)
    except ValueError:
        return None  # an architecture the FLOP model does not know: MFU stays null
    frozen = shape.matmul_params()

    def fn(tokens: float, doc_sq: float, head_tokens: float) -> float:
        return flops.train_flops(
            shape, tokens, doc_sq, frozen, trainable, head_tokens=head_tokens if selects_logits else None
        )

    return fn


def write_final(directory: Path, model: torch.nn.Module, tokenizer: str) -> None:
    """`final/`: the PEFT adapter (adapter_model.safetensors + adapter_config.json) and the tokenizer.

    Written into a temp directory, fsynced and renamed into place like a checkpoint, so a kill
    mid-write never leaves a torn adapter that `export` or a server would pick up.
    """
    from transformers import AutoTokenizer

    model = unwrap_peft(model)
    remove_temp_siblings(directory)
    tmp = temp_sibling(directory)
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(str(tmp))
    fsync_tree(tmp)
    publish_dir(tmp, directory)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
