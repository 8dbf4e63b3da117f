"""Content hashing and the atomic, reusable cache directory of a prepared dataset.

Layout: `<cache_root>/<fingerprint>/` holds `train/`, optionally `eval/`, and `manifest.json`
(plus `lengths.png` once `spotune inspect` has drawn it). A directory counts as complete only
when it sits at its final name AND holds manifest.json: it is built under
`<fingerprint>.tmp-<host>-<pid>-<rand>`, the manifest is written last and fsynced, then the
whole directory is renamed into place.
A killed prepare therefore leaves only a temp directory, which a later run removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from trainer.atomic import TEMP_MARK, fsync_path, fsync_tree, write_text
from trainer.data.tokenizer import file_names

T = TypeVar("T")

# Bump when the pipeline's output for the same inputs changes (template text, masking, packing).
# 5: preference layouts (hh-rlhf, alpaca, LLaMA-Factory, pre-templated), content parts, JSON rows as written.
# 6: each example records what seq_len costs its answers (answers_cut: trained tokens and ends of turn cut).
PIPELINE_VERSION = "6"
MANIFEST = "manifest.json"
_TMP = TEMP_MARK
_STALE_SECONDS = 24 * 3600  # temp dirs from another host or an unknown pid older than this are stale


def data_cache_root(cache_dir: str | None, output_dir: str) -> Path:
    """Where `prepare` caches packed data: `data.cache_dir`, else `<output_dir>/data`."""
    return Path(cache_dir) if cache_dir else Path(output_dir) / "data"


def in_turns(build: Callable[[], T], *, is_main: bool, is_local_main: bool, barrier: Callable[[], None]) -> T:
    """`build()` on every rank of a job, in three turns: rank 0 alone (a cache on a shared
    filesystem is then reused by everyone), then the first rank of every other node (a node
    with its own disk prepares once, not once per GPU), then the rest, each finding its node's
    cache. `barrier` is a collective: every rank calls it exactly twice."""
    built: list[T] = [build()] if is_main else []
    barrier()
    if not built and is_local_main:
        built.append(build())
    barrier()
    return built[0] if built else build()


def hash_path(path: Path, h: Any) -> None:
    """Feed a file's bytes, or every file of a directory (sorted, with relative names), into `h`."""
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.relative_to(path).as_posix().encode() + b"\0")
            _hash_file(f, h)
    else:
        _hash_file(path, h)


def _hash_file(path: Path, h: Any) -> None:
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    h.update(b"\0EOF\0")


def hash_tokenizer(tokenizer_dir: str, h: Any) -> None:
    """Hash the bytes of the tokenizer's files, chat template included (a hub tokenizer is a local
    folder by now: trainer/data/tokenizer.py), so another template or vocabulary is another fingerprint."""
    for f in file_names(Path(tokenizer_dir)):
        h.update(f.name.encode() + b"\0")
        _hash_file(f, h)


def fingerprint(data_paths: list[Path | None], tokenizer_path: str, settings: dict[str, Any]) -> str:
    """sha256 over data bytes, tokenizer files, every output-relevant setting and PIPELINE_VERSION."""
    h = hashlib.sha256()
    h.update(f"spotune-data-v{PIPELINE_VERSION}\0".encode())
    h.update(json.dumps(settings, sort_keys=True).encode() + b"\0")
    for p in data_paths:
        h.update(b"data\0" if p is not None else b"none\0")
        if p is not None:
            hash_path(p, h)
    hash_tokenizer(tokenizer_path, h)
    return h.hexdigest()[:24]


def load_complete(cache_root: Path, fp: str) -> dict[str, Any] | None:
    """The manifest of a complete cache entry, or None (incomplete entries are removed)."""
    final = cache_root / fp
    manifest = final / MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
            if data.get("fingerprint") == fp:
                return data
        except (OSError, ValueError):
            pass
    if final.exists():
        # Not ours to trust: only a rename of a finished temp dir creates this name.
        shutil.rmtree(final, ignore_errors=True)
    return None


def clean_stale(cache_root: Path) -> list[Path]:
    """Remove temp dirs left by killed prepares (dead pid on this host, or older than a day)."""
    removed: list[Path] = []
    if not cache_root.is_dir():
        return removed
    host = socket.gethostname()
    for d in cache_root.iterdir():
        if _TMP not in d.name or not d.is_dir():
            continue
        try:
            owner_host, pid_s, _ = d.name.split(_TMP, 1)[1].rsplit("-", 2)
            pid = int(pid_s)
        except ValueError:
            owner_host, pid = "", -1
        alive = owner_host == host and _pid_alive(pid)
        old = time.time() - d.stat().st_mtime > _STALE_SECONDS
        if not alive and (owner_host == host or old):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_build(cache_root: Path, fp: str) -> Iterator[Path]:
    """Yield a temp dir to fill; on success rename it to `<cache_root>/<fp>`, on error remove it.

    The body must write manifest.json last. If another process finished the same
    fingerprint first, its (identical) result is kept and ours is discarded.
    """
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f"{fp}{_TMP}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        if not (tmp / MANIFEST).is_file():
            raise RuntimeError(f"internal error: {tmp} has no {MANIFEST}; refusing to commit it")
        fsync_tree(tmp)  # the Arrow files too: a power cut must not leave a committed, empty cache
        try:
            os.rename(tmp, cache_root / fp)
        except OSError:
            if load_complete(cache_root, fp) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent prepare won the race
        fsync_path(cache_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json durably (the commit marker of a cache entry)."""
    write_text(directory / MANIFEST, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
