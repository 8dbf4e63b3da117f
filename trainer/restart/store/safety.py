"""The rule that keeps what a run paid for, stated once. Every `Store` method that deletes, moves,
uncommits or supersedes remote state asks it first (`Floor.allow*`, called by trainer/restart/store/lifecycle.py;
tests/test_safety.py checks each one does): pruning, replacing or committing a step, retiring, setting run
files aside, and `clean`, for a late manifest (judged on the raw manifests: a step this attempt saw
committed when it chose is never "late") and for an unfinished upload (`allow_unfinished`: no manifest, no
retired marker, no retire of its step left unfinished).

**No attempt deletes, uncommits or supersedes a committed remote checkpoint, ledger row or metrics
row above the step it resumed from, unless the user asked for a new timeline** (`checkpoint.resume=never`
or a checkpoint path: the newer checkpoints are then retired, their manifest renamed, their data kept).
**A checkpoint found corrupt is retired too, never deleted**, and only once a second download into a
fresh directory agreed (trainer/restart/remote/choose.py): one machine's bad RAM, disk or tmpfs must not cost
the run its newest steps.

How each kind of remote state is kept:
- Ledger and metrics rows are never deleted at all: each lease generation writes its own copy and
  readers merge the rows of every copy (trainer/restart/store/generations.py), so no write can drop one.
- A checkpoint is "committed" while its manifest is visible to readers (`Store.committed`, the
  generation rule). An action supersedes a checkpoint when it makes that manifest invisible: deleting
  or renaming it, or committing a newer generation's manifest below it. So the store asks with the
  committed steps before and after the action; a step that would go out of sight must not be one
  this attempt protects.
- What this attempt protects: every committed step above the step it resumed from (`resumed`), except
  those it committed itself (`mine`). A step found corrupt stays protected from deletion and from being
  superseded; it may only be retired (renamed, kept). Before the attempt chose (`resumed` unknown) every
  committed step is protected. Of a protected step about to go out of sight, the floor tells two cases
  apart by what the store held committed when the attempt chose (`seen`): a step it saw is a breach of
  the rule (`SafetyViolation`, a bug); a step it did not see was written by another machine after that
  listing (a listing taken before the lease, a stale one, a fenced holder's late write that landed
  first): the store is ahead of this attempt (`StoreAhead`, below). A manifest already out of sight (a
  late write, by the generation rule) may be removed unless this attempt saw it committed.

The floor is one per attempt and belongs to one lease generation (`generation`: the fence's when it
chose; None for a listing made without the lease). Before any write (`ready`) it reads the store's
committed steps again when it could not read them at start (`seen` None) or when the fence's generation
is not its own (the lease was taken, or taken back, since it chose): a committed step above the one it
resumed from that it did not see and did not write means another machine trained further meanwhile.
Then nothing is written, ever (`StoreAhead`), the attempt is asked to stop (`on_ahead`: save locally,
exit 143) and the next attempt resumes from the store's newest. `allow` refuses (`SafetyViolation`) a
verdict asked under another generation than the floor's: the store reads the floor again right before.

A breach is a bug in spotune, not a fault of the world: `SafetyViolation` (an AssertionError) stops
the write before it happens and names the step.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Collection, Iterable

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.local.checkpoint import MANIFEST


class SafetyViolation(AssertionError):
    """A store write would delete, uncommit or supersede what this attempt must keep (a bug)."""


class StoreAhead(RuntimeError):
    """The store holds a checkpoint newer than the step this attempt resumed from while it could not
    read the store: another machine trained further. Nothing is written; the attempt stops (exit 143)."""

    exit_code = EXIT_PREEMPTED


class Floor:
    """What one attempt may take out of sight in the store: the rule above, for one attempt.

    `Floor()` is a store used outside a training attempt (a test, a tool): before `choose` it protects
    every committed step, like an attempt that has not chosen yet."""

    def __init__(self) -> None:
        self.resumed: int | None = None
        """The step this attempt resumed from (-1: step 0); None until it chose."""
        self.seen: frozenset[int] | None = None
        """The committed steps of the store when it chose; None: the store could not be read then."""
        self.corrupt: frozenset[int] = frozenset()
        """Steps found corrupt twice (a second download agreed) when it chose: retired, never deleted."""
        self.mine: set[int] = set()
        """Steps this attempt committed itself (`committed`): it may prune or replace them."""
        self.generation: int | None = 0
        """The lease generation the floor was read under (the fence's; 0: no lease; None: not held)."""
        self.new_timeline = False
        """The user asked for one (resume=never or a path): newer checkpoints may be retired (renamed, kept)."""
        self.ahead: str | None = None
        """Why this attempt may write nothing more (the store was found ahead of it)."""
        self.on_ahead: Callable[[str], object] = lambda why: None
        """Called once when the store is found ahead (train: save locally, exit 143)."""
        self._lock = threading.Lock()

    def choose(
        self,
        resumed: int | None,
        seen: Iterable[int] | None,
        *,
        corrupt: Iterable[int] = (),
        new_timeline: bool = False,
        generation: int | None = 0,
    ) -> None:
        """Record the attempt's choice: the step it resumed from (None: step 0), the store's committed
        steps it saw (None: the store could not be read; `ready` reads them before the first write), those
        of them found corrupt, and the lease generation the listing was made under (`Fence.generation`)."""
        with self._lock:
            self.resumed = -1 if resumed is None else resumed
            self.seen = frozenset(seen) if seen is not None else None
            self.corrupt = frozenset(corrupt)
            self.new_timeline = new_timeline
            self.generation = generation

    def committed(self, step: int) -> None:
        """This attempt committed `step` (its own: pruning or replacing it later takes nothing paid for)."""
        with self._lock:
            self.mine.add(step)

    def protects(self, step: int) -> bool:
        if self.resumed is None:
            return True  # nothing chosen yet: everything committed stays
        return step > self.resumed and step not in self.mine

    def allow(
        self,
        action: str,
        before: Iterable[int],
        after: Iterable[int],
        *,
        retire: bool = False,
        hidden: bool = False,
        generation: int | None = 0,
    ) -> None:
        """Assert that `action`, which leaves the store's committed steps `after` where they were
        `before`, takes nothing out of sight that this attempt protects, under the lease `generation` the
        floor was read under. `retire`: the action renames and keeps (allowed for a new timeline the user
        asked for, and for a step found corrupt). `hidden`: the steps leaving are out of readers' sight
        already (late manifests): only one this attempt saw committed is refused. A protected step it did
        not see means the store is ahead of it: StoreAhead (stop, exit 143), not a bug."""
        with self._lock:
            if generation != self.generation:
                raise SafetyViolation(
                    f"{action} was judged under lease generation {generation}, but the floor was read under "
                    f"{self.generation}; refused: the store must be read again under the lease first"
                )
        gone = sorted(set(before) - set(after))
        if retire and self.new_timeline:
            return
        forbidden = [s for s in gone if self.protects(s) and not (retire and s in self.corrupt)]
        if hidden and self.resumed is not None:
            forbidden = [s for s in forbidden if self.seen is None or s in self.seen]
        if not forbidden:
            return
        unseen = [s for s in forbidden if self.seen is not None and s not in self.seen and s not in self.corrupt]
        if unseen and len(unseen) == len(forbidden):
            self._stop(
                f"the store holds committed step(s) {unseen}, newer than step {max(self.resumed or 0, 0)} this attempt "
                f"resumed from, which it did not see when it chose ({action} would take them out of sight): another "
                "machine wrote them meanwhile. Stopping before writing anything there; the next attempt resumes from "
                "the store's newest"
            )
        raise SafetyViolation(
            f"{action} would take committed step(s) {forbidden} out of the store, above step "
            f"{self.resumed} this attempt resumed from (committed when it chose: {sorted(self.seen or [])}, "
            f"corrupt: {sorted(self.corrupt)}); refused: nothing paid for is deleted"
            + ("; a checkpoint found corrupt is retired (kept), never deleted" if set(forbidden) & self.corrupt else "")
        )

    def allow_unfinished(self, where: str, names: Collection[str], retired: Collection[str]) -> None:
        """Assert that the step directory `where` (holding the objects `names`) is an upload killed
        midway, whose objects nobody paid for: no manifest commits it, no retired marker says its data is
        kept, and no retired folder of its step (`retired`) waits for the rest of a move."""
        markers = sorted(n for n in names if posixpath.basename(n).endswith(MANIFEST))
        if markers or retired:
            raise SafetyViolation(
                f"removing {where} as an unfinished upload would delete kept data (it holds {markers}, "
                f"retired beside it: {sorted(retired)}); refused: nothing paid for is deleted"
            )

    def allow_set_aside(self, what: str) -> None:
        """Assert that moving `what` (the run's rows) out of readers' sight, renamed and kept, is what the
        user asked for: a new run (`checkpoint.resume=never`)."""
        if not self.new_timeline:
            raise SafetyViolation(f"setting {what} aside is for a new run the user asked for (checkpoint.resume=never)")

    def ready(self, committed: Callable[[], list[int]], where: str, generation: int | None = 0) -> None:
        """Before a write under the lease `generation`: raise StoreAhead when this attempt may write
        nothing; read the store's committed steps (`committed`) again when the floor could not at start or
        was read under another generation (a listing made before the lease was taken, or before it was
        taken back), and stop there if the store holds a step above the one this attempt resumed from that
        it neither saw nor wrote."""
        with self._lock:
            if self.ahead is None and self.resumed is not None and (self.seen is None or generation != self.generation):
                steps = committed()
                known = (self.seen or frozenset()) | self.mine
                newer = [s for s in steps if s > self.resumed and s not in known]
                if not newer:
                    self.seen = frozenset(steps) | (self.seen or frozenset())
                    self.generation = generation
                    return
                self.ahead = (
                    f"{where} holds step {newer[-1]}, newer than step {max(self.resumed, 0)} this attempt resumed from "
                    + (
                        "while it could not read the store"
                        if self.seen is None
                        else "when it chose without holding the run's lease (or before it took it back)"
                    )
                    + ": another machine trained further meanwhile. Stopping before writing anything there; the "
                    "next attempt resumes from the store's newest"
                )
                self.on_ahead(self.ahead)
            if self.ahead is not None:
                raise StoreAhead(self.ahead)

    def _stop(self, why: str) -> None:
        """The store is ahead of this attempt: it writes nothing more there (StoreAhead), and stops."""
        with self._lock:
            if self.ahead is None:
                self.ahead = why
                self.on_ahead(why)
        raise StoreAhead(self.ahead or why)
