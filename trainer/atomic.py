"""Durable, atomic files and directories: the one way spotune makes a write crash-consistent.

The rule everywhere (checkpoints, the data cache, `final/`, the tiny demo assets, the
ledger): write under a temporary name, fsync the data, rename into place, fsync the parent
directory. A kill at any moment leaves the old file, the new one, or a temp file that
nothing trusts; never a torn mix.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

TEMP_MARK = ".tmp-"
"""Infix of every temporary name made here; `<name>.tmp-*` siblings are never read."""
REPLACED = "replaced"
"""Tag of the old copy `publish_dir` moves aside (`<name>.tmp-replaced-*`): the one temp name that may be
the only copy left (a kill between its two renames), so cleaners restore it first (`restore_replaced`)."""

# Some filesystems (a few network and FUSE mounts) cannot fsync a directory; that is not an
# I/O error, so only these are tolerated. Everything else (EIO, ENOSPC) propagates.
_DIR_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EBADF}


def fsync_path(path: Path | str) -> None:
    """Force a file's (or a directory's entries') data to disk."""
    is_dir = os.path.isdir(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (is_dir and e.errno in _DIR_FSYNC_UNSUPPORTED):
            raise
    finally:
        os.close(fd)


def files_below(directory: Path) -> list[Path]:
    """Every file below `directory`, in a stable order."""
    return sorted(p for p in directory.rglob("*") if p.is_file())


def fsync_tree(directory: Path) -> None:
    """fsync every file below `directory`, then the directory itself."""
    for f in files_below(directory):
        fsync_path(f)
    fsync_path(directory)


def temp_sibling(final: Path, tag: str = "") -> Path:
    """A fresh temporary name beside `final` (`<name>.tmp-[tag-]<random>`), not created."""
    return final.with_name(f"{final.name}{TEMP_MARK}{tag + '-' if tag else ''}{secrets.token_hex(4)}")


def remove_temp_siblings(final: Path) -> list[Path]:
    """Remove leftover `<name>.tmp-*` siblings of `final` (unfinished writes); returns them."""
    restore_replaced(final)
    stale = sorted(final.parent.glob(f"{final.name}{TEMP_MARK}*")) if final.parent.is_dir() else []
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return stale


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written, fsynced directory into place and fsync the parent.

    An existing `final` (a corrupt or stale copy) is first moved aside under a temp name, so
    a kill at any moment leaves the old directory, the new one, or a temp directory that
    nothing trusts: never a mix of both.
    """
    if final.exists():
        aside = temp_sibling(final, REPLACED)  # a kill before the next rename: restore_replaced puts it back
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


def restore_replaced(final: Path) -> Path | None:
    """When `final` is missing and `publish_dir` had moved its old copy aside (killed between its two
    renames), rename that copy back: the old directory stands, as promised, and no cleaner of temp
    names deletes the only copy. Returns the copy restored. Readers still verify what it holds."""
    if final.exists() or not final.parent.is_dir():
        return None
    aside = sorted(final.parent.glob(f"{final.name}{TEMP_MARK}{REPLACED}-*"), key=lambda p: p.stat().st_mtime)
    if not aside:
        return None
    os.rename(aside[-1], final)
    fsync_path(final.parent)
    return aside[-1]


def write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically and durably."""
    write_bytes(path, text.encode())


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it. A kill can tear only this last line; readers skip a torn one.
    A torn last line (no newline: a kill mid-append) is ended first, so it never swallows this one."""
    with open(path, "a+b") as f:
        torn = f.seek(0, os.SEEK_END) > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
        f.write((b"\n" if torn else b"") + line.rstrip("\n").encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
