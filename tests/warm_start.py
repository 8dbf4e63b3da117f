"""`python -m trainer ARGS` for drills, forked from a process that has already imported the trainer.

Every attempt a drill starts used to spend about 8 CPU-s importing torch, transformers, peft and
accelerate before it did anything (the suite starts well over a hundred of them on two cores). Here
a multiprocessing forkserver imports what a run imports (warm_start_preload) once per test worker
and forks each attempt from it: still a process of its own (its own pid and session, signals, exit
code, output file, loader workers, the same argv and environment), only its imports are done.

What it does not reproduce is a fresh interpreter: what an import prints, costs or pulls in. A test
whose claim is about that starts `python -m trainer` itself. An environment that differs from the
forkserver's in a variable a library may read while importing (any but RUN_TIME_ONLY) gets a fresh
interpreter too, as does every attempt when SPOTUNE_TEST_FRESH=1 (the control: the drills pass
either way). torchrun (`module="torch.distributed.run"`) is forked the same way: the launcher, whose
ranks are fresh interpreters it starts itself.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FRESH_ENV = "SPOTUNE_TEST_FRESH"
TRACKERS = ("wandb", "mlflow")
"""Libraries the trainer imports only when a run starts one: the forkserver has not (warm_start_preload
asserts it), so their settings are read in the attempt."""
RUN_TIME_ONLY = (
    "SPOTUNE_",
    "AWS_",
    *(f"{tracker.upper()}_" for tracker in TRACKERS),
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "_TORCHINDUCTOR_",
    "PYTEST_CURRENT_TEST",
)
"""Variables nothing reads while importing: the trainer's own and the store's (read at run time), the
trackers' (TRACKERS), the compilers' caches and Inductor's own markers (read, and set when unset, when
it compiles), and the name of the test pytest is running (it changes with every test)."""

WARM = ("trainer", "torch.distributed.run")
"""The modules an attempt may run: what warm_start_preload imported for them."""
PRELOAD = ["warm_start", "warm_start_preload"]
"""Modules the forkserver imports once (multiprocessing skips one that fails to import)."""

_context: multiprocessing.context.ForkServerContext | None = None
_server_env: dict[str, str] = {}


def _server() -> multiprocessing.context.ForkServerContext:
    global _context, _server_env
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        # The forkserver inherits this environment now; an attempt may start from it only if it
        # asks for the same import-time variables.
        _server_env = dict(os.environ)
        from multiprocessing import forkserver

        # The forkserver imports PRELOAD before it takes the sys.path of this process: it finds them on
        # PYTHONPATH (this folder; the repository for the trainer, as `-m trainer` run from there would).
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO), *([path] if path else [])])
        try:
            forkserver.ensure_running()
        finally:
            if path is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = path
        _context = ctx
    return _context


def _import_time_differences(env: dict[str, str]) -> list[str]:
    keys = set(env) | set(_server_env)
    return sorted(k for k in keys if not k.startswith(RUN_TIME_ONLY) and env.get(k) != _server_env.get(k))


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of SystemExit's argument."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _attempt(module: str, args: list[str], env: dict[str, str], log: str, new_session: bool) -> None:
    """The forked process: set up as `subprocess.Popen` would have, run `python -m MODULE ARGS`, then end
    the way the interpreter does (non-daemon threads joined, atexit handlers run, streams flushed)."""
    if new_session:
        os.setsid()
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)  # made (or emptied) by `start`, as Popen's caller does
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if os.environ.get("SPOTUNE_WARM_DUMP"):
        before = set(sys.modules)
        atexit.register(
            lambda: Path(os.environ["SPOTUNE_WARM_DUMP"]).write_text("\n".join(sorted(set(sys.modules) - before)))
        )
    sys.argv = ["-m", *args]  # runpy puts the module's file in argv[0], as `python -m` does
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as Py_FinalizeEx: wait for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


class Attempt:
    """The `subprocess.Popen` surface the drills use, for a process the forkserver forked."""

    def __init__(self, process: Any, args: list[str]) -> None:
        self._process = process
        self.args = args
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Started = Attempt | subprocess.Popen
"""What `start` returns: either answers poll, wait, send_signal, kill, pid, returncode and args alike."""


def start(
    args: list[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    new_session: bool = True,
    module: str = "trainer",
) -> Started:
    """`python -m MODULE ARGS` in the repository with `env`, stdout and stderr to `log`: forked from the warm
    forkserver where that is the same process, else a fresh interpreter. MODULE is the trainer or
    torchrun (`torch.distributed.run`: the launcher is forked, the ranks it starts are fresh interpreters)."""
    assert module in WARM, module
    env = dict(os.environ if env is None else env)
    if env.get(FRESH_ENV) != "1":
        ctx = _server()
        differences = _import_time_differences(env)
        if differences:
            print(f"warm_start: a fresh interpreter: {', '.join(differences)} differ from the forkserver's")
        else:
            open(log, "w").close()  # the log is there once `start` returns, as with Popen
            process = ctx.Process(target=_attempt, args=(module, list(args), env, str(log), new_session), daemon=False)
            process.start()
            # Ended by its test, never joined by multiprocessing at the worker's exit (its non-daemon children are).
            multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
            attempt = Attempt(process, [sys.executable, "-m", module, *args])
            # Popen returns once the child is in its session; a kill of its group right away must reach it.
            deadline = time.monotonic() + 30
            while new_session and attempt.poll() is None and time.monotonic() < deadline:
                try:
                    if os.getpgid(attempt.pid) == attempt.pid:
                        break
                except ProcessLookupError:
                    break
                time.sleep(0.001)
            return attempt
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
