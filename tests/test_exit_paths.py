"""Every way a run ends, the process ends: at once, with its exit code and one message, and no
child process of it is left behind.

These run with one DataLoader worker, CUDA's setting (`data.loader_workers`): on an H100 a
failed run printed its traceback and then never exited, because `multiprocessing`'s exit
handler joined a worker that ignores SIGTERM (trainer/training/shutdown.py). Each failure is injected
into a real `spotune train` process by replacing one function before the CLI runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from trainer import exit_codes as E
from trainer.training import shutdown

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 20.0
"""How long after the failure the process may take to be gone (what a supervisor waiting on it may expect)."""

# Replaces `module.attr` with a function that raises on call number `after + 1`, writing the
# moment it raised to $FAILED_AT; `oom` raises what CUDA raises when an allocation fails.
INJECT = """
import importlib, os, sys, time
import torch
module_name, attr, after, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
module = importlib.import_module(module_name)
original = getattr(module, attr)
calls = [0]
def failing(*args, **kwargs):
    calls[0] += 1
    if calls[0] > after:
        open(os.environ["FAILED_AT"], "w").write(repr(time.time()))
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        raise RuntimeError(f"injected failure in {module_name}.{attr}")
    return original(*args, **kwargs)
setattr(module, attr, failing)
if os.environ.get("DISABLE_SHUTDOWN"):  # the control: the code before this fix
    import trainer.training.batches, trainer.training.shutdown
    trainer.training.batches.close_loader = lambda iterator: None
    trainer.training.shutdown.end_child_processes = lambda grace_seconds=2.0, keep=frozenset(): []
from trainer.cli.main import main
sys.exit(main(sys.argv[5:]))
"""


def _recipe(tmp_path: Path, model: Path, data: Path, **train: Any) -> Path:
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "seed": 3,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(tmp_path / "cache"), "loader_workers": 1},
        "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum": 2, "lr": 1e-3, **train},
        "checkpoint": {"every_steps": 2, "every_minutes": None},
        "metrics": {"progress": False, "log_every": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _session_processes(session: int) -> list[psutil.Process]:
    """Processes still alive in the test process's session (its workers would be there)."""
    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return alive


def _start(cmd: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    log = open(tmp_path / "train.log", "w")
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "FAILED_AT": str(tmp_path / "failed_at"), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own session: the children it leaves can be found and killed
    )


def _end(proc: subprocess.Popen) -> None:
    for child in _session_processes(proc.pid):
        child.kill()
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _inject(tmp_path: Path, recipe: Path, target: str, after: int, kind: str = "error", **env: str) -> subprocess.Popen:
    module, attr = target.rsplit(".", 1)
    cmd = [sys.executable, "-c", INJECT, module, attr, str(after), kind, "train", str(recipe)]
    return _start(cmd, tmp_path, **env)


def _wait_failed(proc: subprocess.Popen, tmp_path: Path) -> float:
    """The moment the injected failure raised (waits for it)."""
    marker = tmp_path / "failed_at"
    deadline = time.monotonic() + 240
    while not marker.exists() or not marker.read_text():
        assert proc.poll() is None or marker.exists(), (tmp_path / "train.log").read_text()
        assert time.monotonic() < deadline, "the injected failure never ran"
        time.sleep(0.05)
    return float(marker.read_text())


CONTROL = "test_control_without_the_shutdown_a_failed_run_never_exits"


@pytest.fixture(scope="module", autouse=True)
def hung_control(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_data: Path
) -> Iterator[tuple[subprocess.Popen, Path] | None]:
    """The control's run, started before this module's first test when the control is selected: it
    hangs (idle) while the other tests run, and the control, last, checks it is still there BOUND_S
    after its failure, instead of this worker sitting idle for BOUND_S."""
    if not any(item.name == CONTROL for item in request.session.items):
        yield None
        return
    tmp = tmp_path_factory.mktemp("control")
    proc = _inject(
        tmp, _recipe(tmp, tiny_llama, tiny_data), "trainer.model.objective.token_loss_sum", 3, DISABLE_SHUTDOWN="1"
    )
    try:
        yield proc, tmp
    finally:
        _end(proc)


@pytest.mark.parametrize(
    "target, after, code",
    [
        ("trainer.model.objective.token_loss_sum", 3, E.EXIT_ERROR),  # the forward of step 1
        # A failed save is reported as such (CheckpointError: disk full, permissions), without a traceback.
        pytest.param("trainer.restart.local.saving.write_training_state", 0, E.EXIT_BAD_INPUT, marks=pytest.mark.slow),
        # the report page after the last step
        pytest.param("trainer.report.report_after_train", 0, E.EXIT_ERROR, marks=pytest.mark.slow),
    ],
    ids=["forward", "save", "report"],
)
def test_an_exception_ends_the_process_with_workers_on(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, target: str, after: int, code: int
) -> None:
    proc = _inject(tmp_path, _recipe(tmp_path, tiny_llama, tiny_data), target, after)
    try:
        failed_at = _wait_failed(proc, tmp_path)
        exit_code = proc.wait(timeout=BOUND_S + 5)
        gone_after = time.time() - failed_at
        log = (tmp_path / "train.log").read_text()
        assert exit_code == code, log
        assert gone_after < BOUND_S, f"exited {gone_after:.1f} s after the failure"
        assert f"injected failure in {target}" in log
        assert _session_processes(proc.pid) == [], "a child of the run outlived it"
    finally:
        _end(proc)


def test_out_of_memory_says_where_and_what_to_change_and_exits_do_not_restart(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path
) -> None:
    proc = _inject(
        tmp_path, _recipe(tmp_path, tiny_llama, tiny_data), "trainer.model.objective.token_loss_sum", 5, "oom"
    )
    try:
        code = proc.wait(timeout=240)
        log = (tmp_path / "train.log").read_text()
        assert code == E.EXIT_OUT_OF_MEMORY, log
        # Call 6 is the second micro-batch of the third step (2 micro-batches a step).
        assert "out of memory at step 3, in micro-batch 2 of 2 (2 rows x 128 tokens per micro-batch)" in log
        assert "predicts a peak of" in log and "lower train.micro_batch_size (now 2" in log
        assert "model.gradient_checkpointing=true" in log and "adapter.method=qlora" in log
        assert "Traceback" not in log  # one message, not a stack
        assert _session_processes(proc.pid) == []
        ledger = [yaml.safe_load(line) for line in (tmp_path / "run" / "ledger.jsonl").read_text().splitlines()]
        assert ledger[-1]["exit_reason"] == "out_of_memory"
    finally:
        _end(proc)


def _wait_for_step(proc: subprocess.Popen, run: Path, tmp_path: Path) -> None:
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() or '"loss"' not in (run / "metrics.jsonl").read_text():
        assert proc.poll() is None, (tmp_path / "train.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    "signals, code", [([signal.SIGTERM], E.EXIT_PREEMPTED), ([signal.SIGINT, signal.SIGINT], E.EXIT_ABORTED)]
)
def test_a_signal_with_workers_on_ends_the_process(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, signals: list[signal.Signals], code: int
) -> None:
    """SIGTERM: finish the step, save, exit 143; a second SIGINT: abort at once, 130. The loader
    worker ignores both (the main process decides) and is gone afterwards either way."""
    recipe = _recipe(tmp_path, tiny_llama, tiny_data, max_steps=400)
    proc = _start([sys.executable, "-m", "trainer", "train", str(recipe)], tmp_path)
    try:
        _wait_for_step(proc, tmp_path / "run", tmp_path)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.2)
        assert proc.wait(timeout=60) == code, (tmp_path / "train.log").read_text()
        assert _session_processes(proc.pid) == []
        if code == E.EXIT_PREEMPTED:
            assert list((tmp_path / "run" / "checkpoints").glob("step-*/MANIFEST.json"))
    finally:
        _end(proc)


def test_end_child_processes_kills_a_child_that_ignores_sigterm() -> None:
    """The last resort: a child that ignores SIGTERM (like a loader worker) is killed, not joined forever."""
    import multiprocessing

    ready = multiprocessing.Event()
    child = multiprocessing.Process(target=_ignore_sigterm_forever, args=(ready,), daemon=True)
    child.start()
    assert ready.wait(30)
    child.terminate()  # what multiprocessing's exit handler does: ignored
    child.join(timeout=0.5)
    assert child.is_alive()  # control: SIGTERM alone does not end it
    assert child.pid is not None
    assert shutdown.end_child_processes(grace_seconds=0.1, keep=frozenset({child.pid})) == []  # not ours to end
    assert child.is_alive()
    assert shutdown.end_child_processes(grace_seconds=0.1) == [child.pid]
    assert not child.is_alive()


def _ignore_sigterm_forever(ready: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(1)


def test_loader_workers_is_validated() -> None:
    from trainer import config as C

    with pytest.raises(C.ConfigError, match="data.loader_workers: must be auto or 0 or more, got -1"):
        C.load(None, ["data.loader_workers=-1"])
    assert C.load(None, ["data.loader_workers=2"]).data.loader_workers == 2
    assert C.load(None, []).data.loader_workers == "auto"


@pytest.mark.slow
def test_control_without_the_shutdown_a_failed_run_never_exits(
    hung_control: tuple[subprocess.Popen, Path] | None,
) -> None:
    """The code before the fix (no loader close, no kill of leftover children) hangs, as on the H100.
    Its run started with this module (`hung_control`); this test is the module's last."""
    assert hung_control is not None
    proc, tmp = hung_control
    failed_at = _wait_failed(proc, tmp)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=max(1.0, failed_at + BOUND_S - time.time()))
    assert "injected failure" in (tmp / "train.log").read_text()  # it printed, then stayed
