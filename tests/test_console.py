"""The console off a terminal (a scheduler's log file): one plain line per log step, the eval
loss, the events; rate and ETA right from a resumed attempt's first step; model downloads as
progress lines on the hub's own tqdm class."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer import builtin_assets, progress
from trainer.cli.main import main as spotune
from trainer.exit_codes import EXIT_PREEMPTED
from trainer.training.console import Console

REPO = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(
    r"^spotune: step (\d+)/(\d+) loss (\d+\.\d{4})(?: eval_loss \d+\.\d{4})? \| ([\d,]+) tok/s, ([\d.e+-]+) step/s \| ETA (\d+:\d\d:\d\d)$"
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_resumed_rate_and_eta_count_only_this_attempts_steps() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(100, bar=True, stream=out, clock=clock)  # a StringIO is no terminal: lines
    assert console.lines
    console.start(50)  # resumed at step 50
    clock.now = 4.0
    console.step(51)  # not a log step: no line
    clock.now = 8.0
    row = {"loss": 1.5, "tokens_per_s": 1234.4, "step_time_s": 0.4, "mfu": 0.4123, "cost": 0.4, "projected_cost": 1.25}
    console.step(52, row)
    # tok/s and step/s over the row's window (its steps took 0.4 s each: 2.5 step/s, not the attempt's
    # 0.25, which counts the saves between); the ETA at the attempt's pace: 2 steps in 8 s, 48 left: 192 s.
    assert out.getvalue().splitlines() == [
        "spotune: step 52/100 loss 1.5000 | 1,234 tok/s, 2.5 step/s | MFU 41.2% | ETA 0:03:12 | "
        "$0.40 so far, $1.25 projected"
    ]
    # Control: counting the 50 resumed steps (no time spent here) is the skew this avoids.
    skewed = Console(100, bar=False, stream=io.StringIO(), clock=clock)
    clock.now = 0.0
    skewed.start(0)
    clock.now = 8.0
    assert skewed.rate(52) == 6.5 != console.rate(52) == 0.25


def test_eval_and_messages_are_lines_and_other_ranks_are_silent() -> None:
    out, clock = io.StringIO(), Clock()
    console = Console(10, bar=False, stream=out, clock=clock)
    console.start(0)
    console.evaluated(5, 2.25, 1.5)
    console.message("spotune: checkpoint saved at step 5 (0.1 s)")
    console.step(6, {"loss": 2.0})  # the step lines after an eval carry the latest eval loss
    assert out.getvalue().splitlines() == [
        "spotune: eval at step 5: eval_loss 2.2500 (1.5 s)",
        "spotune: checkpoint saved at step 5 (0.1 s)",
        "spotune: step 6/10 loss 2.0000 eval_loss 2.2500",  # no time passed: no rate, no ETA
    ]
    quiet = io.StringIO()
    other = Console(10, bar=False, is_main=False, stream=quiet)
    other.start(0)
    other.step(1, {"loss": 1.0})
    other.evaluated(1, 1.0, 0.1)
    other.message("x")
    assert quiet.getvalue() == ""


def test_download_progress_is_lines_on_the_hubs_tqdm() -> None:
    """The class `from_pretrained(tqdm_class=...)` hands to huggingface_hub: off a terminal, whole
    lines (no carriage returns), at most one per `LINE_SECONDS` plus the last."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    out = io.StringIO()
    bar_class = progress.hub_download_bar(out)
    assert issubclass(bar_class, hub_tqdm)
    bar = bar_class(
        total=3 * 2**30, unit="B", unit_scale=True, desc="model.safetensors", name="huggingface_hub.http_get"
    )
    for _ in range(3):
        bar.update(2**30)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and lines, out.getvalue()
    assert re.fullmatch(r"model\.safetensors: 100% 3\.\d+G/3\.\d+G at .+B/s, ETA .+", lines[-1]), lines
    assert len(lines) <= 3  # the first draw, maybe one more, the last: not one per update

    # The hub's switch still silences it (HF_HUB_DISABLE_PROGRESS_BARS / disable_progress_bars).
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    disable_progress_bars("huggingface_hub.http_get")
    try:
        out.truncate(0)
        bar = bar_class(total=10, desc="x", name="huggingface_hub.http_get")
        bar.update(10)
        bar.close()
        assert out.getvalue().strip("\x00") == ""
    finally:
        enable_progress_bars("huggingface_hub.http_get")


def test_hub_download_bar_on_a_terminal_is_the_hubs_own() -> None:
    from huggingface_hub.utils import tqdm as hub_tqdm

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress.hub_download_bar(Tty()) is hub_tqdm


@pytest.mark.slow
def test_piped_run_prints_lines_events_and_a_sane_first_line_after_resume(
    tmp_path: Path, tiny_llama: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=24)
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(out),
                "seed": 5,
                "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
                "adapter": {"r": 4, "alpha": 8},
                "data": {"path": str(data), "seq_len": 128, "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.2},
                "train": {"max_steps": 10, "micro_batch_size": 2, "grad_accum": 1, "lr": 1e-2, "eval_every": 2},
                "checkpoint": {"every_steps": 2, "every_minutes": None},
                # progress: true, but a pipe is no terminal; no report (no console line of its own)
                "metrics": {"log_every": 1, "report": False},
            }
        )
    )
    cmd = [sys.executable, "-m", "trainer", "train", str(recipe)]

    # Attempt 1: SIGTERM once a few steps are logged (a preemption).
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    first: list[str] = []
    for line in p.stdout:
        first.append(line.rstrip("\n"))
        if line.startswith("spotune: step 3/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=300) == EXIT_PREEMPTED, "\n".join(first)
    steps = [STEP_LINE.match(line) for line in first if line.startswith("spotune: step ")]
    assert steps and all(steps), "\n".join(first)
    assert any(re.fullmatch(r"spotune: eval at step 2: eval_loss \d+\.\d{4} \(\d+\.\d s\)", x) for x in first), first
    assert "spotune: checkpoint saved at step 2 (" in "\n".join(first)
    assert any("SIGTERM" in x and "saving a checkpoint" in x for x in first), first  # the stop request
    stopped = re.search(r"^spotune: preempted at step (\d+)/10$", "\n".join(first), re.M)
    assert stopped, first
    resume_step = int(stopped.group(1))
    assert not any("\r" in x for x in first)

    # Attempt 2, `spotune train` in this process (its stderr is capfd's file: no terminal either):
    # resumes; its first line's rate counts only its own step.
    capfd.readouterr()
    started = time.monotonic()
    code = spotune(["train", str(recipe)])
    wall = time.monotonic() - started
    said = capfd.readouterr()
    assert code == 0, said.out + said.err
    lines = said.err.splitlines()
    assert any(x.startswith("spotune: resuming from ") and x.endswith(f"at step {resume_step} of 10") for x in lines)
    line = next(m for m in map(STEP_LINE.match, lines) if m)
    assert int(line.group(1)) == resume_step + 1
    rate, eta = float(line.group(5)), line.group(6)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_time = next(r["step_time_s"] for r in rows if r.get("attempt") == 2 and r.get("step") == resume_step + 1)
    # step/s over the row's window: that step's own time, as its tok/s.
    assert rate == float(f"{1 / step_time:.3g}")
    # The ETA at this attempt's pace (its own step so far, not the resumed ones'): at least the steps
    # left at that step's time, at most the steps left at the whole attempt's wall time.
    h, m, s = map(int, eta.split(":"))
    left = 10 - resume_step - 1
    assert left * step_time - 1 <= h * 3600 + m * 60 + s <= left * wall + 1


def test_model_loading_keeps_download_bars_and_hides_transformers_bars() -> None:
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as hf_logging

    from trainer.model.load import quiet_hf_progress

    before = (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled("huggingface_hub.http_get"))
    with quiet_hf_progress(downloads=True):
        assert not hf_logging.is_progress_bar_enabled()  # "Loading weights": noise in a run's log
        assert not are_progress_bars_disabled("huggingface_hub.http_get")
        assert not are_progress_bars_disabled("huggingface_hub.snapshot_download")
    with quiet_hf_progress():  # control: without `downloads`, the hub's bars go too (export, the demo)
        assert are_progress_bars_disabled("huggingface_hub.http_get")
    assert (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled("huggingface_hub.http_get")) == before


def test_on_a_terminal_the_bar_starts_at_the_resumed_step() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    console = Console(100, bar=True, stream=tty)
    assert not console.lines
    console.start(50)
    console.step(51, {"loss": 1.25, "tokens_per_s": 10.0})
    console.evaluated(51, 1.5, 0.2)
    console.close()
    last = tty.getvalue().split("\r")[-1]
    assert "51/100" in last and "loss=1.2500" in last and "eval=1.5000" in last, last
    assert "spotune: step" not in tty.getvalue()  # the bar, not lines


def test_datasets_bars_follow_the_switch_for_the_call_and_are_restored() -> None:
    """`prepare` shows datasets' bars when asked, the estimate's sample never: the global switch is set for
    the call and put back as it was (whichever it was), even when the call raises."""
    import datasets

    from trainer.progress import datasets_bars

    logging_ = datasets.utils.logging
    was = logging_.is_progress_bar_enabled()
    try:
        for before, inside in ((True, False), (False, True), (True, True), (False, False)):
            (logging_.enable_progress_bar if before else logging_.disable_progress_bar)()
            with pytest.raises(KeyError), datasets_bars(inside):
                assert logging_.is_progress_bar_enabled() is inside
                raise KeyError("interrupted")
            assert logging_.is_progress_bar_enabled() is before
    finally:
        (logging_.enable_progress_bar if was else logging_.disable_progress_bar)()
