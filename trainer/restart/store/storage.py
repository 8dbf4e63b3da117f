"""The one seam between a run and where its checkpoints live remotely: a local directory or
any fsspec store (`s3://`, `gs://`, `az://`, `file://`).

The remote holds the same layout as `output_dir` (`checkpoints/step-XXXXXX/...` plus the run
files: config.yaml, ledger.jsonl, the ledger heartbeat, metrics.jsonl). Object stores have no
rename, so the commit rule is the manifest: `upload` puts every file of a committed local
checkpoint first and `MANIFEST.json` last, so a remote checkpoint exists only once its
manifest does; `prune` deletes the manifest first, so a kill mid-prune leaves an object set
nobody trusts, and `clean` removes such leftovers later. Downloads are verified (size and
sha256 from the manifest) before `publish_dir` renames them into place locally.

Credentials come from each backend's standard chain (for S3: env vars, profiles, instance
roles; `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for MinIO, R2 and friends, honoured by
botocore itself). Nothing here logs a URL without `redact`.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from trainer.atomic import files_below, fsync_tree, publish_dir, temp_sibling, write_bytes
from trainer.exit_codes import EXIT_PREEMPTED, class_code
from trainer.faults import Permanent, Transient, Verdict, classify
from trainer.restart.local.checkpoint import MANIFEST, CheckpointError, file_digest
from trainer.restart.store.generations import (
    current_steps,
    manifest_generation,
    newest_run_file,
    read_run_file,
    run_file_copies,
    run_file_key,
    stamped,
)
from trainer.restart.store.safety import Floor
from trainer.urls import one_line, redact

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKPOINTS = "checkpoints"
RETIRED = "RETIRED-" + MANIFEST
"""The manifest of a set-aside remote checkpoint (resume=never or an older explicit one), whose objects then
move to `step-XXXXXX.retired-<time>/`: kept, never resumed, never cleaned."""
RETIRED_SUFFIX = ".retired-"
"""Between a retired checkpoint's step directory name and the time it was retired."""
WRITE_PROBE = ".spotune-write-probe"
"""The object `Store.check` writes and deletes at start, to prove these credentials may."""
UPLOAD_PAUSE_ENV = "SPOTUNE_TEST_UPLOAD_PAUSE"
"""Test hook: seconds to sleep halfway through uploading a checkpoint, before its manifest."""
_STEP = re.compile(r"^step-(\d{6,})$")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}


class StoreError(CheckpointError):
    """The remote store cannot be reached, or it holds something that cannot be trusted."""


class StoreUnreachable(StoreError, Transient):
    """The store does not answer (or answers with a fault of the moment: 5xx, throttling, a broken
    transfer) and training cannot go on without it: `spotune train` exits 143 (restartable), not 2."""


class StoreDenied(StoreError, Permanent):
    """The store refused a request for a reason rerunning will not change (trainer/faults.py): these
    credentials, a permission, no such bucket or folder, this machine's clock, a full store, a request it does
    not implement. A setting the user must fix (exit 2); the message names it."""


class Corrupt(StoreError):
    """A remote checkpoint's bytes disagree with its manifest (a hash or size mismatch, a missing object):
    the one reason to skip a checkpoint. Not retried, but the next attempt reads the store again (143)."""

    exit_code = EXIT_PREEMPTED


class StoreOffline(StoreError, Transient):
    """This attempt is cut off from the store (its lease could not be renewed in time): it writes
    nothing there until the lease is confirmed again (trainer/restart/ownership/lease.py); uploads retry."""


def install_hint(url: str) -> str:
    extra = _EXTRA.get(urlsplit(url).scheme)
    return f"pip install 'spotune[{extra}]'" if extra else "install the fsspec backend for this URL"


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


class Store:
    """Checkpoints and run files under one remote root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.shown = redact(self.url)
        try:
            # A fresh instance: fsspec caches filesystems per options, and a cached one would
            # keep an endpoint or credentials the environment no longer holds.
            self.fs, self.root = url_to_fs(self.url, skip_instance_cache=True, **dict(storage_options or {}))
        except ImportError as e:
            raise StoreError(
                f"checkpoint.remote={self.shown}: the backend for this URL is not installed ({e}); {install_hint(url)}"
            ) from e
        self.root = self.root.rstrip("/")
        self.local = not _is_object_store(self.fs)
        """A directory of this machine's filesystem (`file://`, a mount), not an object store."""
        self.fence = Fence()  # a Lease while a training attempt holds the run (trainer/restart/ownership/lease.py)
        self.conditional: bool | None = None
        """Whether the store enforces If-Match / If-None-Match; probed once (trainer/restart/store/conditional.py)."""
        self.floor = Floor()
        """What this attempt may take out of sight here (trainer/restart/store/safety.py); set when it chooses its step."""

    # ------------------------------------------------------------------ paths

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def step_path(self, step: int, *rel: str) -> str:
        return self.path(CHECKPOINTS, f"step-{step:06d}", *rel)

    def show(self, step: int, rel: str = "") -> str:
        """The redacted URL of a checkpoint (or one of its objects), for messages."""
        return posixpath.join(self.shown, CHECKPOINTS, f"step-{step:06d}", rel) if rel else self.show_dir(step)

    def show_dir(self, step: int) -> str:
        return posixpath.join(self.shown, CHECKPOINTS, f"step-{step:06d}")

    # ------------------------------------------------------------------ reachability

    def check(self) -> None:
        """Raise StoreDenied (a setting to fix) or StoreUnreachable (a fault of the moment) unless these
        credentials may list the store, and write and delete in it: a real probe write, so a store that
        lists and reads but refuses writes is named at start, not found out by uploads that never land.
        A local directory (`file://`) must exist up to its parent: a missing mount is never made on this
        machine's own disk (it would look empty, and a fresh machine would train from step 0 into it)."""
        try:
            self.fs.invalidate_cache()
            if _is_object_store(self.fs):
                # A listing under the run's own prefix, never the bucket's root: a role may be scoped to its
                # prefix (s3:prefix), and a shared bucket's other keys are none of this run's business. An
                # empty prefix lists nothing; a missing bucket answers FileNotFoundError (NoSuchBucket), as
                # a HeadBucket would, which a prefix-scoped role may not send.
                self.fs.find(self.root, prefix=WRITE_PROBE, detail=False)
            else:
                self.make_root()
        except StoreDenied:
            raise
        except Exception as e:
            self.raise_fault(e, "list")
        probe = self.path(WRITE_PROBE)
        for action, request in (
            ("write", lambda: self.fs.pipe_file(probe, b"spotune write probe\n")),
            ("delete", lambda: self.fs.rm_file(probe)),
        ):  # its own probe object, nothing else
            try:
                request()
            except Exception as e:
                self.raise_fault(e, action)

    def make_root(self) -> None:
        """A local directory store: make the run's own folder, in a parent folder that must exist (a mount, a
        shared disk); StoreDenied naming it if not. The first write there (the lease's) asks this too."""
        parent = posixpath.dirname(self.root)
        if not self.fs.isdir(parent):
            raise StoreDenied(
                f"checkpoint.remote={self.shown}: the folder {parent} does not exist. A file:// store is a folder "
                "every machine of the run mounts (NFS, a shared disk); spotune never creates its parent, since a "
                "missing mount would then be a folder on this machine's own disk that dies with it. Mount it, or "
                "create the folder, or fix the path in checkpoint.remote"
            )
        self.fs.makedirs(self.root, exist_ok=True)

    def raise_fault(self, e: BaseException, action: str) -> None:
        """Raise what a failed request `action` means (`fault`), from `e`; `e` itself when it is not the store's."""
        fault = self.fault(e, action)
        if fault is None:
            raise e
        raise fault from e

    def fault(self, e: BaseException, action: str) -> StoreError | None:
        """What a failed store request `action` means, by the one classifier (trainer/faults.py):
        StoreUnreachable (exit 143) for a fault of the moment; StoreDenied (exit 2) naming the setting to fix
        for anything else the store answered, known or not (permanent unless known to be transient); None when
        the error is not the store's: spotune's own (it has its code), a bug, or a file of this machine
        outside the store (its disk full or refused). The caller then raises it as it is."""
        verdict = classify(e)
        if verdict.transient:
            return StoreUnreachable(
                f"checkpoint.remote={self.shown} is unreachable ({action}: {type(e).__name__}: {one_line(e)}; "
                f"{verdict}). Check the network, the endpoint (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 for "
                f"S3-compatible stores) and the credentials (the cloud's standard chain: env vars, profile, instance "
                f"role); checkpoint.storage_options passes anything else to fsspec"
            )
        if isinstance(e, StoreError) or class_code(e) is not None or verdict.kind == "bug" or _elsewhere(e, self.root):
            return None
        return StoreDenied(
            f"checkpoint.remote={self.shown}: {action} refused ({type(e).__name__}: {one_line(e)}; {verdict}). "
            + self._fix(verdict, action)
            + ". Rerunning unchanged fails the same way (exit 2)"
        )

    def _fix(self, verdict: Verdict, action: str) -> str:
        """The setting a permanent refusal asks the user to fix, by its kind."""
        need = _permission(self.url, action)
        chain = "the cloud's standard chain: env vars, profile, instance role"
        if verdict.kind == "clock":
            return (
                "This machine's clock is off by more than the store allows (clock skew): sync it (chrony, ntpd, "
                "systemd-timesyncd); no permission or setting of spotune changes it"
            )
        if verdict.kind == "credentials":
            return (
                f"The store does not accept the credentials this machine uses ({chain}): set valid ones (a key that "
                "exists, is not expired and matches its secret), or pass them in checkpoint.storage_options"
            )
        if verdict.kind == "missing":
            return (
                f"The bucket (or container, or folder) of {self.shown} does not exist: check the bucket name in "
                "checkpoint.remote (and the endpoint, AWS_ENDPOINT_URL, for S3-compatible stores)"
            )
        if verdict.kind == "full":
            return (
                f"The store is full (its disk or its quota): free space there or raise the quota; checkpoint.keep_last "
                f"sets how many checkpoints of the run {self.shown} keeps"
            )
        if verdict.kind == "unsupported":
            return (
                "The store does not implement this request: checkpoint.remote must name an S3-, GCS- or "
                "Azure-compatible store that does (check the endpoint, AWS_ENDPOINT_URL, and "
                "checkpoint.storage_options)"
            )
        if verdict.kind == "request":
            return (
                f"The store refused the request as invalid: check checkpoint.remote ({self.shown}: the bucket name and "
                "path) and checkpoint.storage_options (region, endpoint)"
            )
        return (
            f"The credentials this machine uses ({chain}) lack {need} on {self.shown}/*, or the bucket does not "
            "exist; a run needs list, read, write and delete there"
            + ("; check the bucket name" if action == "list" else "")
            + "; checkpoint.storage_options passes anything else to fsspec"
        )

    # ------------------------------------------------------------------ listing

    def _listing(self) -> dict[str, set[str]]:
        """Folder name under checkpoints/ -> names of the objects below it."""
        self.fs.invalidate_cache()
        base = self.path(CHECKPOINTS)
        try:
            entries = self.fs.find(base, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[str, set[str]] = {}
        for entry in entries:
            rel = posixpath.relpath(entry, base).split("/")
            if len(rel) > 1:
                out.setdefault(rel[0], set()).add("/".join(rel[1:]))
        return out

    def _step_dirs(self, listing: dict[str, set[str]] | None = None) -> dict[int, set[str]]:
        """step -> names of the objects in its directory."""
        listing = self._listing() if listing is None else listing
        return {int(m.group(1)): names for folder, names in listing.items() if (m := _STEP.match(folder))}

    def _manifests(self) -> dict[int, int]:
        """step -> the generation its remote manifest records (0: none), for every manifest there."""
        steps = sorted(step for step, names in self._step_dirs().items() if MANIFEST in names)
        out = {}
        for step in steps:
            try:
                out[step] = manifest_generation(self.fs.cat_file(self.step_path(step, MANIFEST)))
            except FileNotFoundError:  # pruned between the listing and the read
                continue
        return out

    def committed(self) -> list[int]:
        """Steps whose manifest exists remotely and is no fenced holder's late write (the rule in
        trainer/restart/store/generations.py), oldest first (verification not implied)."""
        return current_steps(self._manifests())

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

    # ------------------------------------------------------------------ transfer

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
            if there.get("files") == manifest["files"] and not replace:  # these very bytes are committed there
                return 0  # (a resumed checkpoint caught up after a start that could not see the store)
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
        if not _is_object_store(self.fs):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)

    def run_file(self, rel: str) -> str | None:
        """The copy of run file `rel` of the highest generation; None if there is none."""
        return newest_run_file(self.fs, self.path(rel))

    def read_run_file(self, rel: str) -> bytes | None:
        """Run file `rel` as readers see it: every generation's rows merged for the ledger and the
        metrics, the newest copy for the others (trainer/restart/store/generations.py); None if absent."""
        return read_run_file(self.fs, self.path(rel))

    def put(self, local: Path, rel: str) -> int:
        """Upload one run file (config.yaml, ledger.jsonl, ...) to `<remote>/<rel>.gen-<generation>`
        (the plain name without a lease); 0 if absent. Other generations' copies stay: readers merge
        the rows of every copy, so none is ever lost."""
        if not local.is_file():
            return 0

        def write() -> None:  # the generation is read after the fence let the write through
            key = run_file_key(self.path(rel), self.fence.generation or 0)
            self._parent_of(key)  # a run file in a folder (init_adapter/): a local store makes it
            self.fs.put_file(str(local), key)

        self.writable()
        if rel in COMMITTED_RUN_FILES:
            self.fence.commit(write)
        else:
            write()
        self.fence.pushed(rel)
        return local.stat().st_size

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

    def get(self, rel: str, local: Path) -> bool:
        """Download one run file as readers see it (`read_run_file`) if the remote has it; False when not."""
        body = self.read_run_file(rel)
        if body is None:
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(local, body)
        return True

    def download(self, step: int, local_root: Path) -> Path:
        """Download remote checkpoint `step`, verify every file, publish it under `local_root`.

        Raises Corrupt naming the object's URL when the checkpoint does not verify (the one reason to
        skip it), StoreDenied when the store refused the read for good (`fault`); a fault of the moment
        propagates as it came (the caller retries it, trainer/faults.py `transient`, and nothing else).
        """
        local_root.mkdir(parents=True, exist_ok=True)
        final = local_root / f"step-{step:06d}"
        tmp = temp_sibling(final, "download")
        try:
            tmp.mkdir()
            self.fs.get_file(self.step_path(step, MANIFEST), str(tmp / MANIFEST))
            files = _manifest_files(tmp / MANIFEST, self.show(step, MANIFEST))
            self.fs.invalidate_cache()
            for rel, want in sorted(files.items()):
                url = self.show(step, rel)
                try:
                    size = self.fs.size(self.step_path(step, rel))
                except FileNotFoundError:
                    raise Corrupt(f"{url}: missing") from None
                if size != want.get("size"):  # checked before the bytes travel
                    raise Corrupt(f"{url}: {size} bytes, the manifest says {want.get('size')}")
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self.step_path(step, rel), str(dest))
                if file_digest(dest, fsync=False) != (want["size"], want.get("sha256")):
                    raise Corrupt(f"{url}: sha256 differs from the manifest (corrupted)")
            fsync_tree(tmp)
            publish_dir(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fault = self.fault(e, "read") if isinstance(e, Exception) else None
            if fault is not None and not isinstance(fault, StoreUnreachable):  # the caller retries the transient
                raise fault from e
            raise
        return final


def _retired_folders(listing: dict[str, set[str]], step: int) -> list[str]:
    """The folders a retire moved (or is moving) checkpoint `step` to, oldest first."""
    return sorted(f for f in listing if f.startswith(f"step-{step:06d}{RETIRED_SUFFIX}"))


def _manifest_files(path: Path, url: str) -> dict[str, Any]:
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("lists no files")
        return files
    except (ValueError, KeyError, TypeError) as e:
        raise Corrupt(f"{url}: unreadable ({type(e).__name__}: {e})") from None


def _is_object_store(fs: Any) -> bool:
    """Object stores have no directories to create (and `makedirs` on a bucket would create the bucket)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol not in ("file", "local")


def _elsewhere(e: BaseException, root: str) -> bool:
    """Whether `e` is an OSError naming a file outside the store's `root`: this machine's own (a local
    destination of a download), not the store's (whose errors name none, or a path under the root for a
    local-directory store)."""
    name = e.filename if isinstance(e, OSError) else None
    if not isinstance(name, str):
        return False
    name, root = posixpath.normpath(name), posixpath.normpath(root).rstrip("/")
    return name != root and not name.startswith(root + "/")


_PERMISSIONS = {
    "s3": {"list": "s3:ListBucket", "read": "s3:GetObject", "write": "s3:PutObject", "delete": "s3:DeleteObject"},
    "gcs": {
        "list": "storage.objects.list",
        "read": "storage.objects.get",
        "write": "storage.objects.create",
        "delete": "storage.objects.delete",
    },
}


def _permission(url: str, action: str) -> str:
    """The permission a store `action` needs, in the cloud's own words."""
    kind = _EXTRA.get(urlsplit(url).scheme)
    if kind in _PERMISSIONS:
        return _PERMISSIONS[kind][action]
    if kind == "azure":
        return f"the {action} permission on blobs (the role Storage Blob Data Contributor grants it)"
    return f"{action} permission on the directory"
