"""The run's voice on stderr: a tqdm bar on a terminal, one plain line per log step elsewhere.

A scheduler's log file gets lines a person and `grep` can read (trainer/progress.py says why):

    spotune: step 20/200 loss 2.3456 | 1,234 tok/s, 0.55 step/s | MFU 41.2% | ETA 0:05:46 | $0.42 so far, $3.10 projected
    spotune: eval at step 20: eval_loss 2.4012 (3.1 s)
    spotune: step 30/200 loss 2.3012 eval_loss 2.4012 | 1,236 tok/s | ...

and the events the bar shows (checkpoint saved, resumed from step N, preempted) as `spotune: ...`
lines in both modes. tok/s and step/s are the metrics row's, over one window: the steps since the previous row and their
step time (saves and evaluations apart, as the meter defines it). The ETA is the attempt's own pace,
saves and evaluations included, counting only the steps this attempt ran, from its first step: a
resumed attempt's first line is as right as any other (its earlier steps took no time here).
Only the main rank speaks.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from trainer import progress


class Console:
    """A progress bar (`bar=True` and stderr a terminal) or progress lines, plus messages."""

    def __init__(
        self,
        total_steps: int,
        *,
        bar: bool,
        is_main: bool = True,
        stream: IO[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_steps
        self._stream = stream
        self._speak = is_main  # other ranks stay silent: one voice per run
        self._want_bar = bar and is_main and progress.is_terminal(stream)
        self._bar: Any = None
        self._clock = clock
        self._first_step: int | None = None
        self._started = 0.0
        self._eval: float | None = None
        self._row: dict[str, Any] = {}

    @property
    def lines(self) -> bool:
        """Progress goes out as lines (no terminal, or `metrics.progress: false`)."""
        return not self._want_bar

    def start(self, step: int) -> None:
        """This attempt's first step (index `step`) is about to run: the rate's clock starts here,
        and the bar starts at `step` (tqdm leaves its `initial` out of the rate)."""
        self._first_step, self._started = step, self._clock()
        if self._want_bar and self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total, initial=step, unit="step", dynamic_ncols=True, file=self._stream or sys.stderr
            )

    def step(self, step: int, row: dict[str, Any] | None = None) -> None:
        """Step `step` (1-based count of steps done) finished; `row`: its metrics row, on log steps."""
        if self._bar is not None:
            self._bar.update(1)
            if row is not None:
                self._row = row
                self._bar.set_postfix(self._postfix(row), refresh=False)
        elif row is not None and self._speak:
            self._write(self.step_line(step, row))

    def evaluated(self, step: int, loss: float | None, seconds: float) -> None:
        self._eval = loss
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(self._row), refresh=True)
        else:
            self.message(f"spotune: eval at step {step}: eval_loss {_fmt(loss)} ({seconds:.1f} s)")

    def rate(self, step: int) -> float | None:
        """Steps per second over the steps this attempt ran (None before its first step ends)."""
        if self._first_step is None or step <= self._first_step:
            return None
        elapsed = self._clock() - self._started
        return (step - self._first_step) / elapsed if elapsed > 0 else None

    def step_line(self, step: int, row: dict[str, Any]) -> str:
        evaluated = f" eval_loss {_fmt(self._eval)}" if self._eval is not None else ""  # the latest measured
        parts = [f"spotune: step {step}/{self.total} loss {_fmt(row.get('loss'))}{evaluated}"]
        if row.get("rewards/accuracies") is not None:  # a preference objective's own figures
            parts.append(f"reward acc {row['rewards/accuracies']:.2f} margin {row['rewards/margins']:.4g}")
        elif row.get("kl") is not None:  # KTO's: its reference point, and the margin where both labels came
            margin = f" margin {row['rewards/margins']:.4g}" if row.get("rewards/margins") is not None else ""
            parts.append(f"kl {row['kl']:.4g}{margin}")
        # tok/s and step/s over one window, the row's (the steps since the previous row, their step time).
        speed = [f"{row['tokens_per_s']:,.0f} tok/s"] if row.get("tokens_per_s") is not None else []
        if row.get("step_time_s"):
            speed.append(f"{1.0 / row['step_time_s']:.3g} step/s")
        if speed:
            parts.append(", ".join(speed))
        if row.get("mfu") is not None:
            parts.append(f"MFU {100 * row['mfu']:.1f}%")
        rate = self.rate(step)
        if rate:  # the attempt's own pace, saves and evaluations included: when the run will end
            parts.append(f"ETA {datetime.timedelta(seconds=round((self.total - step) / rate))}")
        if row.get("cost") is not None:
            projected = row.get("projected_cost")
            parts.append(f"${row['cost']:.2f} so far" + (f", ${projected:.2f} projected" if projected else ""))
        return " | ".join(parts)

    def message(self, text: str) -> None:
        if not self._speak:
            return
        if self._bar is not None:
            self._bar.write(text, file=self._stream or sys.stderr)
        else:
            self._write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _write(self, text: str) -> None:
        print(text, file=self._stream or sys.stderr, flush=True)  # stderr read late: pytest swaps it

    def _postfix(self, row: dict[str, Any]) -> dict[str, str]:
        post = {"loss": _fmt(row.get("loss"))}
        if self._eval is not None:
            post["eval"] = _fmt(self._eval)
        if row.get("tokens_per_s") is not None:
            post["tok/s"] = f"{row['tokens_per_s']:.0f}"
        if row.get("cost") is not None:
            projected = row.get("projected_cost")
            post["$"] = f"{row['cost']:.2f}" + (f"/{projected:.2f}" if projected is not None else "")
        return post


def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)
