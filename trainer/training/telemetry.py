"""Everything a run reports, fed from the loop's per-step record: meter, metrics sinks, console,
ledger and the budget guard. The loop knows none of them; it hands a `StepRecord` to
`Telemetry.on_step` and asks `Telemetry.over_budget`.

Every rank holds a Telemetry (the meter's clock and the budget decision are per rank and then
agreed on by the loop); only the main rank writes rows, trackers and the ledger.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.restart.books.ledger import Ledger
from trainer.training.console import Console
from trainer.training.loop import StepRecord
from trainer.training.metrics import Meter

MACHINE = socket.gethostname()
"""The host name every metrics row carries."""


@dataclass(frozen=True)
class Budget:
    """`train.max_gpu_hours` / `train.max_cost`: stop (after a checkpoint) once either is spent."""

    max_gpu_hours: float | None = None
    max_cost: float | None = None

    def spent(self, device_seconds: float, cost: float | None) -> str | None:
        """Why the budget is spent, or None."""
        if self.max_gpu_hours is not None and device_seconds / 3600.0 >= self.max_gpu_hours:
            return f"budget reached (train.max_gpu_hours={self.max_gpu_hours})"
        if self.max_cost is not None and cost is not None and cost >= self.max_cost:
            return f"budget reached (train.max_cost={self.max_cost})"
        return None


class Telemetry:
    """The loop's `on_step` and `over_budget` hooks, and the time-outs for saves and evaluations."""

    def __init__(
        self,
        meter: Meter,
        console: Console,
        ledger: Ledger,
        sink: JsonlSink | None,
        *,
        log_every: int,
        total_steps: int,
        budget: Budget,
        epoch_of: Callable[[int], float],
        digest_of: Callable[[int], str],
        tracker_log: Callable[[dict[str, Any], int], None] | None = None,
        row_extras: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.meter, self.console, self.ledger, self.sink = meter, console, ledger, sink
        self.log_every, self.total_steps, self.budget = log_every, total_steps, budget
        self.epoch_of, self.digest_of = epoch_of, digest_of
        self.tracker_log = tracker_log
        self.row_extras = row_extras
        """Fields merged into every metrics row written (the uploads' figures: trainer/restart/remote/run.py)."""
        self.last: StepRecord | None = None
        self.compiling: Callable[[dict[str, float]], None] | None = None
        """`model.compile`: puts this attempt's compile seconds into the ledger's phases (trainer/model/compile_cache.py)."""

    def on_step(self, record: StepRecord) -> None:
        """Account one finished optimizer step; write a metrics row every `log_every` steps."""
        self.last = record
        self.ledger.add_productive(record.seconds)
        if self.compiling is not None:  # the first steps compile; a new shape may compile again later
            self.compiling(self.ledger.phases)
        # Logits are computed only where a label is (trainer/model/loss.py), so the head's FLOPs
        # count the trainable tokens, not every real one.
        self.meter.step(
            record.counters.step - 1,
            record.seconds,
            record.stall_seconds,
            record.real_tokens,
            record.doc_len_sq,
            head_tokens=record.trainable_tokens,
        )
        step = record.counters.step
        if step % self.log_every == 0 or step == self.total_steps or not record.applied:
            row = self.meter.row(  # adds rates, MFU, memory, cost
                step=step,
                epoch=self.epoch_of(step),
                loss=record.loss,
                lr=record.lr,
                grad_norm=record.grad_norm,
                skipped_steps=record.counters.skipped_steps,
                trainable_tokens=record.counters.tokens,
                real_tokens=record.counters.real_tokens,
                # Which rows this step trained on: comparable across runs of any world size.
                sample_digest=self.digest_of(step - 1),
                **record.extras,  # the objective's own: a preference objective's rewards and log-probs
            )
            self.write(row)
            self.console.step(step, row)
        else:
            self.console.step(step)

    def write(self, row: dict[str, Any]) -> None:
        """One metrics row to every sink (main rank) and the ledger's heartbeat (every rank)."""
        self.ledger.heartbeat(row.get("step"))
        if self.sink is not None:
            # `attempt`: which process wrote the row (the ledger's attempt number), for the report.
            # `machine`: where it ran (attempts of a spot run move between machines).
            row = {**row, "attempt": self.ledger.attempt, "machine": MACHINE, **self.row_extras()}
            self.sink.write(row)
            if self.tracker_log is not None:  # trackers add the machine (trainer/training/trackers.py)
                self.tracker_log(row, row["step"])

    def evaluated(self, step: int, loss: float | None, seconds: float, extras: dict[str, float] | None = None) -> None:
        """An evaluation's row (with the objective's figures as `eval_<name>`); its time is not training time."""
        shown = {f"eval_{k}": v for k, v in (extras or {}).items()}
        self.write({"step": step, "eval_loss": loss, "eval_seconds": seconds, **shown})
        self.console.evaluated(step, loss, seconds)
        self.meter.pause(seconds)

    def saved(self, step: int, seconds: float) -> None:
        """A checkpoint's time: not training time, counted in the ledger as checkpoint time."""
        self.meter.pause(seconds)
        self.ledger.add_checkpoint(seconds)
        self.ledger.checkpointed()
        self.ledger.heartbeat(step)
        self.console.message(f"spotune: checkpoint saved at step {step} ({seconds:.1f} s)")

    def over_budget(self) -> str | None:
        return self.budget.spent(self.meter.device_seconds(), self.meter.cost())

    @property
    def final_loss(self) -> float | None:
        return self.last.loss if self.last is not None else None

    def final_summary(
        self,
        reason: str,
        steps: int,
        summary: dict[str, Any],
        out: Path,
        stopped_by: str | None = None,
        planned: bool = False,
        reported: bool = True,
    ) -> str:
        """The run's last words for a person: status, loss, speed, money and where to look next.
        `stopped_by`: what asked a preempted run to stop (a signal, a notice, a planned stop); `planned`:
        the stop planned in advance (`Preemption.planned`, the pilot's), said as such, not as a preemption;
        `reported`: whether this attempt wrote the report (`metrics.report`)."""
        from trainer.report.totals import hours_unit
        from trainer.restart.books.ledger import read_rows

        def num(value: float | None, fmt: str, missing: str = "n/a") -> str:
            return missing if value is None else format(value, fmt)

        step = self.last.counters.step if self.last is not None else None
        cost = summary["cost"]
        said = "stopped as planned" if planned and reason == "preempted" else reason
        unit = hours_unit([row.get("device") for row in read_rows(out)] or [self.ledger.device])
        lines = [
            f"spotune: {said}" + (f" at step {step}/{steps}" if step is not None else f" ({steps} steps)"),
            f"  {'final' if reason == 'finished' else 'last'} loss {num(self.final_loss, '.4f')}; "
            f"sustained {num(summary['sustained_tokens_per_s'], ',.0f')} tokens/s; "
            f"{summary['device_hours']:.4f} {unit} (devices x wall time, all attempts); "
            f"cost {'n/a (set metrics.price_per_hour)' if cost is None else f'${cost:.4f}'}",
        ]
        if reason == "preempted":
            by = f"stopped by {stopped_by}; " if stopped_by else ""
            lines.append(f"  {by}a checkpoint is saved: the same command resumes from it")
        from trainer.model.load import compile_seconds

        if compiled := compile_seconds():  # model.compile: what the first steps spent compiling
            lines.append(f"  torch.compile: {compiled:.1f} s compiling in the first steps (the ledger's compile phase)")
        if (out / "final").is_dir():
            lines.append(f"  adapter: {out / 'final'}")
        if not reported:  # a page left by an earlier attempt would not show this one
            lines.append(f"  report:  not written (metrics.report=false); `spotune report {out}` writes it")
        elif (out / "report.html").is_file():
            lines.append(f"  report:  {out / 'report.html'}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- sinks


class JsonlSink:
    """Appends one JSON object per line and flushes, so a killed run keeps every row it logged."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(_finite(row)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: write a non-finite float as its string ("nan", "inf")."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def flat_config(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as the flat `a.b: scalar` mapping experiment trackers take."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
