"""One writer per run across machines: a lease object in `checkpoint.remote`, with a fencing token.

`<remote>/lease.json` names the attempt that may write the run (holder id, host, pid, run
directory, `generation`, `renewed_at`, `expires_at`). An attempt takes it before it reads or
writes anything else in the store:
- absent: created with S3 `If-None-Match: *` (two machines racing: one wins);
- held by someone else and not expired: refuse (RunBusy) or, with `--wait`, poll until it is;
- expired, released, or held by this same run directory on this same host (the kernel lock
  of trainer/restart/lock.py, which this process holds, proves that holder is dead): replaced
  with `If-Match: <etag read>` and `generation + 1`.

A daemon thread renews it every `ttl / 3` seconds with `If-Match` on the etag it last wrote;
a thread rather than the loop's log steps because one step of a large model can outlast the
lease. The holder fences itself: it keeps a local deadline (monotonic clock, taken when the
renewal was sent, `ttl` minus a clock-skew margin) and every store write checks it first
(`check`). Commits (a checkpoint's manifest, ledger.jsonl) go through `commit`: on S3 a
conditional renewal right before the write (it fails if anyone took the lease), the manifest
itself with `If-None-Match: *`, and the deadline checked after; on stores without conditional
writes, a re-read of the lease before and after. A holder that finds it lost the lease (a
renewal refused, or its deadline passed while it was paused or cut off) prints why and exits
at once with EXIT_BUSY from whichever thread noticed: no other thread gets to write again.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainer.exit_codes import EXIT_BUSY, EXIT_FILE_ENV
from trainer.restart.lock import RunBusy, _iso, last_step
from trainer.restart.storage import Fence, Store, _short

T = TypeVar("T")

LEASE_FILE = "lease.json"
POLL_SECONDS = 5.0


class LeaseLost(RunBusy):
    """This attempt no longer holds the run's lease; it must write nothing more."""


class _Refused(Exception):
    """A conditional write's precondition failed: someone else wrote the object first."""


def _precondition_failed(e: BaseException) -> bool:
    """s3fs turns 412 into FileExistsError (If-None-Match) or OSError (If-Match); 409 is S3's answer to two
    conditional writes at once."""
    text = f"{e} {e.__cause__!r}"
    return isinstance(e, FileExistsError) or any(
        s in text for s in ("PreconditionFailed", "pre-condition", "ConditionalRequestConflict", "412")
    )


def conditional(store: Store) -> bool:
    """Whether the store takes S3 conditional writes (If-None-Match / If-Match) through s3fs."""
    return hasattr(store.fs, "call_s3")


def read_lease(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    """The lease object and its etag (a digest of its bytes where the store has no etag)."""
    path = store.path(LEASE_FILE)
    try:
        if conditional(store):
            raw, etag = _s3_get(store, path)
            return json.loads(raw), etag
        raw = store.fs.cat_file(path)
    except FileNotFoundError:
        return None, None
    import hashlib

    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def _s3_get(store: Store, path: str) -> tuple[bytes, str]:
    """Body and ETag from one GET (two requests could pair one version's body with another's etag)."""
    from fsspec.asyn import sync

    fs = store.fs
    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[bytes, str]:
        got = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with got["Body"] as stream:
            return await stream.read(), str(got["ETag"])

    return sync(fs.loop, get)


def write_object(store: Store, path: str, body: bytes, *, if_match: str | None = None, new: bool = False) -> str | None:
    """Put `body` at `path`, on S3 only if the object still has etag `if_match` (or, `new`, does
    not exist); raises _Refused otherwise. Returns the new etag (None on other stores)."""
    if not conditional(store):
        store.fs.pipe_file(path, body)
        return None
    bucket, key, _ = store.fs.split_path(path)
    extra: dict[str, str] = {"IfNoneMatch": "*"} if new else {"IfMatch": if_match} if if_match else {}
    try:
        put = store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **extra)
    except Exception as e:
        if extra and _precondition_failed(e):
            raise _Refused(str(e)) from e
        raise
    return str(put["ETag"])


class Lease(Fence):
    """This attempt's claim on a run's remote prefix."""

    def __init__(self, store: Store, ttl: float, run_dir: Path, message: Callable[[str], None] = print) -> None:
        self.store = store
        self.ttl = ttl
        self.run_dir = run_dir
        self.message = message
        self.id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.body: dict[str, Any] | None = None
        self.etag: str | None = None
        self.deadline = 0.0
        self.acquired_at: float | None = None
        self.waited = 0.0
        self.requests = 0
        """Requests this lease made (reads and writes): its cost on the store's bill."""
        self.on_lost: Callable[[str], None] = _exit_lost
        self.lost: str | None = None
        self.released = False
        """After `release`: an upload thread still running at exit must not take the lease again."""
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.margin = min(5.0, ttl * 0.1)
        """Seconds the holder gives up before `expires_at`: the clock skew between machines it tolerates."""

    @property
    def held(self) -> bool:
        return self.body is not None

    # ------------------------------------------------------------------ taking it

    def acquire(self, wait: float | None = None) -> None:
        """Take the lease, or raise RunBusy naming its live holder (after waiting `wait` seconds)."""
        started = time.monotonic()
        deadline = started + (wait or 0.0)
        while True:
            current, etag = self._read()
            if current is None or self._may_take(current):
                generation = int(current.get("generation", 0)) + 1 if current else 1
                try:
                    self._write(generation, etag if current else None, new=current is None)
                except _Refused:
                    continue  # another machine wrote it between our read and write: look again
                self.acquired_at = time.time()
                self.waited = time.monotonic() - started
                if current is not None and not current.get("released"):
                    self.message(f"spotune: took over the lease of {self.store.shown}: {_why(current, self)}")
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunBusy(busy_message(self.store, current, wait))
            time.sleep(min(POLL_SECONDS, left, max(0.5, float(current.get("expires_at", 0)) - time.time())))

    def _may_take(self, current: dict[str, Any]) -> bool:
        if current.get("released") or time.time() > float(current.get("expires_at", 0)):
            return True
        # This directory's kernel lock is ours, so whoever held the lease from it on this host is dead.
        return current.get("host") == self.host and current.get("run_dir") == str(self.run_dir.resolve())

    def start(self) -> Lease:
        """Renew in the background until `release`."""
        self._thread = threading.Thread(target=self._renew_loop, name="spotune-lease", daemon=True)
        self._thread.start()
        return self

    # ------------------------------------------------------------------ holding it

    def _renew_loop(self) -> None:
        while not self._stopping.wait(self.ttl / 3):
            try:
                self.renew()
            except LeaseLost:
                return  # on_lost already ran
            except Exception as e:  # a network blip: the next renewal (or the deadline) decides
                self.message(f"spotune: renewing the lease of {self.store.shown} failed ({_short(e)}); retrying")
                try:
                    self._check_deadline()
                except LeaseLost:
                    return

    def renew(self) -> None:
        """Extend the lease by `ttl`, conditional on nobody having replaced it; raises LeaseLost."""
        with self._lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if not self.held:
                return self.acquire_late()
            self._check_deadline()
            assert self.body is not None
            try:
                self._write(int(self.body["generation"]), self.etag, new=False)
            except _Refused:
                self._lost("another machine took the run's lease (this attempt was paused, or cut off, past expiry)")
            return None

    def acquire_late(self) -> None:
        """The store was unreachable at start: take the lease before the first write, or stop."""
        try:
            self.acquire(None)
        except RunBusy as e:
            self._lost(str(e))
        self.start()

    def check(self) -> None:
        """Raise LeaseLost (after on_lost) unless this attempt may still write; no request when held."""
        with self._lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if not self.held:
                self.acquire_late()
            self._check_deadline()

    def commit(self, write: Callable[[], T]) -> T:
        """Run a commit write only while this attempt holds the lease, and confirm it still did after."""
        with self._lock:
            if conditional(self.store):
                self.renew()  # conditional: proves the lease is ours and gives the write a full ttl
            else:
                self.check()
                self._confirm()
            result = write()
            if conditional(self.store):
                self._check_deadline()
            else:
                self._confirm()
            return result

    def put_new(self, store: Store, local: Path, path: str) -> None:
        """A manifest: on S3 `If-None-Match: *`, so a step another writer committed is never overwritten."""
        try:
            write_object(store, path, local.read_bytes(), new=True)
        except _Refused:
            self._lost(f"{path} was committed by another writer meanwhile")

    def _confirm(self) -> None:
        current, _ = self._read()
        if current is None or current.get("holder") != self.id or current.get("generation") != self.generation:
            self._lost("the run's lease now names another holder")
        self._check_deadline()

    @property
    def generation(self) -> int | None:
        return int(self.body["generation"]) if self.body else None

    def _check_deadline(self) -> None:
        if self.held and time.monotonic() > self.deadline:
            self._lost(f"the lease was not renewed for over {self.ttl - self.margin:g}s (paused, or cut off)")

    def _lost(self, why: str) -> None:
        if self.lost is not None:
            raise LeaseLost(self.lost)
        self.lost = why
        self.message(
            f"spotune: lost the lease of {self.store.shown}: {why}. Stopping now without writing anything more "
            f"there; exit {EXIT_BUSY}. `spotune status {self.store.shown}` shows who holds the run."
        )
        self.on_lost(why)
        raise LeaseLost(why)

    # ------------------------------------------------------------------ letting go

    def release(self) -> None:
        """Stop renewing and mark the lease released (conditional), so the next attempt starts at once."""
        self._stopping.set()
        with self._lock:
            self.released = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            if not self.body or self.lost is not None or time.monotonic() > self.deadline:
                return
            try:
                self._write(int(self.body["generation"]), self.etag, new=False, released=True)
            except Exception:  # it expires by itself; the next attempt waits at most ttl
                pass
            self.body = None

    # ------------------------------------------------------------------ the object

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        self.requests += 1
        return read_lease(self.store)

    def _write(self, generation: int, if_match: str | None, *, new: bool, released: bool = False) -> None:
        sent = time.monotonic()
        now = time.time()
        body = {
            "holder": self.id,
            "host": self.host,
            "pid": os.getpid(),
            "run_dir": str(self.run_dir.resolve()),
            "generation": generation,
            "started": _iso(self.acquired_at or now),
            "renewed_at": now,
            "expires_at": now if released else now + self.ttl,
            "ttl": self.ttl,
            "step": last_step(self.run_dir),
        }
        if released:
            body["released"] = True
        self.requests += 1
        etag = write_object(
            self.store, self.store.path(LEASE_FILE), json.dumps(body).encode(), if_match=if_match, new=new
        )
        self.body, self.etag = body, etag
        self.deadline = sent + self.ttl - self.margin


def _why(old: dict[str, Any], new: Lease) -> str:
    if time.time() > float(old.get("expires_at", 0)):
        return f"generation {old.get('generation')} ({old.get('host')}, pid {old.get('pid')}) had expired"
    return f"its holder ran in this directory on this host ({new.host}, pid {old.get('pid')}) and is gone"


def describe_lease(lease: dict[str, Any]) -> str:
    """One line: who holds it, since when, how fresh, and when it expires."""
    left = float(lease.get("expires_at", 0)) - time.time()
    state = (
        "released" if lease.get("released") else f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago"
    )
    step = f", step {lease['step']}" if lease.get("step") is not None else ""
    return (
        f"pid {lease.get('pid')} on {lease.get('host')} (generation {lease.get('generation')}, since "
        f"{lease.get('started')}{step}, renewed {time.time() - float(lease.get('renewed_at', 0)):.0f}s ago, {state})"
    )


def busy_message(store: Store, lease: dict[str, Any] | None, wait: float | None) -> str:
    waited = f" after waiting {wait:g}s" if wait else ""
    who = describe_lease(lease) if lease else "another attempt"
    return (
        f"{store.shown} is held by {who}{waited}; one writer per run. Rerun with --wait SECONDS to resume once its "
        f"lease ends, or, if that machine is certainly gone, `spotune status {store.shown} --break-lease`."
    )


def _exit_lost(why: str) -> None:
    """Exit the whole process now, from whichever thread found the lease lost (no thread writes again)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        Path(path).write_text(f"{EXIT_BUSY}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BUSY)
