"""The store a run writes: the commit protocol, and what takes remote state out of sight (clean, prune,
retire, setting run files aside), each asking the safety rule first (trainer/restart/store/safety.py).

Object stores have no rename, so the commit rule is the manifest: `upload` puts every file of a committed
local checkpoint first and `MANIFEST.json` last (under the fence: the lease's generation, conditionally),
so a remote checkpoint exists only once its manifest does; `prune` deletes the manifest first, so a kill
mid-prune leaves an object set nobody trusts, and `clean` removes such leftovers later; `retire` uncommits
a checkpoint in place and moves it aside, kept. Every write asks the fence (one writer per run) and the
floor (nothing paid for is deleted) first. Reading, paths and listings are `Transport`'s
(trainer/restart/store/transport.py).
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from trainer.atomic import files_below
from trainer.restart.local.checkpoint import MANIFEST
from trainer.restart.store.errors import StoreUnreachable
from trainer.restart.store.generations import current_steps, run_file_copies, run_file_key, stamped
from trainer.restart.store.safety import Floor
from trainer.restart.store.transport import CHECKPOINTS, Transport, is_object_store

T = TypeVar("T")

RETIRED = "RETIRED-" + MANIFEST
"""The manifest of a set-aside remote checkpoint (resume=never or an older explicit one), whose objects then
move to `step-XXXXXX.retired-<time>/`: kept, never resumed, never cleaned."""
RETIRED_SUFFIX = ".retired-"
"""Between a retired checkpoint's step directory name and the time it was retired."""
UPLOAD_PAUSE_ENV = "SPOTUNE_TEST_UPLOAD_PAUSE"
"""Test hook: seconds to sleep halfway through uploading a checkpoint, before its manifest."""


class Fence:
    """What every write to the store asks first. This one lets everything through; a run's
    `restart.ownership.lease.Lease` refuses once another machine holds the run (one writer per run)."""

    @property
    def generation(self) -> int | None:
        """The lease generation every write carries (trainer/restart/store/generations.py); 0 = none."""
        return 0

    def check(self) -> None:
        """Raise when this process may no longer write to the store."""

    def commit(self, write: Callable[[], T]) -> T:
        """Run a write that commits something (a manifest, the ledger) under the fence."""
        return write()

    def put_new(self, store: Store, local: Path, path: str) -> None:
        """Upload a manifest (a lease makes it conditional on the object not existing yet)."""
        store.fs.put_file(str(local), path)

    def pushed(self, rel: str) -> None:
        """A run file reached the store (the lease learns that its attempt's ledger rows are safe)."""


COMMITTED_RUN_FILES = ("ledger.jsonl",)
"""Run files whose upload is a commit (the run's history): written under `Fence.commit`."""


class Store(Transport):
    """Checkpoints and run files under one remote root, written: under the fence, asking the floor."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.fence = Fence()  # a Lease while a training attempt holds the run (trainer/restart/ownership/lease.py)
        self.conditional: bool | None = None
        """Whether the store enforces If-Match / If-None-Match; probed once (trainer/restart/store/conditional.py)."""
        self.floor = Floor()
        """What this attempt may take out of sight here (trainer/restart/store/safety.py); set when it chooses its step."""

    # ------------------------------------------------------------------ the gate every write passes

    def writable(self) -> None:
        """Before any write: this attempt holds the run (the fence) and may write at all (the floor: a
        store found ahead of the step it resumed from takes nothing more; a floor read under another
        lease generation reads the store again first; trainer/restart/store/safety.py)."""
        self.fence.check()
        self.floor.ready(self.committed, self.shown, self.fence.generation)

    def _allow(self, action: str, before: list[int], after: list[int], **kw: bool) -> None:
        """The floor's verdict on an action, asked under the lease generation it was read under: the floor
        is brought up to the fence's generation first (`writable`), right before, so a lease taken (or taken
        back) since it chose never lets a listing made without it decide."""
        self.writable()
        self.floor.allow(action, before, after, generation=self.fence.generation, **kw)

    # ------------------------------------------------------------------ taking state out of sight

    def clean(self) -> list[int]:
        """Delete remote step directories that have no manifest (uploads killed midway), and those
        whose manifest is a fenced holder's late write (manifest first, as in `prune`), once this attempt
        chose its step (the floor refuses a late one it saw committed then). A directory
        with a retired sibling (`step-XXXXXX.retired-*`) is never taken for an unfinished upload: it may
        hold what a retire cut off midway has not moved yet (`retire` finishes it)."""
        manifests = self._manifests()
        current = current_steps(manifests)
        listing = self._listing()
        dirs = self._step_dirs(listing)
        doomed = sorted(s for s, names in dirs.items() if MANIFEST not in names and RETIRED not in names)
        doomed = [s for s in doomed if not _retired_folders(listing, s)]
        late = [s for s in manifests if s not in current]
        if not doomed and not late:
            return []
        # Judged on the raw manifests, not the current view (where a late one is absent by definition): a
        # "late" step this attempt saw committed when it chose means the generation rule was broken.
        self._allow("removing late manifests", sorted(manifests), [s for s in manifests if s not in late], hidden=True)
        for step in doomed:
            self.floor.allow_unfinished(self.show_dir(step), dirs[step], _retired_folders(listing, step))
        for step in late:
            self.fence.check()
            self.fs.rm_file(self.step_path(step, MANIFEST))
        for step in doomed + late:
            self.fence.check()
            self.fs.rm(self.step_path(step), recursive=True)
        return sorted(doomed + late)

    def retire(self, after_step: int, only: Collection[int] | None = None) -> list[str]:
        """Set aside remote checkpoints above `after_step` (`only`: those of these steps), kept: each is uncommitted first (its manifest
        renamed RETIRED-MANIFEST.json in place, one request), then moved to `step-XXXXXX.retired-<time>`
        object by object, that marker last, so the new timeline's checkpoint of the same step never
        overwrites its objects. Until its move ends the step's directory holds the marker: `clean` never
        takes it for an unfinished upload, and the next retire finishes the move into the same folder.
        Only for a new timeline the user asked for, or for checkpoints found corrupt (`only`; the floor
        checks they were confirmed). Returns the new names."""
        manifests = self._manifests()
        moved = [s for s in manifests if s > after_step and (only is None or s in only)]
        listing = self._listing()
        unfinished = [s for s, names in self._step_dirs(listing).items() if RETIRED in names and MANIFEST not in names]
        if not moved and not unfinished:
            return []
        before = current_steps(manifests)
        self._allow("retiring", before, [s for s in before if s not in moved], retire=True)
        for step in moved:
            self.fence.check()
            self.fs.mv(self.step_path(step, MANIFEST), self.step_path(step, RETIRED))
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        names = []
        for step in sorted({*moved, *unfinished}):
            # A move cut off midway goes on into its folder (the one whose marker has not arrived yet).
            started = [f for f in _retired_folders(listing, step) if RETIRED not in listing[f]]
            name = started[0] if started else f"step-{step:06d}.retired-{stamp}"
            self.fs.invalidate_cache()
            objects = sorted(self.fs.find(self.step_path(step), detail=False), key=lambda o: o.endswith("/" + RETIRED))
            for obj in objects:  # an object store moves object by object; the marker goes last
                self.fence.check()
                dest = self.path(CHECKPOINTS, name, posixpath.relpath(obj, self.step_path(step)))
                self._parent_of(dest)
                self.fs.mv(obj, dest)
            names.append(name)
        return names

    def prune(self, keep_last: int) -> list[int]:
        """Delete remote checkpoints beyond the newest `keep_last`, each manifest first."""
        committed = self.committed()
        doomed = committed[: max(0, len(committed) - keep_last)]
        if not doomed:
            return []
        self._allow("pruning", committed, committed[len(doomed) :])
        for step in doomed:
            self.fence.check()
            self.fs.rm_file(self.step_path(step, MANIFEST))  # from here on it does not exist
            self.fs.rm(self.step_path(step), recursive=True)
        return doomed

    # ------------------------------------------------------------------ the commit protocol

    def upload(self, local: Path, step: int, *, replace: bool = False) -> int:
        """Upload a committed local checkpoint directory, manifest last; returns bytes sent. `replace`:
        send it even when the store's manifest lists these very bytes (a download found an object there
        that disagrees with it: another writer's late object)."""
        manifest = json.loads((local / MANIFEST).read_text())
        files = [f for f in files_below(local) if f.name != MANIFEST or f.parent != local]
        pause = float(os.environ.get(UPLOAD_PAUSE_ENV, "0") or 0)
        self.fs.invalidate_cache()
        self.writable()
        if self.fs.exists(self.step_path(step, MANIFEST)):
            there = json.loads(self.fs.cat_file(self.step_path(step, MANIFEST)))
            if there.get("files") == manifest["files"] and not replace and step in self.committed():
                # These very bytes are committed there (a resumed checkpoint caught up after a start that could
                # not see the store, or a killed holder's late write of a step this attempt trained the same, by
                # exact resume): this attempt's own to prune later. A manifest out of readers' sight (a late one
                # above this generation's newest) is no commit: it is replaced below.
                self.floor.committed(step)
                return 0
            # The same step again with other bytes (a corrupt one replaced, or a step of a timeline the
            # user abandoned), or objects there found corrupt: uncommit it first, if the rule allows.
            before = self.committed()
            self._allow(f"replacing step {step}", before, [s for s in before if s != step])
            self.fs.rm_file(self.step_path(step, MANIFEST))
        sent = 0
        for i, f in enumerate(files):
            if pause and i == len(files) // 2:
                time.sleep(pause)
            rel = f.relative_to(local).as_posix()
            self._parent_of(self.step_path(step, rel))
            self.fence.check()
            self.fs.put_file(str(f), self.step_path(step, rel))
            sent += f.stat().st_size
        # What arrived is checked by size before the manifest makes it real (S3's ETag is no sha256;
        # the full sha256 check happens when a machine downloads it).
        self.fs.invalidate_cache()
        for rel, want in manifest["files"].items():
            size = self.fs.size(self.step_path(step, rel))
            if size != want["size"]:
                raise StoreUnreachable(f"{self.show(step, rel)}: {size} bytes arrived, {want['size']} were sent")
        with tempfile.TemporaryDirectory() as tmp:
            sent_manifest = Path(tmp) / MANIFEST

            def commit() -> None:  # the manifest as sent records the generation that lets it through
                # Judged under the fence's lock (a lease cannot change generation meanwhile): committing a newer
                # generation's manifest hides older generations' above it (the generation rule).
                manifests = self._manifests()
                after = {**manifests, step: self.fence.generation or 0}
                self._allow(f"committing step {step}", current_steps(manifests), current_steps(after))
                sent_manifest.write_bytes(stamped((local / MANIFEST).read_bytes(), self.fence.generation or 0))
                self.fence.put_new(self, sent_manifest, self.step_path(step, MANIFEST))
                self.floor.committed(step)

            self.fence.commit(commit)
            return sent + sent_manifest.stat().st_size

    def _parent_of(self, path: str) -> None:
        """Make the folder an object is about to move or upload into: a local directory has real folders
        (and moving into a missing one fails); an object store has none to make."""
        if not is_object_store(self.fs):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)

    def put(self, local: Path, rel: str) -> int:
        """Upload one run file (config.yaml, ledger.jsonl, ...) to `<remote>/<rel>.gen-<generation>`
        (the plain name without a lease); 0 if absent, or gone before it was read: its writer may remove
        it meanwhile (the heartbeat, when the attempt closes its ledger row), which is no fault of the store's.
        Other generations' copies stay: readers merge the rows of every copy, so none is ever lost."""
        try:
            found = local.stat()
        except FileNotFoundError:
            return 0
        if not stat.S_ISREG(found.st_mode):
            return 0

        def write() -> None:  # the generation is read after the fence let the write through
            key = run_file_key(self.path(rel), self.fence.generation or 0)
            self._parent_of(key)  # a run file in a folder (init_adapter/): a local store makes it
            self.fs.put_file(str(local), key)  # opened before anything is sent: a removal after that is read

        self.writable()
        try:
            if rel in COMMITTED_RUN_FILES:
                self.fence.commit(write)
            else:
                write()
        except FileNotFoundError:
            if local.exists():
                raise  # the store's (a missing bucket): trainer/faults.py decides what it means
            return 0  # removed between the check above and its upload: absent, nothing was sent
        self.fence.pushed(rel)
        return found.st_size

    def set_aside(self, names: tuple[str, ...], folder: str) -> list[str]:
        """A new run the user asked for (`checkpoint.resume=never`): move every generation's copy of the run
        files `names` under `<remote>/<folder>/`, kept; returns the objects moved."""
        present = {n: run_file_copies(self.fs, self.path(n)) for n in names}
        moved = [path for copies in present.values() for path in copies.values()]
        if not moved:
            return []
        self.writable()
        self.floor.allow_set_aside(f"the run files of {self.shown}")
        self._parent_of(self.path(folder, "-"))
        for path in moved:
            self.fence.check()
            self.fs.mv(path, self.path(folder, posixpath.basename(path)))
        return [posixpath.basename(p) for p in moved]


def _retired_folders(listing: dict[str, set[str]], step: int) -> list[str]:
    """The folders a retire moved (or is moving) checkpoint `step` to, oldest first."""
    return sorted(f for f in listing if f.startswith(f"step-{step:06d}{RETIRED_SUFFIX}"))
