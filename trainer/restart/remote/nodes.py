"""Several nodes, one checkpoint: each node's disk is its own, so a node that lacks the exact checkpoint rank 0
resumes from (none, a corrupt copy, or the same step of an abandoned timeline) downloads it from the store,
which rank 0 makes sure holds it first (an attempt killed before its upload finished). Checkpoints are told
apart by the digest of their manifest's entries, directories by (kernel, device, inode).

Collective: every rank learns of a failure and raises the same error class (trainer/restart/agree.py), so no
node waits forever for one that gave up. Called by trainer/restart/remote/run.py `RemoteRun.resolve`.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart import agree
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager
from trainer.restart.remote.choose import download_confirmed, retrying
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.verify import Corrupt
from trainer.urls import redact

Directory = tuple[str, int, int]
"""Which directory a path is on one machine (`directory_of`)."""


@dataclass
class Copies:
    """What the nodes of one attempt do to share rank 0's checkpoint: publish it (rank 0), download it (a
    node that lacks it)."""

    url: str
    options: dict[str, Any]
    store: Store | None
    """Rank 0's store, when it answered at start (`RemoteRun.reachable`); None otherwise."""
    is_main: bool
    budget: float
    """Seconds a store fault is retried (checkpoint.store_retry_seconds)."""
    keep_last: int
    message: Callable[[str], None]

    def bring(self, path: Path, root: Path, step: int, digest: str, lacks: bool, notes: list[str]) -> None:
        """Collective: rank 0 makes sure the store holds its checkpoint `path` as step `step`, and each node
        that `lacks` it downloads it. A node that finds the store's copy corrupt (an object there that is
        not what the manifest lists: a fenced holder's late write under the same manifest) has rank 0 send
        it again, once: else every attempt would meet the same copy and exit 143 forever."""
        for replace in (False, True):
            problem = self._publish(path, step, digest, notes, replace=replace) if self.is_main else None
            problem = agree.broadcast(problem)
            corrupt = False
            if problem is None and lacks:
                problem, corrupt = self._fetch(root, step, digest)
                lacks = problem is not None  # a node that has it now does not download it again
            results = agree.gather((problem, corrupt))
            if not replace and any(found for _, found in results):
                if self.is_main:
                    self.message(f"spotune: a node found the store's step {step} corrupt: uploading it again")
                continue
            agree.raise_failure([failed for failed, _ in results])
            return

    def _publish(
        self, path: Path, step: int, digest: str, notes: list[str], *, replace: bool = False
    ) -> agree.Failure | None:
        """Rank 0: make sure the store holds `path` as step `step` for the nodes that lack it (`replace`: send
        it even when the store's manifest lists these bytes; a node found an object there corrupt)."""
        store = self.store
        if store is None:
            return (
                EXIT_PREEMPTED,
                f"rank 0 resumes from its local step {step}, other nodes lack it and checkpoint.remote="
                f"{redact(self.url or '')} was unreachable at start (exit 143: rerun once it answers)",
            )

        def publish() -> bool:
            if (
                not replace
                and step in store.committed()
                and manifest_digest(store.fs.cat_file(store.step_path(step, MANIFEST))) == digest
            ):
                return False
            store.upload(path, step, replace=replace)
            return True

        try:
            if not retrying(f"uploading step {step} to", self.budget, publish, self.message, store, action="write"):
                return None
        except Exception as e:
            return agree.failure(e)
        notes.append(
            f"uploaded {store.show_dir(step)} for the nodes that lack it (the last attempt stopped before its upload)"
        )
        return None

    def _fetch(self, root: Path, step: int, digest: str) -> tuple[agree.Failure | None, bool]:
        """A node's local main: download step `step` from the store; (None, or what went wrong; whether
        the store's copy was found corrupt)."""
        store = Store(self.url, self.options)
        notes: list[str] = []
        try:  # a corrupt verdict is confirmed by a second download before rank 0 acts on it (sends it again)
            path = retrying(
                f"downloading step {step} from",
                self.budget,
                lambda: download_confirmed(store, step, root, notes),
                self.message,
                store,
            )
        except Exception as e:
            code, text = agree.failure(e)
            return (code, f"rank {agree.rank()}: {text}"), isinstance(e, Corrupt)
        if files_digest(path) != digest:  # rank 0 published another copy meanwhile: a restart sorts it out
            return (
                EXIT_PREEMPTED,
                f"rank {agree.rank()}: {store.show_dir(step)} is not the checkpoint rank 0 resumes from",
            ), False
        self.message(f"spotune: rank {agree.rank()}: this node lacked step {step}; downloaded {store.show_dir(step)}")
        CheckpointManager(root, keep_last=self.keep_last).prune(protect=path)  # only rank 0 saves: no other prune
        return None, False


def manifest_digest(manifest: bytes) -> str:
    """sha256 over a checkpoint manifest's entries (every file's size and sha256): equal digests, equal
    bytes. The manifest's own timestamp (and the generation a remote one records) is left out."""
    files = json.loads(manifest)["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def files_digest(checkpoint: Path) -> str:
    """`manifest_digest` of a local committed checkpoint."""
    return manifest_digest((checkpoint / MANIFEST).read_bytes())


def directory_of(path: Path) -> Directory | None:
    """Which directory `path` is: equal on two ranks only when both read the very same one (the ranks of
    one node; one kernel's (device, inode), named by its boot id, or the host name where there is none)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        kernel = boot.read_text().strip() if boot.exists() else socket.gethostname()
        st = path.stat()
    except OSError:
        return None
    return kernel, st.st_dev, st.st_ino


def holds(root: Path, path: Path, digest: str) -> bool:
    """Whether this node's disk has the exact checkpoint rank 0 chose, and it verifies."""
    try:
        return path.is_dir() and files_digest(path) == digest and not CheckpointManager(root).verify(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False
