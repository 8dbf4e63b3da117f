"""The training loop: one function, readable top to bottom (`train_loop`).

Per optimizer step: wait for the step's micro-batches (prefetched), set the learning rate
from the step, count the step's trainable tokens over every micro-batch and rank, run the
micro-batches (gradient sync only on the last), clip, refuse a non-finite step, step, log,
maybe evaluate, maybe checkpoint, maybe stop.

Loss convention (what must stay true; the per-unit side is the objective's, trainer/model/objective.py):
- the step's loss is sum(per-unit loss) / N, N = the objective's units (trainable tokens for SFT,
  pairs for a preference objective) of the whole optimizer step over all micro-batches and ranks.
  Each micro-batch backpropagates loss_sum_local / (N / world_size); DDP (or FSDP's reduce-scatter)
  then averages gradients over world_size ranks, so the applied gradient is exactly
  d(sum of every rank's loss_sum) / N.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.data.packed import PackedRows
from trainer.exit_codes import StopReason
from trainer.model import distributed
from trainer.model.objective import Counts, Objective, Sft
from trainer.restart.local.checkpoint import save_step_due, save_time_due
from trainer.restart.local.state import Counters
from trainer.restart.signals.preemption import agree_all
from trainer.training.batches import StepBatch, eval_counts, eval_micro_batches, to_device
from trainer.training.shutdown import OOM_ERRORS, OutOfMemory

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
    """The loop's own settings, taken from train/checkpoint config by run.py."""

    total_steps: int
    lr: LrSchedule
    max_grad_norm: float = 1.0
    max_bad_steps: int = 5
    eval_every: int | None = None
    save_every_steps: int | None = None
    save_every_minutes: float | None = None
    objective: Objective = dataclasses.field(default_factory=Sft)
    """What the loop minimises (train.objective); SFT's token-weighted loss by default."""


@dataclass(frozen=True)
class StepRecord:
    """What one finished optimizer step hands out: the wiring feeds the meter, the metrics
    sinks, the console and the ledger from it, so the loop knows none of them."""

    counters: Counters
    """A copy of the run's counters after this step (`counters.step` steps completed)."""
    loss: float
    """Token-weighted loss of the step over every rank (NaN/inf when it was skipped)."""
    lr: float
    grad_norm: float
    applied: bool
    """False when a non-finite loss or gradient made the loop skip the update."""
    seconds: float
    """Wall time of the step, data wait included."""
    stall_seconds: float
    """Time spent waiting for the step's batch (data stall)."""
    trainable_tokens: int
    """This step's tokens that carry a label, over every rank (where the head's logits are computed)."""
    real_tokens: int
    """This step's non-padding tokens over every rank."""
    doc_len_sq: int
    """Sum over this step's documents of length squared (causal attention FLOPs)."""
    extras: dict[str, float] = dataclasses.field(default_factory=dict)
    """The objective's own figures of the step (a preference objective's rewards and log-probs)."""


@dataclass
class Hooks:
    """The loop's side effects, kept out of it so it stays readable. All are called on every rank."""

    save: Callable[[Counters], float]
    """Write a checkpoint at `counters` (collective); returns seconds spent."""
    evaluate: Callable[[], float | None] | None = None
    """Run evaluation and report it (collective); returns the mean eval loss (weighted as the objective's)."""
    on_step: Callable[[StepRecord], None] = lambda record: None
    """Every finished optimizer step, in order."""
    message: Callable[[str], None] = print
    stop_requested: Callable[[], bool] = lambda: False
    """This rank saw a preemption signal (local; the loop agrees across ranks)."""
    over_budget: Callable[[], str | None] = lambda: None
    """Why the run's GPU-hour or cost budget is spent, or None (local; the loop agrees across ranks)."""


def train_loop(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[StepBatch],
    plan: LoopPlan,
    counters: Counters,
    hooks: Hooks,
) -> StopReason:
    """Train from `counters.step` to `plan.total_steps`, advancing `counters`; returns why it stopped."""
    params = [p for p in model.parameters() if p.requires_grad]
    objective = plan.objective
    world = accelerator.num_processes
    device = accelerator.device
    last_save = time.monotonic()
    data: Iterator[StepBatch] = iter(batches)
    model.train()

    while counters.step < plan.total_steps:
        step = counters.step
        t_start = time.monotonic()
        batch = next(data)  # prefetched by a DataLoader worker; time blocked here is data stall
        stall = time.monotonic() - t_start
        assert batch.step == step, f"data order broke: got the batch of step {batch.step} at step {step}"
        lr = plan.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr

        # N over every micro-batch and rank, known before the first backward.
        counts = accelerator.reduce(batch.counts.to(device), reduction="sum")
        units = objective.normaliser(counts).clamp(min=1)
        denom = units.to(torch.float32) / world
        loss_sum = torch.zeros((), device=device)
        stats = torch.zeros(len(objective.stats), device=device, dtype=torch.float64)
        last = len(batch.micro) - 1
        for micro_step, micro in enumerate(batch.micro):
            micro = to_device(micro, device)
            # Own accumulation: skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on all
            # but the last micro-batch.
            sync = contextlib.nullcontext() if micro_step == last else distributed.no_sync(accelerator, model)
            with sync, _out_of_memory_at(step, micro_step, batch):
                loss, micro_stats = objective.loss(model, micro, counts)
                accelerator.backward(loss / denom)
            loss_sum += loss.detach()
            stats += micro_stats

        reduced = accelerator.reduce(torch.cat([loss_sum.double()[None], stats]), reduction="sum")
        global_loss = reduced[0].to(loss_sum.dtype) / units
        grad_norm = distributed.clip_grad_norm_(accelerator, params, plan.max_grad_norm or math.inf)
        # The one host sync per step (one small transfer): a non-finite loss or gradient is
        # never applied, and the same read brings the step's token counts for the meter.
        loss_value, norm_value, *rest = torch.cat(
            [global_loss.double()[None], grad_norm.double()[None], counts.double(), reduced[1:]]
        ).tolist()
        step_counts = Counts(*(int(n) for n in rest[: len(Counts._fields)]))
        extras = objective.report(rest[len(Counts._fields) :], step_counts)
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            with _out_of_memory_at(step, None, batch):  # the first step allocates AdamW's state
                optimizer.step()
            counters.consecutive_bad_steps = 0
        else:
            _skip_step(accelerator)
            counters.skipped_steps += 1
            if not _scaler_calibrating(accelerator, loss_value):
                counters.consecutive_bad_steps += 1
            hooks.message(
                f"step {step}: non-finite loss ({loss_value:.4g}) or gradient norm ({norm_value:.4g}): step skipped, "
                f"{counters.consecutive_bad_steps} in a row (stops at train.max_bad_steps={plan.max_bad_steps})"
            )
        optimizer.zero_grad(set_to_none=True)
        counters.step += 1
        counters.tokens += step_counts.trainable
        counters.real_tokens += step_counts.real
        hooks.on_step(
            StepRecord(
                counters=dataclasses.replace(counters),
                loss=loss_value,
                lr=lr,
                grad_norm=norm_value,
                applied=finite,
                seconds=time.monotonic() - t_start,
                stall_seconds=stall,
                trainable_tokens=step_counts.trainable,
                real_tokens=step_counts.real,
                doc_len_sq=step_counts.doc_len_sq,
                extras=extras,
            )
        )

        if counters.consecutive_bad_steps >= plan.max_bad_steps:
            hooks.message(
                f"stopping: {counters.consecutive_bad_steps} optimizer steps in a row had a non-finite loss or gradient "
                f"(train.max_bad_steps={plan.max_bad_steps}); lower train.lr, check the data, or use "
                "train.mixed_precision=bf16 instead of fp16. The weights are those of the last good step."
            )
            return "bad_steps"

        if hooks.evaluate is not None and plan.eval_every and counters.step % plan.eval_every == 0:
            hooks.evaluate()
            model.train()

        # Every rank must take the same branch: each decision is reduced over ranks.
        time_due = save_time_due(time.monotonic() - last_save, plan.save_every_minutes)
        budget_note = hooks.over_budget()
        preempted, over_budget, time_due = agree_all(
            [hooks.stop_requested(), budget_note is not None, time_due], accelerator
        )
        step_due = save_step_due(counters.step, plan.save_every_steps, plan.total_steps)  # or the last step
        if preempted or over_budget or time_due or step_due:
            hooks.save(counters)
            last_save = time.monotonic()
        if preempted:
            return "preempted"
        if over_budget:
            hooks.message(
                f"stopping at step {counters.step}: {budget_note or 'the budget is spent on another rank'}; "
                "a checkpoint was saved, raise the limit and rerun to continue"
            )
            return "budget"
    return "finished"


# ---------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _out_of_memory_at(step: int, micro_step: int | None, batch: StepBatch) -> Iterator[None]:
    """Name where the device ran out of memory (step, micro-batch, its shape): the one fact
    the user needs to pick what to change, and one the bare CUDA error does not carry."""
    try:
        yield
    except OOM_ERRORS as e:
        rows, seq_len = batch.micro[0]["input_ids"].shape if batch.micro else (0, 0)
        raise OutOfMemory(step, micro_step, len(batch.micro), int(rows), int(seq_len)) from e


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


# ---------------------------------------------------------------------------- evaluation


def make_evaluator(
    rows: PackedRows,
    model: torch.nn.Module,
    accelerator: Any,
    micro_batch_size: int,
    report: Callable[[float, float, dict[str, float]], None] | None = None,
    objective: Objective | None = None,
) -> Callable[[], float] | None:
    """The objective's mean loss over the held-out `rows`, weighted as a step's (collective: every rank
    runs its share); `report(loss, seconds, extras)` is told each result, how long it took and the
    objective's own figures (a preference objective's rewards)."""
    if len(rows) == 0:
        return None
    objective = objective or Sft()
    counts = eval_counts(rows)  # the whole held-out set's units: the same on every rank

    def evaluate() -> float:
        started = time.monotonic()
        model.eval()
        on_device = counts.to(accelerator.device)
        total = torch.zeros(1 + len(objective.stats), device=accelerator.device, dtype=torch.float64)
        with torch.no_grad():
            for micro in eval_micro_batches(
                rows, accelerator.process_index, accelerator.num_processes, micro_batch_size
            ):
                micro = to_device(micro, accelerator.device)
                loss, stats = objective.loss(model, micro, on_device)
                total += torch.cat([loss.double()[None], stats])
        total = accelerator.reduce(total, reduction="sum").tolist()
        loss = total[0] / max(1.0, float(objective.normaliser(counts)))
        if report is not None:
            report(loss, time.monotonic() - started, objective.report(total[1:], Counts(*counts.tolist())))
        return loss

    return evaluate
