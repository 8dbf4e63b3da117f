"""The rule that keeps what a run paid for, stated once. Every `Store` method that deletes, moves,
uncommits or supersedes remote state asks it first (`Floor.allow*`, called by trainer/restart/storage.py;
tests/test_safety.py checks each one does): pruning, replacing or committing a step, retiring, setting run
files aside, and `clean`, for a late manifest (judged on the raw manifests: a step this attempt saw
committed when it chose is never "late") and for an unfinished upload (`allow_unfinished`: no manifest, no
retired marker, no retire of its step left unfinished).

**No attempt deletes, uncommits or supersedes a committed remote checkpoint, ledger row or metrics
row above the step it resumed from, unless the user asked for a new timeline** (`checkpoint.resume=never`
or a checkpoint path: the newer checkpoints are then retired, their manifest renamed, their data kept).

How each kind of remote state is kept:
- Ledger and metrics rows are never deleted at all: each lease generation writes its own copy and
  readers merge the rows of every copy (trainer/restart/generations.py), so no write can drop one.
- A checkpoint is "committed" while its manifest is visible to readers (`Store.committed`, the
  generation rule). An action supersedes a checkpoint when it makes that manifest invisible: deleting
  or renaming it, or committing a newer generation's manifest below it. So the store asks with the
  committed steps before and after the action; a step that would go out of sight must not be one
  this attempt protects.
- What this attempt protects: the steps the store held committed when it chose its resume step
  (`seen`) above that step (`resumed`), except those found corrupt (a hash mismatch is the only reason
  to skip, and so to replace, a checkpoint). A step this attempt committed itself, and a fenced holder's
  late write (never committed in a reader's eyes), are neither. Before the attempt chose
  (`resumed` unknown) every committed step is protected.

A store this attempt could not read when it chose (it started from a local checkpoint while the store
was unreachable) is read before the first write (`ready`): a committed step above the one it resumed
from means another machine trained further meanwhile. Then nothing is written, ever (`StoreAhead`),
the attempt is asked to stop (`on_ahead`: save locally, exit 143) and the next attempt resumes from
the store's newest.

A breach is a bug in spotune, not a fault of the world: `SafetyViolation` (an AssertionError) stops
the write before it happens and names the step.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Collection, Iterable

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.checkpoint import MANIFEST


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
    ) -> None:
        """Record the attempt's choice: the step it resumed from (None: step 0), the store's committed
        steps it saw (None: the store could not be read; `ready` reads them before the first write)."""
        with self._lock:
            self.resumed = -1 if resumed is None else resumed
            self.seen = frozenset(seen) if seen is not None else None
            self.corrupt = frozenset(corrupt)
            self.new_timeline = new_timeline

    def protects(self, step: int) -> bool:
        if self.resumed is None:
            return True  # nothing chosen yet: everything committed stays
        if step <= self.resumed or step in self.corrupt:
            return False
        return self.seen is None or step in self.seen

    def allow(self, action: str, before: Iterable[int], after: Iterable[int], *, retire: bool = False) -> None:
        """Assert that `action`, which leaves the store's committed steps `after` where they were
        `before`, takes nothing out of sight that this attempt protects. `retire`: the action renames
        and keeps (allowed when the user asked for a new timeline)."""
        gone = sorted(set(before) - set(after))
        if retire and self.new_timeline:
            return
        forbidden = [s for s in gone if self.protects(s)]
        if forbidden:
            raise SafetyViolation(
                f"{action} would take committed step(s) {forbidden} out of the store, above step "
                f"{self.resumed} this attempt resumed from (committed when it chose: {sorted(self.seen or [])}, "
                f"corrupt: {sorted(self.corrupt)}); refused: nothing paid for is deleted"
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

    def ready(self, committed: Callable[[], list[int]], where: str) -> None:
        """Before a write: raise StoreAhead when this attempt may write nothing; read the store's committed
        steps once when it could not at start (`committed`), and stop there if the store is ahead."""
        with self._lock:
            if self.ahead is None and self.resumed is not None and self.seen is None:
                steps = committed()
                newer = [s for s in steps if s > self.resumed]
                if not newer:
                    self.seen = frozenset(steps)
                    return
                self.ahead = (
                    f"{where} holds step {newer[-1]}, newer than step {max(self.resumed, 0)} this attempt resumed from "
                    "while it could not read the store: another machine trained further meanwhile. Stopping before "
                    "writing anything there; the next attempt resumes from the store's newest"
                )
                self.on_ahead(self.ahead)
            if self.ahead is not None:
                raise StoreAhead(self.ahead)
