"""The books match what happened, and `spotune status` says it: steps trained again are counted from
the checkpoint resumed and the step reached (killed at 25, resumed from 20: 5, whatever
`metrics.log_every`), said at resume and in the report; a finished run run again says so and opens no
attempt (no ledger row, no device-hours); a CPU run is booked in device-hours; `spotune status` reads a
live, a killed and a finished run in a directory, and a run in an S3 store (moto), and exits 2 for a
directory or URL that holds no run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import warm_start
import yaml

from trainer import builtin_assets
from trainer.cli.main import main as spotune
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_FINISHED
from trainer.report.load import Attempt, RunData, load_run
from trainer.report.page import render, summary_text
from trainer.report.status import format_status, run_status
from trainer.report.totals import hours_unit, redone_by_attempt, resume_line, totals
from trainer.restart.books.ledger import HEARTBEAT_FILE, LEDGER_FILE, Ledger

REPO = Path(__file__).resolve().parents[1]
KILL_STEP, SAVED_STEP = 25, 20


def _attempt(n: int, reason: str, last: int | None, resumed: int | None, device: str | None = "cpu") -> Attempt:
    return Attempt(
        n, 1000.0 * n, 1000.0 * n + 500, 1, reason, 500.0, 10.0, 400.0, 5.0, 0.0, None, last, device, resumed
    )


def _rows(attempt: int, steps: range) -> list[dict[str, Any]]:
    return [{"step": s, "loss": 1.0, "attempt": attempt} for s in steps]


def test_redone_steps_are_counted_from_the_checkpoint_resumed_and_the_step_reached() -> None:
    """log_every 5: the killed attempt logged up to 25, the resumed one logs 25 again. Counting logged
    steps said 1 (the former rule); the steps trained again are 21-25."""
    killed, resumed = _attempt(1, "killed", 25, 0), _attempt(2, "finished", 80, 20)
    run = RunData("run", None, _rows(1, range(5, 26, 5)) + _rows(2, range(25, 81, 5)), [], [killed, resumed])
    assert redone_by_attempt(run) == {2: 5} and totals(run).redone_steps == 5
    assert (
        resume_line([killed], 20)
        == "attempt 1 killed at step 25; resuming from step 20: steps 21-25 are trained again (5 redone)"
    )
    # A preempted attempt saved where it stopped: nothing is trained again.
    assert resume_line([_attempt(1, "preempted", 40, 0)], 40) is None
    assert resume_line([_attempt(1, "error", 40, 0)], 40) == "attempt 1 error at step 40; resuming from step 40"
    # Killed again before reaching the earlier attempt's step: it redid only what it reached.
    again = [killed, _attempt(2, "killed", 22, 20), _attempt(3, "finished", 80, 20)]
    assert redone_by_attempt(RunData("run", None, [], [], again)) == {2: 2, 3: 5}
    # Rows from before `resumed_from` was booked keep the logged count (control: the former rule's 1).
    legacy = RunData(
        "run", None, run.train_rows, [], [_attempt(1, "killed", 25, None), _attempt(2, "finished", 80, None)]
    )
    assert redone_by_attempt(legacy) == {2: 1}
    assert hours_unit(["cpu", "cpu"]) == "device-hours" and hours_unit(["NVIDIA H100 80GB HBM3"]) == "GPU-hours"
    # An attempt whose device was never recorded (killed before it knew) does not decide; none recorded does.
    assert hours_unit(["NVIDIA H100 80GB HBM3", None]) == "GPU-hours" and hours_unit([None]) == "device-hours"
    assert hours_unit(["NVIDIA H100 80GB HBM3", None, "cpu"]) == "device-hours"


def _recipe(tmp: Path, tiny_llama: Path, **extra: Any) -> Path:
    data = builtin_assets.write_dataset(tmp / "train.jsonl", n=40)
    raw = {
        "output_dir": str(tmp / "run"),
        "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"path": str(data), "seq_len": 64, "cache_dir": str(tmp / "cache")},
        "train": {"max_steps": KILL_STEP, "micro_batch_size": 2, "lr": 1e-2},
        "checkpoint": {"every_steps": SAVED_STEP, "every_minutes": None},
        "metrics": {"progress": False, "report": False, "log_every": 5, "warmup_steps": 1},
        **extra,
    }
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def _until(found: Any, what: str, proc: warm_start.Started, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _in_process(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = spotune(list(argv))
    return code, out.getvalue()


def test_kill_resume_and_run_again_are_booked_as_they_happened(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = _recipe(tmp_path, tiny_llama)
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # Attempt 1, its own process: each save pauses halfway (test hook). Seen live inside the save at
    # step 20, then SIGKILLed inside the last save (step 25, logged): checkpoint 20 is the newest.
    env = {**os.environ, "SPOTUNE_TEST_SAVE_PAUSE": "3"}
    p = warm_start.start(["train", str(recipe)], tmp_path / "attempt1.log", env=env, new_session=False)
    try:
        _until(lambda: any(ckpts.glob(f"step-{SAVED_STEP:06d}.tmp-*")), "the save at step 20", p)
        live = run_status(str(out))
        assert (live.state, live.step, live.total_steps) == ("training", SAVED_STEP, KILL_STEP)
        assert live.held_by is not None and f"lock held by pid {p.pid}" in live.held_by
        assert format_status(live).startswith(f"{out}: training on {live.machine}: step 20 of 25, last heartbeat ")
        _until(lambda: any(ckpts.glob(f"step-{KILL_STEP:06d}.tmp-*")), "the save at step 25", p)
    finally:
        p.kill()
        p.wait()
    killed = run_status(str(out))
    assert (killed.state, killed.how, killed.step, killed.held_by) == ("stopped", "killed", KILL_STEP, None)
    assert killed.checkpoint is not None and killed.checkpoint["step"] == SAVED_STEP
    assert "stopped: killed at step 25 of 25, last heartbeat" in format_status(killed)
    # The attempt that was killed is stopped, never "running", and its booked end is a lower bound.
    assert killed.attempts[0]["exit_reason"] == "killed" and killed.attempts[0]["end_is_last_heartbeat"]
    assert "attempts: 1 (1 killed at step 25 (booked to its last heartbeat: a lower bound))" in format_status(killed)
    assert "running" not in format_status(killed)

    # Attempt 2, the same command: it books attempt 1 from its heartbeat and says what it redoes.
    code, said = _in_process("train", str(recipe))
    assert code == EXIT_FINISHED, said
    # The redone steps' cost is said as the run resumes: the step time attempt 1 trained after its checkpoint.
    redone = re.search(
        r"spotune: attempt 1 killed at step 25; resuming from step 20: steps 21-25 are trained again "
        r"\(5 redone: ([0-9.]+) device-seconds of attempt 1's step time\)",
        said,
    )
    assert redone is not None, said
    assert "device-hours (devices x wall time, all attempts)" in said and "GPU-hours" not in said
    rows = [json.loads(line) for line in (out / LEDGER_FILE).read_text().splitlines()]
    assert float(redone.group(1)) == round(rows[0]["lost_seconds"], 1) > 0
    # One set of books: the closing line's device-hours are the ledger's rows, as `status` and the report say.
    closing = re.search(r"([0-9.]+) device-hours \(devices x wall time, all attempts\)", said)
    assert closing is not None and closing.group(1) == f"{sum(r['device_seconds'] for r in rows) / 3600:.4f}"
    assert f"{run_status(str(out)).device_hours:.4f} device-hours" in format_status(run_status(str(out)))
    assert closing.group(1) == f"{run_status(str(out)).device_hours:.4f}"
    assert [(r["exit_reason"], r["last_step"], r.get("resumed_from")) for r in rows] == [
        ("killed", KILL_STEP, 0),
        ("finished", KILL_STEP, SAVED_STEP),
    ]
    # The report's summary and page (its text: write_report adds only the PNGs, tests/test_report.py).
    summary, page = summary_text(totals(load_run(str(out)))), render(load_run(str(out)), {})
    assert "2 restart(s)" not in summary and "1 restart(s)" in summary and "5 steps redone" in summary
    assert "device-hours" in summary and "GPU-hours" not in page

    # Attempt 3 would be a finished run run again: it says so, exits 0 and books nothing.
    before = {name: (out / name).read_bytes() for name in (LEDGER_FILE, "metrics.jsonl")}
    code, said = _in_process("train", str(recipe))
    assert code == EXIT_FINISHED
    assert f"spotune: {out} finished already: step 25 of 25 is trained and final/ written" in said
    assert "final loss n/a" not in said and "sustained n/a" not in said
    assert {name: (out / name).read_bytes() for name in before} == before and not (out / HEARTBEAT_FILE).exists()
    # An attempt killed after the run finished (its heartbeat left behind): the run run again books it
    # before it says the run finished (no attempt of its own, no finished row it would pay for).
    Ledger.open(out, 1)  # opens attempt 3's heartbeat; never closed, as after a SIGKILL
    code, said = _in_process("train", str(recipe))
    assert code == EXIT_FINISHED and "finished already" in said
    rows = [json.loads(line) for line in (out / LEDGER_FILE).read_text().splitlines()]
    assert [r["exit_reason"] for r in rows] == ["killed", "finished", "killed"]
    # Control: a longer run is not finished; it trains on from its last checkpoint.
    code, said = _in_process("train", str(recipe), "train.max_steps=26")
    assert code == EXIT_FINISHED and "finished already" not in said and "resuming from" in said

    # `spotune status` on the finished run, readable and --json.
    code, text = _in_process("status", str(out))
    assert code == 0 and text.startswith(f"{out}: finished: step 26 of 26\n"), text
    assert f"newest checkpoint: step 26 ({ckpts / 'step-000026'})" in text
    lower = "(booked to its last heartbeat: a lower bound)"
    assert f"attempts: 4 (1 killed at step 25 {lower}, 2 finished at step 25, 3 killed {lower}, 4 finished" in text
    restarts = totals(load_run(str(out)))
    assert (
        f"steps trained again after restarts: 5; the restarts cost {restarts.restart_hours:.4f} device-hours "
        "(start-up + redone work, as the report counts it)" in text
    )
    code, doc_text = _in_process("status", str(out), "--json")
    doc = json.loads(doc_text)
    rows = [json.loads(line) for line in (out / LEDGER_FILE).read_text().splitlines()]
    assert doc["state"] == "finished" and doc["checkpoint"]["step"] == 26 and doc["hours_unit"] == "device-hours"
    assert doc["device_hours"] == sum(r["device_seconds"] for r in rows) / 3600
    assert [a["redone_steps"] for a in doc["attempts"]] == [0, 5, 0, 0]


def test_status_of_a_run_in_a_store_and_of_no_run(
    tmp_path: Path, tiny_llama: Path, s3_remote: str, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = _recipe(
        tmp_path,
        tiny_llama,
        checkpoint={"every_steps": 2, "every_minutes": None, "remote": s3_remote},
        train={"max_steps": 2, "micro_batch_size": 2},
    )
    assert spotune(["train", str(recipe)]) == EXIT_FINISHED
    capsys.readouterr()
    assert spotune(["status", s3_remote]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{s3_remote}: finished: step 2 of 2\n"), text
    assert (
        f"newest checkpoint: step 2 ({s3_remote}/checkpoints/step-000002)" in text and "attempts: 1 (1 finished" in text
    )
    assert spotune(["status", s3_remote, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "finished" and doc["attempts"][0]["exit_reason"] == "finished" and doc["held_by"] is None

    # Nothing there: exit 2, naming what was looked for (a URL, a directory that exists, one that does not).
    elsewhere = s3_remote.rsplit("/", 1)[0] + "/elsewhere"
    empty = tmp_path / "empty"
    empty.mkdir()
    for nothing in (elsewhere, str(empty), str(tmp_path / "missing")):
        assert spotune(["status", nothing]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert f"spotune: {nothing} holds no run: no config.yaml, metrics.jsonl, ledger.jsonl, checkpoint" in err
        assert "Traceback" not in err


def test_status_of_a_url_whose_store_is_down_says_unknown_and_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store does not answer: `spotune status URL` shows what it can (nothing but why) and points to the
    run directory's own view, instead of a traceback."""
    from moto_fixture import SECRET, free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "spotune-test-key")
    url = "s3://spotune-down/run"
    assert spotune(["status", url]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{url}: unknown: {url} could not be read (") and "output_dir" in text, text
    assert spotune(["status", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "unknown" and doc["lease_unknown"].startswith(f"{url} could not be read"), doc
