"""The training loop: one function, readable top to bottom (`train_loop`).

Per optimizer step: wait for the step's micro-batches (prefetched), set the learning rate
from the step, count the step's trainable tokens over every micro-batch and rank, run the
micro-batches (gradient sync only on the last), clip, refuse a non-finite step, step, log,
maybe evaluate, maybe checkpoint, maybe stop.

Loss convention (what must stay true; the per-token side is in trainer/loss.py):
- the step's loss is sum(per-token loss) / N, N = trainable tokens of the whole optimizer
  step over all micro-batches and ranks. Each micro-batch backpropagates
  loss_sum_local / (N / world_size); DDP then averages gradients over world_size ranks,
  so the applied gradient is exactly d(sum of every rank's loss_sum) / N.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.batches import StepBatch, count_trainable, eval_micro_batches, to_device
from trainer.exit_codes import StopReason
from trainer.loss import token_loss_sum
from trainer.restart.preemption import agree_all

# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class LrSchedule:
    """Learning rate as a pure function of the optimizer step, so resume needs only the step."""

    peak: float
    total_steps: int
    warmup_steps: int = 0
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        """lr of 0-based optimizer step `step`.

        Warm-up ramps linearly to the peak so that step 0 already trains ((step+1)/warmup)
        and step warmup-1 runs at the peak; then the decay goes from the peak at step
        `warmup` towards `min_lr_ratio * peak`, reached one step after the last step.
        """
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak
        floor = self.peak * self.min_lr_ratio
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.kind == "linear":
            return floor + (self.peak - floor) * (1.0 - progress)
        return floor + (self.peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------- loop


@dataclass(frozen=True)
class LoopPlan:
    """The loop's own settings, taken from train/checkpoint/metrics config by run.py."""

    total_steps: int
    lr: LrSchedule
    max_grad_norm: float = 1.0
    max_bad_steps: int = 5
    log_every: int = 1
    eval_every: int | None = None
    save_every_steps: int | None = None
    save_every_minutes: float | None = None
    max_gpu_hours: float | None = None
    max_cost: float | None = None


@dataclass
class Progress:
    """What the loop advances; run.py maps it to and from TrainState."""

    step: int = 0
    trainable_tokens: int = 0
    real_tokens: int = 0
    skipped_steps: int = 0
    bad_in_a_row: int = 0
    last_loss: float | None = None
    last_eval_loss: float | None = None


@dataclass
class Hooks:
    """The loop's side effects, kept out of it so it stays readable. All are called on every rank."""

    save: Callable[[Progress], float]
    """Write a checkpoint of `progress` (collective); returns seconds spent."""
    evaluate: Callable[[], float] | None = None
    """Token-weighted mean eval loss (collective)."""
    log: Callable[[dict[str, Any]], None] = lambda row: None
    """Receive a metrics row (rank 0 writes it)."""
    message: Callable[[str], None] = print
    stop_requested: Callable[[], bool] = lambda: False
    """This rank saw a preemption signal (local; the loop agrees across ranks)."""
    step_done: Callable[[float], None] = lambda seconds: None
    """Seconds of one finished optimizer step (the ledger's productive time)."""
    epoch_of: Callable[[int], float] = float
    meter: Any = None
    """A trainer.metrics.Meter (or None in bare tests)."""
    console: Any = None


def train_loop(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[StepBatch],
    plan: LoopPlan,
    progress: Progress,
    hooks: Hooks,
) -> StopReason:
    """Train from `progress.step` to `plan.total_steps`; returns why it stopped."""
    params = [p for p in model.parameters() if p.requires_grad]
    world = accelerator.num_processes
    device = accelerator.device
    meter, console = hooks.meter, hooks.console
    last_save = time.monotonic()
    data: Iterator[StepBatch] = iter(batches)
    model.train()

    while progress.step < plan.total_steps:
        step = progress.step
        t_start = time.monotonic()
        batch = next(data)  # prefetched by a DataLoader worker; time blocked here is data stall
        stall = time.monotonic() - t_start
        assert batch.step == step, f"data order broke: got the batch of step {batch.step} at step {step}"
        lr = plan.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # N over every micro-batch and rank, known before the first backward.
        counts = accelerator.reduce(batch.counts.to(device), reduction="sum")
        denom = counts[0].clamp(min=1).to(torch.float32) / world
        loss_sum = torch.zeros((), device=device)
        last = len(batch.micro) - 1
        for micro_step, micro in enumerate(batch.micro):
            micro = to_device(micro, device)
            # Own accumulation: skip DDP's all-reduce on all but the last micro-batch.
            sync = contextlib.nullcontext() if micro_step == last else accelerator.no_sync(model)
            with sync:
                loss = token_loss_sum(model, micro)
                accelerator.backward(loss / denom)
            loss_sum += loss.detach()

        global_loss = accelerator.reduce(loss_sum, reduction="sum") / counts[0].clamp(min=1)
        grad_norm = accelerator.clip_grad_norm_(params, plan.max_grad_norm or math.inf)
        # The one host sync per step (one small transfer): a non-finite loss or gradient is
        # never applied, and the same read brings the step's token counts for the meter.
        loss_value, norm_value, trainable, real, doc_sq = torch.stack(
            [global_loss.double(), grad_norm.double(), *counts.double()]
        ).tolist()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            optimizer.step()
            progress.bad_in_a_row = 0
        else:
            _skip_step(accelerator)
            progress.skipped_steps += 1
            if not _scaler_calibrating(accelerator, loss_value):
                progress.bad_in_a_row += 1
            hooks.message(
                f"step {step}: non-finite loss ({loss_value:.4g}) or gradient norm ({norm_value:.4g}): step skipped, "
                f"{progress.bad_in_a_row} in a row (stops at train.max_bad_steps={plan.max_bad_steps})"
            )
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.trainable_tokens += int(trainable)
        progress.real_tokens += int(real)
        progress.last_loss = loss_value
        step_seconds = time.monotonic() - t_start
        hooks.step_done(step_seconds)
        if meter is not None:
            # The head runs only where a label is (token_loss_sum), so its FLOPs count the
            # trainable tokens, not every real one.
            meter.step(step, step_seconds, stall, real, doc_sq, head_tokens=trainable)

        if progress.step % plan.log_every == 0 or progress.step == plan.total_steps or not finite:
            row = dict(
                step=progress.step,
                epoch=hooks.epoch_of(progress.step),
                loss=loss_value,
                lr=lr,
                grad_norm=norm_value,
                skipped_steps=progress.skipped_steps,
                trainable_tokens=progress.trainable_tokens,
                real_tokens=progress.real_tokens,
            )
            row = meter.row(**row) if meter is not None else row  # adds rates, MFU, memory, cost
            hooks.log(row)
            if console is not None:
                console.update(0, row)
        if console is not None:
            console.update(1)

        if progress.bad_in_a_row >= plan.max_bad_steps:
            hooks.message(
                f"stopping: {progress.bad_in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={plan.max_bad_steps}); lower train.lr, check the data, or use "
                "train.mixed_precision=bf16 instead of fp16. The weights are those of the last good step."
            )
            return "bad_steps"

        if hooks.evaluate is not None and plan.eval_every and progress.step % plan.eval_every == 0:
            t_eval = time.monotonic()
            progress.last_eval_loss = hooks.evaluate()
            model.train()
            hooks.log({"step": progress.step, "eval_loss": progress.last_eval_loss})
            if meter is not None:
                meter.pause(time.monotonic() - t_eval)

        # Every rank must take the same branch: each decision is reduced over ranks.
        time_due = plan.save_every_minutes is not None and time.monotonic() - last_save >= 60 * plan.save_every_minutes
        preempted, over_budget, time_due = agree_all(
            [hooks.stop_requested(), _over_budget(plan, meter), time_due], accelerator
        )
        step_due = bool(plan.save_every_steps) and progress.step % plan.save_every_steps == 0
        finished = progress.step >= plan.total_steps
        if preempted or over_budget or time_due or step_due or finished:
            seconds = hooks.save(progress)
            last_save = time.monotonic()
            if meter is not None:
                meter.pause(seconds)
        if preempted:
            return "preempted"
        if over_budget:
            hooks.message(
                f"stopping at step {progress.step}: budget reached (train.max_gpu_hours={plan.max_gpu_hours}, "
                f"train.max_cost={plan.max_cost}); a checkpoint was saved, raise the limit and rerun to continue"
            )
            return "budget"
    return "finished"


# ---------------------------------------------------------------------------- helpers


def _skip_step(accelerator: Any) -> None:
    """Leave the weights and the optimizer state untouched; keep an fp16 grad scaler consistent.

    clip_grad_norm_ has already unscaled the gradients and recorded the overflow in the
    scaler; `update()` lowers the scale and resets it for the next step.
    """
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        scaler.update()


def _scaler_calibrating(accelerator: Any, loss_value: float) -> bool:
    """fp16 overflow with a finite loss while the scale is still above 1 is the scaler finding
    its range, not divergence: such steps are skipped but do not count toward max_bad_steps."""
    scaler = getattr(accelerator, "scaler", None)
    return scaler is not None and math.isfinite(loss_value) and scaler.get_scale() > 1.0


def _over_budget(plan: LoopPlan, meter: Any) -> bool:
    if meter is None:
        return False
    if plan.max_gpu_hours is not None and meter.device_seconds() / 3600.0 >= plan.max_gpu_hours:
        return True
    cost = meter.cost()
    return plan.max_cost is not None and cost is not None and cost >= plan.max_cost


# ---------------------------------------------------------------------------- evaluation


def make_evaluator(
    rows: Any, model: torch.nn.Module, accelerator: Any, micro_batch_size: int
) -> Callable[[], float] | None:
    """Token-weighted mean loss over the held-out `rows` (collective: every rank runs its share)."""
    if len(rows) == 0:
        return None

    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
        with torch.no_grad():
            for micro in eval_micro_batches(
                rows, accelerator.process_index, accelerator.num_processes, micro_batch_size
            ):
                micro = to_device(micro, accelerator.device)
                total[0] += token_loss_sum(model, micro).double()
                total[1] += count_trainable(micro["labels"])
        total = accelerator.reduce(total, reduction="sum")
        return float(total[0] / total[1].clamp(min=1))

    return evaluate
