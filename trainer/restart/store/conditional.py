"""Conditional writes on a store, proven rather than assumed, and the clock leases are judged on.

S3 (and moto, MinIO, R2) refuse a PUT with `If-None-Match: *` when the object exists and one
with `If-Match: <etag>` when the object changed: that is what makes a lease a lock. Some
S3-compatible endpoints accept both headers and ignore them, which would leave two writers
unnoticed, so `conditional(store)` asks the store once, at the lease's first use: it writes a
probe object, then writes it again with each condition set so that it must be refused. A store
that lets either through is treated as having no conditional writes (the lease then re-reads
itself around every commit, trainer/restart/ownership/lease.py). So is one that refuses a conditional PUT with
any other answer than 412 (501 NotImplemented, a 400 for a header it does not know): that is no outage,
and the lease works without conditions; only a fault of the moment (trainer/faults.py) propagates. Non-S3
stores (a local directory, GCS through gcsfs, Azure) take the re-read path too; on a local directory a
plain write is a rename, so no reader ever sees half a lease.

s3fs resends a PUT after a timeout or a torn response; when the first one landed, the resend
is refused (412) although the write is ours. Callers settle that by reading the object back
(`read_object`) before concluding anything.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from trainer.atomic import write_bytes
from trainer.faults import answer, transient
from trainer.restart.store.lifecycle import Store

log = logging.getLogger(__name__)

PROBE_FILE = ".spotune-conditional-probe"
"""The object `conditional` writes to test the store (a few bytes; left in place)."""


class Refused(Exception):
    """A conditional write's precondition failed: the object was not what the writer expected."""


def precondition_failed(e: BaseException) -> bool:
    """Whether a conditional write was refused for its condition: s3fs turns 412 into FileExistsError
    (If-None-Match) or OSError (If-Match, its cause the ClientError); 409 ConditionalRequestConflict is S3's
    answer to two conditional writes at once. Read from the answer's status and code (trainer/faults.py)."""
    status, code = answer(e)
    return (
        isinstance(e, FileExistsError) or status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")
    )


def _s3(store: Store) -> bool:
    return hasattr(store.fs, "call_s3")


def conditional(store: Store) -> bool:
    """Whether `store` enforces If-None-Match / If-Match (probed once per Store; raises when unreachable)."""
    if store.conditional is None:
        store.conditional = _s3(store) and _probe(store)
    return store.conditional


def _probe(store: Store) -> bool:
    path = store.path(PROBE_FILE)
    etag = _put(store, path, b"spotune probe\n")
    for extra in ({"IfNoneMatch": "*"}, {"IfMatch": '"0-not-the-etag"'}):
        try:
            _put(store, path, b"spotune probe, must be refused\n", **extra)
        except Exception as e:
            if precondition_failed(e):
                continue
            if transient(e):  # no answer yet: the lease thread asks again
                raise
            log.warning(
                "spotune: %s answered a conditional write with %s (%s): taken as a store without conditional "
                "writes; the lease re-reads itself around every commit instead",
                store.shown,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            return False  # refused otherwise than by its condition: no conditional writes here
        return False  # accepted: the store ignores this condition
    return etag is not None


def _put(store: Store, path: str, body: bytes, **extra: str) -> str | None:
    bucket, key, _ = store.fs.split_path(path)
    put = store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **extra)
    return str(put["ETag"])


def read_object(store: Store, path: str) -> tuple[bytes, str] | None:
    """An object's bytes and its etag from one GET (a digest of the bytes where the store has no
    etag); None when it does not exist."""
    try:
        if _s3(store):
            return _s3_get(store, path)
        raw = store.fs.cat_file(path)
    except FileNotFoundError:
        return None
    return raw, hashlib.sha256(raw).hexdigest()


def _s3_get(store: Store, path: str) -> tuple[bytes, str]:
    """Body and ETag from one GET (two requests could pair one version's body with another's etag)."""
    from fsspec.asyn import sync

    fs: Any = store.fs
    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[bytes, str]:
        got = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with got["Body"] as stream:
            return await stream.read(), str(got["ETag"])

    return sync(fs.loop, get)


def write_object(store: Store, path: str, body: bytes, *, if_match: str | None = None, new: bool = False) -> str | None:
    """Put `body` at `path`; on a conditional store only if the object still has etag `if_match`
    (or, `new`, does not exist), raising Refused otherwise. Returns the new etag (None elsewhere).
    Without conditional writes the write is plain: callers re-read to find out who won."""
    if not conditional(store):
        if store.local:
            store.make_root()  # the lease is the first write: the run's folder, never its parent (the mount)
            write_bytes(Path(path), body)  # a rename: a reader (a taker polling) never sees a torn lease
        else:
            store.fs.pipe_file(path, body)
        return None
    extra: dict[str, str] = {"IfNoneMatch": "*"} if new else {"IfMatch": if_match} if if_match else {}
    try:
        return _put(store, path, body, **extra)
    except Exception as e:
        if extra and precondition_failed(e):
            raise Refused(str(e)) from e
        raise
