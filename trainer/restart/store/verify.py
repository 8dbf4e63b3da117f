"""A remote checkpoint's bytes checked against its manifest before anything trusts them: each object's size
(before its bytes travel) and sha256 (once they arrived). `Corrupt` is the one reason to skip a checkpoint;
it names the object's URL (redacted). The download itself is trainer/restart/store/transport.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.local.checkpoint import file_digest
from trainer.restart.store.errors import StoreError


class Corrupt(StoreError):
    """A remote checkpoint's bytes disagree with its manifest (a hash or size mismatch, a missing object):
    the one reason to skip a checkpoint. Not retried, but the next attempt reads the store again (143)."""

    exit_code = EXIT_PREEMPTED


def manifest_files(path: Path, url: str) -> dict[str, Any]:
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("lists no files")
        return files
    except (ValueError, KeyError, TypeError) as e:
        raise Corrupt(f"{url}: unreadable ({type(e).__name__}: {e})") from None


def check_size(url: str, size: int, want: dict[str, Any]) -> None:
    """An object's size as the store lists it against its manifest entry `want`: checked before the bytes travel."""
    if size != want.get("size"):
        raise Corrupt(f"{url}: {size} bytes, the manifest says {want.get('size')}")


def check_digest(url: str, local: Path, want: dict[str, Any]) -> None:
    """A downloaded object's bytes (`local`) against its manifest entry `want`: size and sha256."""
    if file_digest(local, fsync=False) != (want["size"], want.get("sha256")):
        raise Corrupt(f"{url}: sha256 differs from the manifest (corrupted)")
