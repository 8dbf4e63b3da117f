"""`checkpoint.resume=never` in a used run directory starts a new run: nothing of the old one is read,
nothing of it is lost.

The old run's files are set aside, renamed and kept, before the attempt reads any of them: locally
into `<output_dir>/previous-run-<time>/`, in `checkpoint.remote` under `previous-run-<time>/` (every
generation's copy). So the new run writes a new config.yaml, pins hub data anew, opens new tracker
runs (trackers.json), starts its ledger and metrics from nothing, and `spotune chat`, `export` and
`status` read the new run. The old run's checkpoints are retired where they are, as for an explicit
checkpoint (trainer/restart/local/checkpoint.py `retire`, trainer/restart/store/lifecycle.py `retire`). Only the run's
own outputs move: the lock, the prepared data, the pilot and a saved estimate stay.

A request applies once. `resume=never` and `resume=<path>` in a job spec are rerun after every preemption
by the same command; the attempt that applied one records it (`resume_request` in its ledger row and
heartbeat, trainer/restart/books/ledger.py), and a start whose last attempt was started with the same request
(`rerun_of`: a row, or the heartbeat of one killed before its row) resumes the timeline that request began,
as `auto` does, and says so. A start whose last attempt carried no request, or another, applies it.

It is one step, `apply`, whose body states its order, taken on rank 0 once the store answered (called from
one place, trainer/restart/remote/run.py `connect`): applied already?, the store's checkpoints retired (a new
timeline), this disk's checkpoints retired and its files set aside, the store's run files set aside, the
request recorded. A store that does not answer stops the attempt (exit 143) before anything moved, so no
failure leaves the old checkpoints beside a new ledger for a later `auto` to resume.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.atomic import fsync_path
from trainer.model.reference import INIT_FILES
from trainer.restart.books.ledger import HEARTBEAT_FILE, LEDGER_FILE, chronological, recover_killed, row_from_progress
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.remote.uploader import RAN_OUT_FILE, RUN_FILES
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.transport import CHECKPOINTS

PREFIX = "previous-run-"
RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    LEDGER_FILE,
    HEARTBEAT_FILE,  # a killed attempt's heartbeat belongs to the old run
    "trackers.json",  # training/trackers.py IDS_FILE (a later stage: not importable here)
    RAN_OUT_FILE,
    "final",
    "compile",
    "tensorboard",
    "wandb",
    "report.html",
    "timeline.png",
    "hours.png",
    "loss.png",
    "throughput.png",
    "export",
    "merged",
    "init_adapter",  # the run's copy of adapter.init_from (trainer/model/reference.py INIT_DIR)
)
"""What a run writes into its directory (docs/run-directory.md), beside its checkpoints."""


def stamp() -> str:
    """The name both set-aside folders share (UTC, to the second)."""
    return PREFIX + time.strftime("%Y%m%dT%H%M%S", time.gmtime())


@dataclass
class Request:
    """`checkpoint.resume` as this start was given it, and what this start does with it (`apply`)."""

    setting: str = "auto"
    folder: str | None = None
    """resume=never: the folder the old run goes aside into (`stamp`; rank 0's name on every node)."""
    rerun: dict[str, Any] | None = None
    """The last attempt, started with `setting` already: this start resumes instead of applying it (`decide`)."""

    @classmethod
    def of(cls, setting: str) -> Request:
        return cls(setting, stamp() if setting == "never" else None)

    @property
    def new_run(self) -> str | None:
        """The folder the old run goes aside into when this start applies resume=never; else None."""
        return self.folder if self.rerun is None else None

    @property
    def acts_on(self) -> str:
        """The `checkpoint.resume` this attempt chooses its checkpoint by: `auto` for a request applied already."""
        return "auto" if self.rerun is not None else self.setting

    @property
    def recorded(self) -> str | None:
        """What this attempt's heartbeat and ledger row record (`resume_request`), so that a rerun resumes."""
        return None if self.setting == "auto" else self.setting

    def decide(
        self, ledgers: Iterable[bytes | None], heartbeats: Iterable[bytes | None], message: Callable[[str], None]
    ) -> None:
        """Rank 0: whether this start is a rerun of the one that applied the request (`rerun_of`; said once)."""
        if self.setting == "auto":
            return
        said = self.rerun is not None
        self.rerun = rerun_of(self.setting, ledgers, heartbeats)
        if self.rerun is not None and not said:
            message(f"spotune: {rerun_note(self.setting, self.rerun)}")


Files = Callable[[], tuple[list[bytes | None], list[bytes | None]]]
"""The ledgers and heartbeats a start reads to tell whether it is a rerun (this disk's, and the store's)."""


def apply(
    request: Request,
    store: Store | None,
    files: Files,
    here: Callable[[str], None] | None,
    message: Callable[[str], None],
) -> None:
    """Rank 0, once the store answered (or without one): `checkpoint.resume=never` or `=<path>`, applied once, in
    this order. Every other node sets its own disk aside after it (trainer/restart/remote/run.py `connect`)."""
    if request.setting == "auto":
        return
    # 1. Applied already? The run's last attempt carried this request: a rerun of the same command (after a
    #    preemption) resumes the timeline it began, as `auto` does (`Request.acts_on`), and nothing moves.
    request.decide(*files(), message)
    if store is not None:
        store.floor.new_timeline = store.floor.new_timeline and request.rerun is None
    folder = request.new_run
    if folder is None:  # a rerun, or resume=<path>: choose.py resumes from that path, nothing is set aside
        return
    # 2. A new timeline in the store: its checkpoints retired (renamed, kept), which the floor allows because
    #    the user asked (trainer/restart/store/safety.py).
    if store is not None:
        store.floor.choose(None, store.committed(), new_timeline=True, generation=store.fence.generation)
        retired = store.retire(-1)
        if retired:
            message(
                f"spotune: checkpoint.resume=never: set aside remote checkpoint(s) above step 0, kept as "
                f"{', '.join(f'{store.shown}/checkpoints/{name}' for name in retired)}"
            )
    # 3. This disk: its checkpoints retired, its run files set aside (`set_aside`).
    if here is not None:
        here(folder)
    # 4. The store's run files set aside: the new run writes its own config, ledger and metrics, and copies its
    #    init_from anew.
    if store is not None:
        moved = store.set_aside(RUN_FILES + INIT_FILES, folder)
        if moved:
            message(
                f"spotune: checkpoint.resume=never: a new run; the old run's files in {store.shown} are set "
                f"aside in {store.shown}/{folder}/ ({', '.join(moved)}): kept, never read by this run"
            )
    # 5. Recorded: this attempt's heartbeat and ledger row carry the request (`Request.recorded`, written by
    #    trainer/restart/books/ledger.py once the ledger opens), so step 1 finds it at the next start.


def set_aside(run_dir: Path, folder: str, unbooked: Sequence[dict[str, Any]] = ()) -> tuple[list[str], list[str]]:
    """Retire the old run's checkpoints (renamed `checkpoints/step-XXXXXX.retired-<time>`) and move its outputs
    of `run_dir` into `run_dir/folder`; the names moved there and the retired checkpoints' new names.
    `unbooked`: the old run's attempts its lease carried without a ledger row (trainer/restart/books/handover.py),
    booked into the ledger set aside, where they belong."""
    retired = CheckpointManager(run_dir / CHECKPOINTS).retire(after_step=-1)  # renamed where they are, kept
    present = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not present and not unbooked:
        return [], [p.name for p in retired]
    dest = run_dir / folder
    dest.mkdir(parents=True, exist_ok=True)
    for name in present:
        os.rename(run_dir / name, dest / name)
    if unbooked:
        recover_killed(dest, unbooked, before=time.time())
    fsync_path(dest)
    fsync_path(run_dir)
    return present, [p.name for p in retired]


APPLY_ENV = "SPOTUNE_APPLY_REQUEST"
"""Set to 1 by `spotune pilot`, which starts a new pilot run each time it is run (the same command): its
`checkpoint.resume=never` applies even when the pilot's last attempt carried it."""


def rerun_of(
    request: str, ledgers: Iterable[bytes | None], heartbeats: Iterable[bytes | None]
) -> dict[str, Any] | None:
    """The run's last attempt (of the rows of every `ledgers` copy and the attempts `heartbeats` describe,
    in the order they ran) when it was started with `request` (`checkpoint.resume=never` or a path): this
    start is a rerun of the same command, and the request, applied already, is not applied again. None:
    apply it (no attempt yet, or the last one was started without it, or APPLY_ENV says so)."""
    if os.environ.get(APPLY_ENV) == "1":
        return None
    rows: list[dict[str, Any]] = []
    for text in ledgers:
        for line in (text or b"").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a torn line
                continue
            if isinstance(row, dict) and isinstance(row.get("end"), str):
                rows.append(row)
    for beat in heartbeats:
        try:
            progress = json.loads(beat or b"null")
            if isinstance(progress, dict):
                rows.append(row_from_progress(progress, float(progress["heartbeat_time"]), keep_all=True))
        except (ValueError, KeyError, TypeError):  # unreadable: Ledger.open warns about it
            continue
    ordered = chronological(rows)
    last = ordered[-1] if ordered else None
    return last if last is not None and last.get("resume_request") == request else None


def local_files(run_dir: Path) -> tuple[list[bytes | None], list[bytes | None]]:
    """This disk's ledger and heartbeat, for `rerun_of`."""
    return [_read(run_dir / LEDGER_FILE)], [_read(run_dir / HEARTBEAT_FILE)]


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def rerun_note(request: str, last: dict[str, Any]) -> str:
    """What the log says when a request is not applied again."""
    return (
        f"checkpoint.resume={request} was applied by an earlier start of this command (the last attempt, "
        f"{last.get('attempt')}, started {last.get('start')} with it); this rerun resumes the timeline it began "
        "instead of applying it again. To start over once more, use a new output_dir (or, while the run is "
        "unfinished, start once with checkpoint.resume=auto in between)"
    )
