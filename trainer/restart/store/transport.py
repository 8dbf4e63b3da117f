"""The one seam between a run and where its checkpoints live remotely: a local directory or any fsspec
store (`s3://`, `gs://`, `az://`, `file://`), as a reader sees it. Nothing here deletes or commits: every
write is trainer/restart/store/lifecycle.py's `Store`, built on this.

The remote holds the same layout as `output_dir` (`checkpoints/step-XXXXXX/...` plus the run
files: config.yaml, ledger.jsonl, the ledger heartbeat, metrics.jsonl). A remote checkpoint exists
only once its manifest does (the commit rule, lifecycle.py). `Transport` names paths, proves at start
that these credentials may list, write and delete there (`check`), lists the committed steps, reads
run files, and downloads a checkpoint, verified (trainer/restart/store/verify.py) before `publish_dir`
renames it into place locally. What a failed request means is trainer/restart/store/errors.py's.

Credentials come from each backend's standard chain (for S3: env vars, profiles, instance
roles; `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for MinIO, R2 and friends, honoured by
botocore itself). Nothing here logs a URL without `redact`.
"""

from __future__ import annotations

import posixpath
import re
import shutil
from pathlib import Path
from typing import Any

from trainer.atomic import fsync_tree, publish_dir, temp_sibling, write_bytes
from trainer.restart.local.checkpoint import MANIFEST
from trainer.restart.store.errors import StoreDenied, StoreError, StoreUnreachable, install_hint, meaning
from trainer.restart.store.generations import current_steps, manifest_generation, newest_run_file, read_run_file
from trainer.restart.store.verify import Corrupt, check_digest, check_size, manifest_files
from trainer.urls import redact

CHECKPOINTS = "checkpoints"
WRITE_PROBE = ".spotune-write-probe"
"""The object `Transport.check` writes and deletes at start, to prove these credentials may."""
_STEP = re.compile(r"^step-(\d{6,})$")
_models: Any = None
"""botocore's loader of service models, shared by every S3 session this process makes (`_share_models`)."""


def _share_models(fs: Any) -> None:
    """Give an s3fs filesystem that would make its own aiobotocore session one that reads botocore's service
    models through a loader shared by the process: a new session parses S3's model and the endpoint data again
    (~175 ms of CPU), and every Store is a new filesystem. The session still resolves the endpoint and the
    credentials itself, from the environment of the moment. A session with options of its own (a `profile`)
    is left to s3fs."""
    global _models
    if type(fs).__name__ != "S3FileSystem" or getattr(fs, "session", False) is not None or getattr(fs, "kwargs", True):
        return
    from aiobotocore.session import AioSession

    session = AioSession()
    if _models is None:
        _models = session.get_component("data_loader")
    else:
        session.register_component("data_loader", _models)
    fs.session = session


class Transport:
    """Checkpoints and run files under one remote root, read."""

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
        _share_models(self.fs)
        self.root = self.root.rstrip("/")
        self.local = not is_object_store(self.fs)
        """A directory of this machine's filesystem (`file://`, a mount), not an object store."""

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
            if is_object_store(self.fs):
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
        """What a failed request `action` to this store means (trainer/restart/store/errors.py `meaning`):
        StoreUnreachable, StoreDenied naming the setting to fix, or None when the error is not the store's."""
        return meaning(e, action, self.url, self.root)

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

    # ------------------------------------------------------------------ reading

    def run_file(self, rel: str) -> str | None:
        """The copy of run file `rel` of the highest generation; None if there is none."""
        return newest_run_file(self.fs, self.path(rel))

    def read_run_file(self, rel: str) -> bytes | None:
        """Run file `rel` as readers see it: every generation's rows merged for the ledger and the
        metrics, the newest copy for the others (trainer/restart/store/generations.py); None if absent."""
        return read_run_file(self.fs, self.path(rel))

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
            files = manifest_files(tmp / MANIFEST, self.show(step, MANIFEST))
            self.fs.invalidate_cache()
            for rel, want in sorted(files.items()):
                url = self.show(step, rel)
                try:
                    size = self.fs.size(self.step_path(step, rel))
                except FileNotFoundError:
                    raise Corrupt(f"{url}: missing") from None
                check_size(url, size, want)  # before the bytes travel
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self.step_path(step, rel), str(dest))
                check_digest(url, dest, want)
            fsync_tree(tmp)
            publish_dir(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fault = self.fault(e, "read") if isinstance(e, Exception) else None
            if fault is not None and not isinstance(fault, StoreUnreachable):  # the caller retries the transient
                raise fault from e
            raise
        return final


def is_object_store(fs: Any) -> bool:
    """Object stores have no directories to create (and `makedirs` on a bucket would create the bucket)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol not in ("file", "local")
