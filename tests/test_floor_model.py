"""A model-based test of the restart code: hypothesis's stateful testing drives the real leases
(trainer/restart/ownership/lease.py, renewed by its real state machine, trainer/restart/ownership/reclaim.py, on
the model's boot and wall clock: once its time passes a lease's ttl, another machine takes a killed or silent
holder's lease over and its ledger books that holder from the lease's hand-over), the real choice of the
checkpoint (trainer/restart/remote/choose.py), the store's commit, clean, prune and retire with the floor
(trainer/restart/store/lifecycle.py, safety.py) and the run files' merge, against a `file://` store (a folder),
with a stand-in training step (a checkpoint whose bytes are a function of its step: exact resume) and faults
injected between any two actions: several machines with their own disks, kills at any point (the lease left
behind), store outages, a lease request that blips, stale listings, corrupt reads (once, or the store's bytes
really corrupt), late writes of a fenced holder, `checkpoint.resume=never`.

After every rule: the store's newest committed step never goes down, unless the user asked (`resume=never`) or
the steps that went were really corrupt in the store (retired, kept); no write is refused by the rule (a
SafetyViolation is a bug); no two attempts hold one lease generation; with BOOKS_INVARIANTS, every step at or
below the newest committed one has its metrics row in the store, and every attempt that trained (or was killed
while starting, holding the lease) has its ledger row: each attempt opens a real Ledger on its machine's disk
(after choosing, with the lease's hand-over), heartbeats at each step and checkpoint, closes it on every end but
a kill, and pushes the run files through the real Uploader._push_run_files (RemoteRun.book_late first). Once an
attempt that trained and ended left a trace in the store (`Attempt.owed`) and a later attempt has pushed its run
files, the store's ledger holds exactly one row of it (by attempt_key); no attempt ever has two.

The search must reach takeovers (`SEEN`, asserted at its end); sequences written out beside it pin the takeover
of a killed holder with its late write fenced, a late lease after a blip meeting a store that moved on, and an
attempt killed while starting booked from its lease alone (with a control that switches the hand-over off).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from trainer.exit_codes import code_for
from trainer.restart.books.ledger import Ledger, attempt_key
from trainer.restart.local.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from trainer.restart.ownership.lease import Lease
from trainer.restart.ownership.lease_object import LeaseLost, read_lease
from trainer.restart.ownership.lock import RunBusy
from trainer.restart.remote.choose import choose
from trainer.restart.remote.run import RemoteRun
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.remote.uploader import Uploader
from trainer.restart.store.generations import stamped
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.safety import SafetyViolation, StoreAhead

BOOKS_INVARIANTS = True
"""Every step at or below the newest committed one has its metrics row in the store: the rows go up before
each commit (trainer/restart/remote/uploader.py), so a kill between a commit and the push of the run files loses
none; and the ledger's row of every attempt owed one. False switches both off for a deeper search of the
floor alone."""

SEEN: dict[str, int] = {}
"""What the search reached, over all its sequences (`Model.saw`): the test asserts the lease changes hands."""

TTL = 30.0
MACHINES = 2
KEEP_LAST = 2
ADAPTER = "adapter_model.safetensors"


class Clock:
    """The clocks every lease reads: its boot clock (the instance) and its wall clock (`wall`), one world's
    time, which passes only when a rule says so or a lease waits (`Waiting`)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.epoch = time.time() - self.now  # the wall clock stays near the real one: the ledger's rows use that

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.epoch + self.now


class Waiting(threading.Event):
    """What a lease waits on while it watches a holder's lease (Lease.acquire's `stopping`, the lease
    thread's): the wait lets the model's time pass instead of sleeping, so an attempt that finds a silent
    holder's lease watches it for its ttl and takes it over, in no real time."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set() and timeout is not None:
            self.clock.now += timeout
        return self.is_set()


class Machine:
    """One VM: its own disk, and how it sees the store (its reads, its listings' cache)."""

    def __init__(self, index: int, disk: Path) -> None:
        self.index = index
        self.disk = disk
        self.bad_reads = 0  # the next N object reads come back with a byte flipped
        self.stale = False  # the next listing is this machine's last one, again
        self.listings: dict[str, Any] = {}

    @property
    def root(self) -> Path:
        return self.disk / "checkpoints"


class Seen:
    """A machine's filesystem view of the store: the real one, with the world's faults."""

    def __init__(self, fs: Any, world: Model, machine: Machine) -> None:
        self._fs, self._world, self._machine = fs, world, machine

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._fs, name)
        if not callable(real) or name.startswith("_") or name == "invalidate_cache":
            return real

        def call(*args: Any, **kw: Any) -> Any:
            if self._world.outage:
                raise ConnectionError("the store does not answer (an outage)")
            if name == "find":
                key = str(args[0]) if args else ""
                if self._machine.stale and key in self._machine.listings:
                    self._machine.stale = False
                    return self._machine.listings[key]
                found = real(*args, **kw)
                self._machine.listings[key] = found
                return found
            result = real(*args, **kw)
            if name == "get_file" and not str(args[0]).endswith(MANIFEST) and self._machine.bad_reads > 0:
                self._machine.bad_reads -= 1
                data = bytearray(Path(args[1]).read_bytes())
                data[0] ^= 0xFF
                Path(args[1]).write_bytes(bytes(data))
            return result

        return call


def _bytes(step: int) -> bytes:
    """The stand-in for a trained state: exact resume makes step N's checkpoint the same on every machine."""
    return bytes([step % 251 + 1]) * 64


class Killed(Exception):
    """The machine died in the middle of an upload (the model's `kill in flight`)."""


class Attempt:
    def __init__(self, machine: Machine, lease: Lease, store: Store) -> None:
        self.machine, self.lease, self.store = machine, lease, store
        self.step = 0
        self.pending: int | None = None  # a checkpoint not yet in the store
        self.rows_sent: int | None = None  # the pending step whose metrics rows went up: its commit may be in flight
        self.stopping = False
        self.generations: set[int] = set()
        self.started = 0  # the model's clock of events: when this attempt's ledger opened
        self.ended: int | None = None
        self.trained = 0  # steps trained by this attempt
        self.reached_store = False  # a push of its run files after its first step went through
        self.held_at_end = False  # it held the lease when it ended: the lease object names it
        self.killed_starting = False  # killed after taking the lease, before its ledger opened

    def open_books(self, started: int) -> None:
        self.started = started
        machine, lease, store = self.machine, self.lease, self.store
        # The ledger as the real attempt opens it (trainer/training/run.py `_books`): after choosing, with the
        # lease's records of the attempts it took the run from.
        self.ledger = Ledger.open(
            machine.disk, 1, attempt_id=lease.id, lost_attempts=lease.hand_over(), process_start=time.time()
        )
        # The real uploader's push of the run files (its thread is never started: the model calls it in turn),
        # with RemoteRun.book_late before each push, as RemoteRun.start_uploads wires it.
        remote = SimpleNamespace(fence=lease, run_dir=machine.disk, _booking=threading.Lock())
        self.uploader = Uploader(
            store, machine.disk, KEEP_LAST, lambda _: None, before_run_files=lambda: RemoteRun.book_late(remote)
        )

    @property
    def key(self) -> tuple[Any, ...]:
        return attempt_key({"attempt_id": self.lease.id})

    def owed(self) -> bool:
        """The books promise this attempt a row: it trained (or it was killed while starting, its lease the only
        trace of the time it cost), it ended, and a trace of it reached the store (its heartbeat or row pushed
        after a step, or the lease object it held when it ended). An attempt whose only trace was its own disk
        (cut off from the store all along) is booked only by the next attempt on that disk: a wiped disk loses
        it, which the code does not promise against."""
        paid = self.trained > 0 or self.killed_starting
        return paid and self.ended is not None and (self.reached_store or self.held_at_end)


class Model(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(TMP[0]) / f"example-{id(self)}"
        self.tmp.mkdir(parents=True)
        (self.tmp / "store").mkdir()
        self.url = f"file://{self.tmp / 'store'}"
        self.clock = Clock()
        self.patches = [
            mock.patch("trainer.restart.ownership.lease.boot_clock", self.clock),
            mock.patch("trainer.restart.ownership.reclaim.boot_clock", self.clock),
            mock.patch("trainer.restart.ownership.lease.wall_clock", self.clock.wall),
        ]
        for p in self.patches:
            p.start()
        self.machines = [Machine(i, self.tmp / f"vm{i}") for i in range(MACHINES)]
        self.attempts: dict[int, Attempt] = {}  # machine -> its live attempt
        self.fenced: list[tuple[int, int]] = []  # (generation, step): uploads in flight of killed holders
        self.outage = False
        self.never_asked = False
        self.user_reset = False
        self.really_corrupt: set[int] = set()
        self.newest = -1
        self.violations: list[str] = []
        self.holders: dict[int, str] = {}  # lease generation -> holder id
        self.events = 0  # the model's clock of starts, ends and pushes
        self.ended: list[Attempt] = []
        self.due: dict[tuple[Any, ...], Attempt] = {}  # attempts the store must hold exactly one row of
        self.machine_of: dict[str, int] = {}  # lease id (attempt id) -> the machine it ran on

    def teardown(self) -> None:
        for a in self.attempts.values():
            a.lease.keeper.stop()
        for p in self.patches:
            p.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ the world

    def store_for(self, machine: Machine) -> Store:
        store = Store(self.url)
        store.fs = Seen(store.fs, self, machine)
        return store

    def truth(self) -> list[int]:
        return Store(self.url).committed()

    @initialize()
    def begin(self) -> None:
        """A run under way: machine 0 holds it and has committed a few steps (sequences start mid-run)."""
        self.start_attempt(self.machines[0], blip=False, never=False)
        for _ in range(4):
            self.train_one_step(0)
        self.newest = self.truth()[-1]

    # ------------------------------------------------------------------ an attempt's life

    @rule(m=st.integers(0, MACHINES - 1), blip=st.booleans(), later=st.booleans(), dies=st.booleans())
    def start(self, m: int, blip: bool, later: bool, dies: bool = False) -> None:
        """`spotune train` on machine `m` (its first lease request blipped: `blip`; `later`: it comes up longer
        than a lease after the last event, as a replacement VM does; `dies`: it is killed once it chose, while
        it loads the model, before its ledger opens), with resume=never if the user asked for it (once)."""
        if m in self.attempts:
            return
        if later:
            self.time_passes()
        never, self.never_asked = self.never_asked, False
        try:
            self.start_attempt(self.machines[m], blip, never, dies)
        finally:
            if m not in self.attempts and self.machines[m].bad_reads > 1:
                self.machines[m].bad_reads = 0  # it stopped: the job moves off the bad machine

    def start_attempt(self, machine: Machine, blip: bool, never: bool, dies: bool = False) -> None:
        m = machine.index
        lease = Lease(self.store_for(machine), TTL, machine.disk, message=lambda _: None)
        self.machine_of[lease.id] = m
        before = self.lease_now()
        lease.on_lost = lambda why: None  # LeaseLost is raised in the thread that finds it; the attempt ends
        lease.keeper._stopping = Waiting(self.clock)  # a lease taken late (after a blip) waits on the model's time
        machine.disk.mkdir(parents=True, exist_ok=True)
        try:
            if blip:
                raise ConnectionError("the first lease request blipped")
            lease.acquire(0, stopping=Waiting(self.clock))
        except RunBusy:
            return  # exit 75: another attempt holds the run
        except Exception as e:
            lease.offline(str(e))  # owner.take: RemoteRun decides whether training may start
        else:
            self.took(lease, before, "at start")
        store = self.store_for(machine)
        store.fence = lease
        attempt = Attempt(machine, lease, store)
        lease.on_outage = lambda why: setattr(attempt, "stopping", True)
        store.floor.on_ahead = lambda why: setattr(attempt, "stopping", True)
        local = CheckpointManager(machine.root).committed()
        try:  # RemoteRun.connect: check the store, fetch the run files
            store.check()
            fetch_run_files(store, machine.disk)
            reachable = True
        except Exception:
            reachable = False
            if not local or never:
                lease.release()
                return  # exit 143 before training
        try:
            chosen, _ = choose(machine.root, "never" if never else "auto", store, reachable, budget=0, message=print)
        except SafetyViolation as e:
            self.violations.append(f"choosing on vm{m}: {e}")
            lease.release()
            return
        except Exception as e:  # StoreUnreachable (143), CheckpointError (2): the attempt ends before training
            assert isinstance(e, CheckpointError) or code_for(e) == 143, repr(e)
            lease.release()
            return
        if never:
            self.user_reset = True
        if dies:  # no ledger, no heartbeat: only the lease it holds (if it took it) names the time it cost
            attempt.killed_starting = True
            self.note_generation(attempt)
            lease.keeper.stop()
            self.ended_now(attempt)
            return
        self.events += 1
        attempt.open_books(self.events)
        attempt.step = CheckpointManager.step_of(chosen) if chosen is not None else 0
        attempt.pending = attempt.step if chosen is not None else None  # start_uploads: the store may lack it
        self.attempts[m] = attempt
        self.note_generation(attempt)
        self.push_run_files(attempt)  # the uploader thread's first act: a kill before any step is still booked

    def lease_now(self) -> dict[str, Any] | None:
        """The lease object as it is in the store (the model's own look, outside every machine's faults)."""
        return read_lease(Store(self.url))[0]

    def took(self, lease: Lease, before: dict[str, Any] | None, when: str) -> None:
        """`lease` was just taken (`when`: at start, or late by the lease thread) from the lease object
        `before`: count how it changed hands, so that the test can assert the search reaches takeovers."""
        if before is None:
            return
        assert lease.generation == int(before["generation"]) + 1, (before, lease.body)
        holder = before.get("holder")
        if before.get("released"):
            how = "released"
        elif self.machine_of.get(holder) == self.machine_of[lease.id]:
            how = "left on this machine"  # its kernel lock proves the holder gone
        else:
            killed = any(a.lease.id == holder for a in self.ended)
            how = f"taken over from a {'killed' if killed else 'silent live'} holder on another machine"
        self.saw(f"lease {how}, {when}")

    def saw(self, what: str) -> None:
        SEEN[what] = SEEN.get(what, 0) + 1

    def note_generation(self, a: Attempt) -> None:
        gen = a.lease.generation
        if gen is not None and a.lease.held:
            a.generations.add(gen)
            if self.holders.setdefault(gen, a.lease.id) != a.lease.id:
                self.violations.append(f"two holders in generation {gen}")

    def live(self) -> list[int]:
        return sorted(self.attempts)

    @precondition(lambda self: self.attempts)
    @rule(
        data=st.data(), steps=st.sampled_from([1, 3]), then=st.sampled_from(["go on", "stop", "kill", "kill in flight"])
    )
    def train(self, data: st.DataObject, steps: int, then: str) -> None:
        """Per step: the lease thread ticks; the step is trained and saved; the uploader sends it (clean,
        upload, prune) and the run files after it. Then the attempt goes on, stops gracefully (a spot
        notice: the pending upload tried once more, the lease released), or is killed (the lease left to
        expire; `in flight`: killed with the last step's manifest PUT sent, past every check, which lands
        later: a fenced holder's late write)."""
        m = data.draw(st.sampled_from(self.live()))
        for i in range(steps):
            if m not in self.attempts:
                return
            try:
                self.train_one_step(m, kill_at_commit=then == "kill in flight" and i == steps - 1)
            except Killed:
                break
        if m not in self.attempts or then == "go on":
            return
        if then == "stop":
            self.upload(m)
            if m in self.attempts:
                self.end(m)
            return
        a = self.attempts.pop(m)
        a.lease.keeper.stop()
        self.ended_now(a)  # killed: no row written, its heartbeat and its lease left behind
        # Only a commit whose rows went up can be in flight: the uploader sends them first (uploader.py).
        if then == "kill in flight" and a.pending is not None and a.rows_sent == a.pending and a.lease.generation:
            if (a.lease.generation, a.pending) not in self.fenced:  # (not the PUT sent as it was killed)
                self.fenced.append((a.lease.generation, a.pending))

    def train_one_step(self, m: int, kill_at_commit: bool = False) -> None:
        a = self.attempts[m]
        before = None if a.lease.held else self.lease_now()
        try:
            a.lease.keeper.tick()
            if before is not None and a.lease.held:
                self.took(a.lease, before, "late")  # the lease thread took it (the first request had blipped)
        except LeaseLost:
            self.end(m, release=False)  # exit 75
            return
        except Exception:
            a.lease.lapsed()
        self.note_generation(a)
        if a.stopping:
            self.end(m)
            return
        a.ledger.mark_first_step()
        a.step += 1
        a.trained += 1
        with open(a.machine.disk / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": a.step, "loss": 1.0 / a.step}) + "\n")
        a.ledger.heartbeat(a.step)  # the loop's log step
        CheckpointManager(a.machine.root, keep_last=KEEP_LAST).save(
            a.step, lambda tmp: (tmp / ADAPTER).write_bytes(_bytes(a.step))
        )
        a.ledger.checkpointed()
        a.pending = a.step
        self.upload(m, kill_at_commit)

    def upload(self, m: int, kill_at_commit: bool = False) -> None:
        """The uploader's turn for the pending step (`kill_at_commit`: the machine dies as the manifest's PUT,
        past the lease's and the floor's checks, is on the wire: Killed, and the PUT lands later)."""
        a = self.attempts[m]
        if a.pending is None:
            return
        path = CheckpointManager(a.machine.root).step_dir(a.pending)
        if kill_at_commit:

            def in_flight(store: Store, local: Path, path: str) -> None:
                assert a.lease.generation is not None and a.pending is not None
                self.fenced.append((a.lease.generation, a.pending))
                raise Killed

            a.lease.put_new = in_flight  # type: ignore[method-assign]
        try:
            a.store.clean()
            # the uploader's order (trainer/restart/remote/uploader.py): the rows up to this step before its commit
            a.store.put(a.machine.disk / "metrics.jsonl", "metrics.jsonl")
            a.rows_sent = a.pending
            a.store.upload(path, a.pending)
            a.store.prune(KEEP_LAST)
            a.pending = None
            a.uploader._push_run_files()  # after each upload, as the uploader does (its ledger before its heartbeat)
            self.pushed(a)
        except StoreAhead:
            self.end(m)  # save locally, exit 143
        except SafetyViolation as e:
            self.violations.append(f"vm{m} uploading step {a.pending}: {e}")
            self.end(m)
        except LeaseLost:
            self.end(m, release=False)
        except Killed:
            raise
        except Exception:
            pass  # a fault of the moment (an outage, cut off): the uploader retries, training goes on

    def end(self, m: int, release: bool = True) -> None:
        a = self.attempts.pop(m)
        if a.machine.bad_reads > 1:
            a.machine.bad_reads = 0
        a.ledger.close("preempted")  # every exit but a kill writes the row (trainer/training/run.py `_finish`)
        if a.pending is None:  # RemoteRun.close: the run files follow when the uploads caught up
            self.push_run_files(a)
        self.ended_now(a)
        if release:
            a.lease.release()
        a.lease.keeper.stop()

    def ended_now(self, a: Attempt) -> None:
        self.events += 1
        a.ended = self.events
        a.held_at_end = a.lease.held
        self.ended.append(a)

    def push_run_files(self, a: Attempt) -> None:
        try:
            a.uploader._push_run_files()
        except Exception:
            return  # best effort, as the uploader's first push and RemoteRun.close are
        self.pushed(a)

    def pushed(self, a: Attempt) -> None:
        """`a` pushed its run files: it reached the store, and every attempt owed a row that ended before `a`
        started is due (its trace reached `a`: through its disk, the store's heartbeat or the lease)."""
        if a.trained > 0:
            a.reached_store = True
        for e in self.ended:
            if e.ended is not None and e.ended < a.started and e.owed():
                self.due.setdefault(e.key, e)

    @precondition(lambda self: self.fenced)
    @rule()
    def late_write_lands(self) -> None:
        """A killed (fenced) holder's request in flight lands now, past every check it made."""
        generation, step = self.fenced.pop(0)
        store = Store(self.url)
        now = self.lease_now()
        if (
            now is not None
            and int(now["generation"]) > generation
            and self.machine_of.get(now.get("holder")) is not None
        ):
            self.saw("a fenced holder's late write lands after the lease changed hands")
        body = json.dumps({"format": 1, "step": step, "files": {ADAPTER: _entry(step)}}).encode()
        store.fs.makedirs(store.step_path(step), exist_ok=True)
        store.fs.pipe_file(store.step_path(step, ADAPTER), _bytes(step))
        store.fs.pipe_file(store.step_path(step, MANIFEST), stamped(body, generation))

    # ------------------------------------------------------------------ faults

    def time_passes(self) -> None:
        """Longer than a lease: a killed holder's lease may be taken over by another machine, a silent live
        holder's lapses (it was paused, or its renewals did not arrive)."""
        self.clock.now += TTL + 1

    FAULTS = (
        "time passes",
        "outage",
        "store back",
        "corrupt read",
        "bad fresh machine",
        "stale listing",
        "wipe disk",
        "rot",
        "resume=never",
    )

    @rule(kind=st.sampled_from(FAULTS), m=st.integers(0, MACHINES - 1), data=st.data())
    def fault(self, kind: str, m: int, data: st.DataObject) -> None:
        """One fault of the world (one rule, so that attempts start and train as often as faults happen)."""
        machine = self.machines[m]
        if kind == "time passes":
            self.time_passes()
        elif kind in ("outage", "store back"):
            self.outage = kind == "outage"
        elif kind == "corrupt read":  # bad RAM for a moment: this machine's next object read comes back wrong
            machine.bad_reads = 1
        elif (
            kind == "bad fresh machine"
        ):  # a new VM whose every read is wrong (bad RAM, bad tmpfs) until it is replaced
            if m not in self.attempts:
                shutil.rmtree(machine.disk, ignore_errors=True)
                machine.bad_reads = 10**6
        elif kind == "stale listing":  # its next listing is its last one again (an attribute cache, a lagging gateway)
            machine.stale = True
        elif kind == "wipe disk":  # the machine is replaced by a fresh one, its disk gone
            if m not in self.attempts:
                shutil.rmtree(machine.disk, ignore_errors=True)
                machine.bad_reads = 0
        elif kind == "resume=never":  # the user asks for a new run: the next start carries resume=never
            self.never_asked = True
        elif kind == "rot" and self.truth():  # the store's own bytes of a committed checkpoint go bad
            step = data.draw(st.sampled_from(self.truth()))
            store = Store(self.url)
            store.fs.pipe_file(store.step_path(step, ADAPTER), b"\x00" * 64)
            self.really_corrupt.add(step)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def nothing_paid_for_goes(self) -> None:
        assert not self.violations, self.violations
        committed = self.truth()
        newest = committed[-1] if committed else -1
        if newest < self.newest and not self.user_reset:
            went = {s for s in range(newest + 1, self.newest + 1)}
            assert went & self.really_corrupt, (
                f"the store's newest committed step went down from {self.newest} to {newest} ({committed})"
            )
        self.newest = newest
        self.user_reset = False

    @invariant()
    def every_committed_step_has_its_metrics_row(self) -> None:
        if not BOOKS_INVARIANTS or self.outage:
            return
        body = Store(self.url).read_run_file("metrics.jsonl") or b""
        logged = {json.loads(x)["step"] for x in body.splitlines() if x.strip()}
        committed = self.truth()
        newest = committed[-1] if committed else 0
        assert all(s in logged for s in range(1, newest + 1)), (newest, sorted(logged))

    @invariant()
    def every_attempt_that_trained_has_its_ledger_row(self) -> None:
        """Every attempt that trained, has ended and left a trace in the store (`Attempt.owed`) has exactly one
        row, by attempt id, in the store's ledger (every generation's copy merged) once a later attempt, started
        after it ended, has pushed its run files; and no attempt ever has two rows there."""
        if not BOOKS_INVARIANTS or self.outage:
            return
        body = Store(self.url).read_run_file("ledger.jsonl") or b""
        keys = [attempt_key(json.loads(x)) for x in body.splitlines() if x.strip()]
        twice = {k for k in keys if keys.count(k) > 1}
        assert not twice, f"an attempt booked twice in the store's ledger: {twice}"
        missing = [k for k in self.due if k not in keys]
        assert not missing, (
            f"no ledger row in the store for attempts {missing} that trained (or were killed starting) and ended"
        )


def _entry(step: int) -> dict[str, Any]:
    import hashlib

    data = _bytes(step)
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


TMP: list[str] = []


def _search(examples: int) -> settings:
    """The same search every time (derandomized), `examples` sequences of up to 10 rules."""
    return settings(
        max_examples=examples,
        stateful_step_count=10,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: the failing sequence prints as found
    )


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_no_interleaving_of_faults_loses_a_committed_step(tmp_path: Path) -> None:
    TMP[:] = [str(tmp_path)]
    SEEN.clear()
    run_state_machine_as_test(Model, settings=_search(int(os.environ.get("SPOTUNE_MODEL_EXAMPLES", "40"))))
    # The search reaches the lease changing hands between machines (a killed holder's, taken over by another
    # machine) and the lease thread taking it late (the first request blipped): a change that lost these
    # sequences fails here. The sequences written out below cover the rest (a late write after a takeover...).
    reached = " / ".join(sorted(SEEN))
    assert any("from a killed holder on another machine" in k for k in SEEN), reached
    assert any(k.endswith(", late") for k in SEEN), reached


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_the_books_invariant_fails_when_killed_attempts_go_unbooked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: with the booking of killed attempts switched off (recover_killed books nothing, wherever it
    is called: the ledger's open, the fetch of the run files, the late hand-over), the model finds an attempt
    that trained and has no row."""
    from trainer.restart.books import ledger
    from trainer.restart.remote import run, run_files

    def book_nothing(run_dir: Any, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        if kw.get("leftover", True):
            (Path(run_dir) / ledger.HEARTBEAT_FILE).unlink(missing_ok=True)  # the heartbeat is dropped unbooked
        return []

    for module in (ledger, run_files, run):
        monkeypatch.setattr(module, "recover_killed", book_nothing)
    TMP[:] = [str(tmp_path)]
    with pytest.raises(AssertionError, match="no ledger row in the store"):
        run_state_machine_as_test(Model, settings=_search(40))


class Pick:
    """A rule's `data` in a written sequence: it draws the machine named."""

    def __init__(self, m: int) -> None:
        self.m = m

    def draw(self, strategy: Any) -> int:
        return self.m


@contextlib.contextmanager
def _play(tmp_path: Path, *moves: tuple[str, Any]) -> Iterator[Model]:
    """Run the model through the rules `moves` (name, arguments) in order, every invariant checked after each,
    as the search does; yields the model for the sequence's own checks, then tears it down."""
    TMP[:] = [str(tmp_path)]
    model = Model()
    try:
        model.begin()
        for name, args in [("", ()), *moves]:
            if name:
                getattr(model, name)(*args)
            model.nothing_paid_for_goes()
            model.every_committed_step_has_its_metrics_row()
            model.every_attempt_that_trained_has_its_ledger_row()
        yield model
    finally:
        model.teardown()


def test_a_killed_holders_lease_is_taken_over_by_another_machine_and_its_late_write_is_fenced(tmp_path: Path) -> None:
    """vm0 holds the run and is killed with step 5's manifest on the wire; a replacement, vm1 with a fresh disk,
    comes up past the lease's ttl, takes the lease over (generation 2), books vm0's attempt from the lease,
    resumes from step 4; vm0's late write lands; vm1 trains to step 7 and stops: nothing lost, both booked."""
    SEEN.clear()
    with _play(
        tmp_path,
        ("train", (Pick(0), 1, "kill in flight")),
        ("start", (1, False, True)),
        ("late_write_lands", ()),
        ("train", (Pick(1), 3, "stop")),
    ) as model:
        committed, body = model.truth(), Store(model.url).read_run_file("ledger.jsonl") or b""
    killed, taker = model.ended
    assert (killed.machine.index, taker.machine.index) == (0, 1)
    assert (killed.generations, taker.generations) == ({1}, {2})
    assert SEEN == {
        "lease taken over from a killed holder on another machine, at start": 1,
        "a fenced holder's late write lands after the lease changed hands": 1,
    }
    assert committed == [6, 7] and taker.trained == 3
    rows = {attempt_key(json.loads(x)): json.loads(x) for x in body.splitlines() if x.strip()}
    assert rows[killed.key]["exit_reason"] == "killed" and rows[taker.key]["exit_reason"] == "preempted"


def test_an_attempt_whose_first_lease_request_blipped_reads_the_store_again_when_it_takes_the_lease(
    tmp_path: Path,
) -> None:
    """vm1 starts while vm0 holds the run and its first lease request blips: it chooses step 4 without the
    lease. vm0 commits 5 to 7 and releases; vm1's lease thread takes the lease (generation 2) and, before its
    first write, reads the store again: it is ahead, so vm1 stops (StoreAhead) without writing, and the next
    start resumes from step 7."""
    SEEN.clear()
    with _play(
        tmp_path,
        ("start", (1, True, False)),
        ("train", (Pick(0), 3, "stop")),
        ("train", (Pick(1), 1, "go on")),
    ) as model:
        committed = model.truth()
    holder, blipped = model.ended
    assert blipped.machine.index == 1 and blipped.generations == {2} and blipped.trained == 1
    assert blipped.store.floor.ahead is not None and "step 7" in blipped.store.floor.ahead
    assert SEEN == {"lease released, late": 1}
    assert committed == [6, 7]


def _killed_while_starting(tmp_path: Path) -> tuple[list[bytes], Model]:
    """vm0 holds the run and is killed; vm1 comes up past the lease's ttl, takes the lease over (generation
    2), chooses, and is killed while it loads the model, before its ledger opens: the lease it holds is the
    only trace of the time it cost. vm0 comes back past the ttl, takes the lease over from vm1 (generation 3),
    trains a step and stops. Returns the store's ledger lines and the model."""
    with _play(
        tmp_path,
        ("train", (Pick(0), 1, "kill")),
        ("start", (1, False, True, True)),
        ("start", (0, False, True, False)),
        ("train", (Pick(0), 1, "stop")),
    ) as model:
        body = Store(model.url).read_run_file("ledger.jsonl") or b""
    return body.splitlines(), model


def test_an_attempt_killed_while_starting_is_booked_by_the_machine_that_takes_its_lease_over(tmp_path: Path) -> None:
    SEEN.clear()
    lines, model = _killed_while_starting(tmp_path)
    first, starting, last = model.ended
    assert starting.killed_starting and starting.generations == {2} and last.generations == {3}
    assert SEEN == {"lease taken over from a killed holder on another machine, at start": 2}
    rows = {attempt_key(json.loads(x)): json.loads(x) for x in lines if x.strip()}
    assert [rows[a.key]["exit_reason"] for a in (first, starting, last)] == ["killed", "killed", "preempted"]
    assert len(lines) == 3


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_the_books_invariant_fails_when_a_taken_over_lease_hands_over_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control of the takeovers: with the hand-over switched off (Handover.took_over carries no record of
    the holder it replaces), the attempt killed while starting, whose lease was its only trace, goes unbooked
    and the model's books invariant says so."""
    from trainer.restart.books.handover import Handover

    monkeypatch.setattr(Handover, "took_over", lambda self, current, own_id: None)
    with pytest.raises(AssertionError, match=r"no ledger row in the store for attempts \[\('id', '[0-9a-f]+'\)\]"):
        _killed_while_starting(tmp_path / "written")
    # The search finds it too (its first failing sequence comes within 60: the search stops there).
    TMP[:] = [str(tmp_path / "searched")]
    with pytest.raises(AssertionError, match="no ledger row in the store for attempts"):
        run_state_machine_as_test(Model, settings=_search(60))
