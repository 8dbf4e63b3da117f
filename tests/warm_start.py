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
either way). torchrun (`module="torch.distributed.run"`) is forked the same way, and so are the ranks
it starts (`_RankForks`): each is still started by the launcher's own agent, is the launcher's child
(a rank watches its parent) in a session of its own, and ends with its exit code or signal, as
`subprocess.Popen` would have started it.
"""

from __future__ import annotations

import abc
import atexit
import ctypes
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

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
RANK_ONLY = (
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
"""What torchrun's agent adds to a rank's environment (with TORCHELASTIC_*): read when the rank joins
its process group, never while importing."""

UNBUFFERED = "PYTHONUNBUFFERED"
"""Read when the interpreter makes its stdio (as `-u`): an attempt that sets it has its stdio remade so."""


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


def _import_time_differences(env: dict[str, str], server_env: dict[str, str] | None = None) -> list[str]:
    server_env = _server_env if server_env is None else server_env
    keys = set(env) | set(server_env)
    if not server_env.get(UNBUFFERED):  # an attempt that asks for it gets it (_unbuffered)
        keys.discard(UNBUFFERED)
    return sorted(k for k in keys if not k.startswith(RUN_TIME_ONLY) and env.get(k) != server_env.get(k))


def _unbuffered() -> None:
    """stdout and stderr unbuffered, as `python -u` (or PYTHONUNBUFFERED) makes them: what a process
    killed mid-run wrote is in its output."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        new = io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors, write_through=True
        )
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of SystemExit's argument."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _attempt(module: str, args: list[str], env: dict[str, str], log: str, new_session: bool) -> NoReturn:
    """The forked process: set up as `subprocess.Popen` would have, then run `python -m MODULE ARGS`."""
    if new_session:
        os.setsid()
    # A forkserver's child takes the forkserver start method as its default; a fresh interpreter has none
    # (fork, on Linux). Its loader workers must be its own children, which end when it is killed.
    multiprocessing.set_start_method(None, force=True)
    os.chdir(REPO)
    os.environ.clear()
    os.environ.update(env)
    _output_to(log, log)
    if env.get(UNBUFFERED):
        _unbuffered()
    if module == "torch.distributed.run":
        _RankForks.install()  # before anything else is registered or started: the zygote forks from here
    _dump_imports(os.environ.get("SPOTUNE_WARM_DUMP"))
    _run_as_main(module, args)


def _dump_imports(path: str | None) -> None:
    """At exit, write the modules this process imported from here on to `path` (a test's probe)."""
    if path:
        before = set(sys.modules)
        atexit.register(lambda: Path(path).write_text("\n".join(sorted(set(sys.modules) - before))))


def _output_to(stdout: str | None, stderr: str | None) -> None:
    """fd 1 and 2 to these files (made, or emptied, by whoever passed them, as Popen's caller does)."""
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path is not None:
            opened = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.dup2(opened, fd)
            os.close(opened)


def _run_as_main(module: str, args: list[str]) -> NoReturn:
    """`python -m MODULE ARGS` in this process, which then ends the way the interpreter does (non-daemon
    threads joined, atexit handlers run, streams flushed)."""
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


PR_SET_CHILD_SUBREAPER = 36
"""prctl(2): orphaned descendants are re-parented to this process instead of init."""


class _RankForks:
    """In torchrun's launcher: its agent's `Popen` of `python -u -m trainer ...` becomes a fork of a zygote
    the launcher forked before it started (so with the trainer imported, and single-threaded).

    The rank must be the launcher's child, as with Popen: it watches its parent to notice the launcher's
    death (trainer/restart/signals/launcher.py), and the agent reaps it. So the zygote forks a middle
    process that forks the rank and exits; the launcher is a child subreaper, so the orphaned rank is
    re-parented to it, not to init. The zygote answers the rank's pid once the rank is in a session of its
    own (torchrun starts ranks with start_new_session) and the middle process is gone.
    """

    def __init__(self, conn: multiprocessing.connection.Connection, env: dict[str, str]) -> None:
        self.conn = conn
        self.env = env
        """The zygote's environment: a rank forked from it must ask for the same import-time variables."""
        self.lock = threading.Lock()

    @classmethod
    def install(cls) -> None:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

        handler = subprocess_handler.SubprocessHandler
        if not callable(getattr(handler, "_popen", None)):
            print("warm_start: torchrun's SubprocessHandler has no _popen: its ranks are fresh interpreters")
            return
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        launcher = os.getpid()
        ours, theirs = socket.socketpair()
        if os.fork() == 0:
            ours.close()
            _zygote(multiprocessing.connection.Connection(theirs.detach()), launcher)
        theirs.close()
        forks = cls(multiprocessing.connection.Connection(ours.detach()), dict(os.environ))
        popen = handler._popen

        def _popen(self: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
            stdout, stderr = (getattr(f, "name", None) for f in (self._stdout, self._stderr))
            rank = forks.fork(tuple(args), env, stdout, stderr)
            return popen(self, args, env) if rank is None else rank

        handler._popen = _popen  # type: ignore[method-assign]  # the agent calls it for every rank

    def fork(self, args: tuple[str, ...], env: dict[str, str], stdout: str | None, stderr: str | None) -> Rank | None:
        """The rank `args` would start, forked; None where Popen must start it (another command, or an
        environment that differs in an import-time variable)."""
        if args[:4] != (sys.executable, "-u", "-m", "trainer"):
            return None
        rank_env = {k: v for k, v in env.items() if k not in RANK_ONLY and not k.startswith("TORCHELASTIC_")}
        differences = _import_time_differences(rank_env, self.env)
        if differences:
            print(f"warm_start: a fresh rank: {', '.join(differences)} differ from the forkserver's", file=sys.stderr)
            return None
        with self.lock:  # the agent starts ranks from one thread; the lock keeps requests whole regardless
            self.conn.send((list(args[4:]), env, os.getcwd(), stdout, stderr))
            pid = self.conn.recv()
        return Rank(pid, list(args))


def _zygote(conn: multiprocessing.connection.Connection, launcher: int) -> NoReturn:
    """Forks each rank the launcher asks for, until the launcher closes its end (or dies)."""
    while True:
        try:
            args, env, cwd, stdout, stderr = conn.recv()
        except EOFError:
            os._exit(0)
        ready_r, ready_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(ready_r)
            if os.fork() == 0:
                conn.close()
                os.setsid()
                os.write(ready_w, str(os.getpid()).encode())
                os.close(ready_w)
                _rank(args, env, cwd, stdout, stderr, launcher)
            os._exit(0)  # the rank is orphaned: re-parented to the launcher (a child subreaper)
        os.close(ready_w)
        os.waitpid(middle, 0)
        with os.fdopen(ready_r, "rb") as ready:
            conn.send(int(ready.read()))


def _rank(
    args: list[str], env: dict[str, str], cwd: str, stdout: str | None, stderr: str | None, launcher: int
) -> NoReturn:
    """A rank as `python -u -m trainer ARGS` would start with this environment and output."""
    deadline = time.monotonic() + 30
    while os.getppid() != launcher:  # the middle process is exiting; its orphan goes to the launcher
        if time.monotonic() > deadline:
            os._exit(1)  # the launcher is gone
        time.sleep(0.001)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _output_to(stdout, stderr)
    dump = os.environ.get("SPOTUNE_WARM_DUMP")
    _dump_imports(dump and f"{dump}.rank{os.environ.get('RANK')}")
    _unbuffered()  # torchrun starts it with -u
    _run_as_main("trainer", args)


class _Forked(abc.ABC):
    """The part of `subprocess.Popen`'s surface that is the same for every process forked here."""

    pid: int

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code (Popen's: -N for signal N) once the process ended, else None."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Rank(_Forked):
    """The `subprocess.Popen` surface torchrun's agent uses, for a rank the launcher reaps (its child)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class Attempt(_Forked):
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
    torchrun (`torch.distributed.run`: the launcher is forked, and the ranks it starts, `_RankForks`)."""
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
