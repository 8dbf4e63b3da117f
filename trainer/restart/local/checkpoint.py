"""Crash-consistent step checkpoints: save, discover, verify, prune, choose one to resume.

A checkpoint exists only once committed. `save` writes into `step-XXXXXX.tmp-<random>`,
fsyncs every file, writes `MANIFEST.json` (size and sha256 of each file) last and fsyncs
it, renames the directory to `step-XXXXXX` and fsyncs the parent. A kill at any moment
leaves either the previous set of committed checkpoints or that set plus the new one;
leftover temp directories are never read and are removed by `clean_stale` at the next
start. Old checkpoints are pruned only after the new one is committed.

What goes *into* a checkpoint is `trainer.restart.local.state.write_training_state`; this module only
knows files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.atomic import REPLACED, TEMP_MARK, files_below, fsync_path, publish_dir, restore_replaced, temp_sibling
from trainer.exit_codes import EXIT_BAD_INPUT
from trainer.restart import defaults

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
PAUSE_ENV = "SPOTUNE_TEST_SAVE_PAUSE"
"""Test hook: seconds to sleep halfway through fsyncing a save, before the manifest exists."""
_COMMITTED = re.compile(r"^step-(\d{6,})$")
_TEMP = re.compile(r"^step-\d{6,}\.tmp-")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that exists can be trusted."""

    exit_code = EXIT_BAD_INPUT


class ResumeMismatch(CheckpointError):
    """The checkpoint was written for another dataset or structural config."""


@dataclass(frozen=True)
class SaveResult:
    path: Path
    seconds: float
    bytes: int
    skipped: bool = False
    """True when this step was already committed and verified, so nothing was written."""


def save_step_due(step: int, every_steps: int | None, total_steps: int) -> bool:
    """When a save is due by steps: at each `checkpoint.every_steps` step, and at the run's last.
    The loop saves by this and `save_time_due` (and on a stop); the planner counts saves by both."""
    return bool(every_steps and step % every_steps == 0) or step >= total_steps


def save_time_due(seconds_since_save: float, every_minutes: float | None) -> bool:
    """When a save is due by time: `checkpoint.every_minutes` have passed since the last save."""
    return every_minutes is not None and seconds_since_save >= 60 * every_minutes


def file_digest(path: Path, fsync: bool) -> tuple[int, str]:
    """(size, sha256) of a file; with `fsync`, also force its data to disk (one pass over it)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


class CheckpointManager:
    """Step checkpoints under `root` (usually `<output_dir>/checkpoints`)."""

    def __init__(self, root: Path | str, keep_last: int = defaults.KEEP_LAST) -> None:
        if keep_last < 2:
            raise ValueError(f"checkpoint.keep_last must be at least 2, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self._committed_here: set[int] = set()
        """Steps this manager committed; only those may be skipped when saved again."""

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    @staticmethod
    def step_of(path: Path) -> int:
        m = _COMMITTED.match(Path(path).name)
        if not m:
            raise ValueError(f"{path} is not a step-XXXXXX checkpoint directory")
        return int(m.group(1))

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest step first (verification not implied)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and _COMMITTED.match(p.name)]
        return sorted(found, key=self.step_of)

    def retire(self, after_step: int) -> list[Path]:
        """Set aside (rename, never delete) the committed checkpoints above `after_step`.

        A run that restarts its timeline (resume=never, or an explicit older checkpoint) must
        not leave newer checkpoints of the abandoned timeline committed: they would count
        toward keep_last and a later resume=auto would jump back to them.
        """
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        moved = []
        for p in self.committed():
            if self.step_of(p) > after_step:
                dest = p.with_name(f"{p.name}.retired-{stamp}")
                os.rename(p, dest)
                moved.append(dest)
        if moved:
            fsync_path(self.root)
        return moved

    def clean_stale(self) -> list[Path]:
        """Remove temp directories of saves that never committed; returns what was removed. A committed
        copy that a save replacing it had moved aside (killed between its renames) is put back first."""
        if not self.root.is_dir():
            return []
        for p in list(self.root.iterdir()):
            if p.is_dir() and _TEMP.match(p.name) and f"{TEMP_MARK}{REPLACED}-" in p.name:
                restore_replaced(p.parent / p.name.split(TEMP_MARK)[0])
        stale = sorted(p for p in self.root.iterdir() if p.is_dir() and _TEMP.match(p.name))
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return stale

    # ------------------------------------------------------------------------ verify

    def verify(self, path: Path | str) -> list[str]:
        """Problems with a committed checkpoint, each naming the file and the reason; [] = good."""
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            return [f"{MANIFEST}: missing (the save never finished)"]
        try:
            manifest = json.loads(manifest_path.read_text())
            files: dict[str, Any] = manifest["files"]
            if not isinstance(files, dict) or not files:
                raise ValueError("lists no files")
        except (ValueError, KeyError, TypeError) as e:
            return [f"{MANIFEST}: unreadable ({type(e).__name__}: {e})"]
        problems = []
        step = manifest.get("step")
        if _COMMITTED.match(path.name) and step != self.step_of(path):
            problems.append(f"{MANIFEST}: records step {step} but the directory is {path.name}")
        for rel, want in sorted(files.items()):
            f = path / rel
            if not f.is_file():
                problems.append(f"{rel}: missing")
                continue
            size = f.stat().st_size
            if size != want.get("size"):
                problems.append(f"{rel}: {size} bytes, the manifest says {want.get('size')} (truncated or overwritten)")
                continue
            if file_digest(f, fsync=False)[1] != want.get("sha256"):
                problems.append(f"{rel}: sha256 differs from the manifest (corrupted)")
        return problems

    def latest_verified(self) -> tuple[Path | None, list[str]]:
        """Newest committed checkpoint that verifies, and a message for each newer one skipped.

        Raises CheckpointError when checkpoints exist but none verifies: silently starting
        again at step 0 would throw the run away.
        """
        messages: list[str] = []
        candidates = self.committed()
        for path in reversed(candidates):
            problems = self.verify(path)
            if not problems:
                return path, messages
            messages.append(f"checkpoint {path} is corrupt, skipped: " + "; ".join(problems))
        if candidates:
            raise CheckpointError(
                "no checkpoint under {} verifies:\n  {}\nRestore a good copy, or set checkpoint.resume=never "
                "(or use a new output_dir) to start over.".format(self.root, "\n  ".join(messages))
            )
        return None, messages

    # ------------------------------------------------------------------------ save

    def save(self, step: int, write: Callable[[Path], None]) -> SaveResult:
        """Write checkpoint `step` atomically with `write(temp_dir)`, then prune old ones."""
        start = time.perf_counter()
        final = self.step_dir(step)
        if step in self._committed_here and final.is_dir() and not self.verify(final):
            # Same step saved twice by this run (the final save right after an interval save):
            # the state at a given step is the same, so the committed copy stands. A copy left
            # by another run (say one started with resume=never) is replaced, never trusted.
            return SaveResult(final, 0.0, sum(f.stat().st_size for f in files_below(final)), skipped=True)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(final)  # os.urandom: no RNG stream consumed
        try:
            tmp.mkdir()
            write(tmp)
            total = self._seal(tmp, step)
            publish_dir(tmp, final)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            previous = [p.name for p in self.committed()]
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            where = getattr(e, "filename", None) or tmp
            raise CheckpointError(
                f"saving checkpoint step {step} into {tmp} failed: {reason} ({where}); the temp "
                f"directory was removed and the previous checkpoints are untouched "
                f"({', '.join(previous) or 'none'}). Free disk space or fix permissions under {self.root}."
            ) from e
        except BaseException:  # KeyboardInterrupt/SystemExit: clean up, never wrap
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._committed_here.add(step)
        pruned = self.prune(protect=final)
        if pruned:
            log.debug("pruned %s", ", ".join(p.name for p in pruned))
        return SaveResult(final, time.perf_counter() - start, total)

    def _seal(self, tmp: Path, step: int) -> int:
        files = files_below(tmp)
        if not files:
            raise CheckpointError(f"the checkpoint writer put no files into {tmp}")
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        entries: dict[str, dict[str, Any]] = {}
        for i, f in enumerate(files):
            if pause and i == len(files) // 2:
                time.sleep(pause)
            size, digest = file_digest(f, fsync=True)
            entries[f.relative_to(tmp).as_posix()] = {"size": size, "sha256": digest}
        manifest = {"format": 1, "step": step, "created": time.time(), "files": entries}
        with open(tmp / MANIFEST, "w") as out:
            json.dump(manifest, out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        fsync_path(tmp)  # the directory entries themselves
        return sum(e["size"] for e in entries.values()) + (tmp / MANIFEST).stat().st_size

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Delete committed checkpoints beyond the newest `keep_last` (never `protect`)."""
        committed = self.committed()
        doomed = [p for p in committed[: max(0, len(committed) - self.keep_last)] if p != protect]
        for p in doomed:
            # Rename first so a kill mid-delete leaves a temp name, not a half-deleted "committed" dir.
            aside = temp_sibling(p, "pruned")
            os.rename(p, aside)
            shutil.rmtree(aside, ignore_errors=True)
        return doomed


# ---------------------------------------------------------------------------- resume


def resolve_resume(root: Path | str, resume_setting: str, *, clean: bool = True) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from for `checkpoint.resume` (`auto`, `never` or a path).

    Returns (directory or None, messages worth logging). Raises CheckpointError when an
    explicit path does not verify, or when checkpoints exist and none verifies.
    """
    manager = CheckpointManager(root, keep_last=2)
    messages: list[str] = []
    if clean:
        messages += [f"removed unfinished save {p}" for p in manager.clean_stale()]
    if resume_setting == "never":
        if clean:  # one rank (the main one) renames; the others only read
            messages += _retired("checkpoint.resume=never: starting at step 0", manager.retire(after_step=-1))
        return None, messages
    if resume_setting == "auto":
        path, skipped = manager.latest_verified()
        return path, messages + skipped
    path = Path(resume_setting)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.resume: {path} is not a directory (use auto, never or a step-XXXXXX directory)"
        )
    problems = manager.verify(path)
    if problems:
        raise CheckpointError(f"checkpoint.resume: {path} does not verify: " + "; ".join(problems))
    if clean and _COMMITTED.match(path.name):
        messages += _retired(
            f"checkpoint.resume={path}: continuing from step {manager.step_of(path)}",
            manager.retire(after_step=manager.step_of(path)),
        )
    return path, messages


def _retired(what: str, moved: list[Path]) -> list[str]:
    if not moved:
        return []
    return [
        f"{what}; set aside {len(moved)} newer checkpoint(s) of the abandoned timeline "
        f"({', '.join(p.name for p in moved)}): kept on disk, never resumed from, delete them when done"
    ]
