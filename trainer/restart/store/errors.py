"""What a failed store request means, and the store's errors: a fault of the moment (StoreUnreachable, exit
143), a refusal rerunning will not change (StoreDenied, exit 2, naming the setting to fix in the cloud's own
words: the permission, the credentials, the bucket, the clock), or this attempt cut off (StoreOffline).

Whether an error is transient is trainer/faults.py's to say (the one classifier); this module turns its
verdict into the error a run ends with, and never logs a URL without `redact`.
"""

from __future__ import annotations

import posixpath
from urllib.parse import urlsplit

from trainer.exit_codes import class_code
from trainer.faults import Permanent, Transient, Verdict, classify
from trainer.restart.local.checkpoint import CheckpointError
from trainer.urls import one_line, redact

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


class StoreOffline(StoreError, Transient):
    """This attempt is cut off from the store (its lease could not be renewed in time): it writes
    nothing there until the lease is confirmed again (trainer/restart/ownership/lease.py); uploads retry."""


def install_hint(url: str) -> str:
    extra = _EXTRA.get(urlsplit(url).scheme)
    return f"pip install 'spotune[{extra}]'" if extra else "install the fsspec backend for this URL"


def meaning(e: BaseException, action: str, url: str, root: str) -> StoreError | None:
    """What a failed request `action` to the store at `url` (its path `root`) means, by the one classifier (trainer/faults.py):
    StoreUnreachable (exit 143) for a fault of the moment; StoreDenied (exit 2) naming the setting to fix
    for anything else the store answered, known or not (permanent unless known to be transient); None when
    the error is not the store's: spotune's own (it has its code), a bug, or a file of this machine
    outside the store (its disk full or refused). The caller then raises it as it is."""
    shown = redact(url)
    verdict = classify(e)
    if verdict.transient:
        return StoreUnreachable(
            f"checkpoint.remote={shown} is unreachable ({action}: {type(e).__name__}: {one_line(e)}; "
            f"{verdict}). Check the network, the endpoint (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 for "
            f"S3-compatible stores) and the credentials (the cloud's standard chain: env vars, profile, instance "
            f"role); checkpoint.storage_options passes anything else to fsspec"
        )
    if isinstance(e, StoreError) or class_code(e) is not None or verdict.kind == "bug" or _elsewhere(e, root):
        return None
    return StoreDenied(
        f"checkpoint.remote={shown}: {action} refused ({type(e).__name__}: {one_line(e)}; {verdict}). "
        + _fix(verdict, action, url)
        + ". Rerunning unchanged fails the same way (exit 2)"
    )


def _fix(verdict: Verdict, action: str, url: str) -> str:
    """The setting a permanent refusal asks the user to fix, by its kind."""
    need = _permission(url, action)
    shown = redact(url)
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
            f"The bucket (or container, or folder) of {shown} does not exist: check the bucket name in "
            "checkpoint.remote (and the endpoint, AWS_ENDPOINT_URL, for S3-compatible stores)"
        )
    if verdict.kind == "full":
        return (
            f"The store is full (its disk or its quota): free space there or raise the quota; checkpoint.keep_last "
            f"sets how many checkpoints of the run {shown} keeps"
        )
    if verdict.kind == "unsupported":
        return (
            "The store does not implement this request: checkpoint.remote must name an S3-, GCS- or "
            "Azure-compatible store that does (check the endpoint, AWS_ENDPOINT_URL, and "
            "checkpoint.storage_options)"
        )
    if verdict.kind == "request":
        return (
            f"The store refused the request as invalid: check checkpoint.remote ({shown}: the bucket name and "
            "path) and checkpoint.storage_options (region, endpoint)"
        )
    return (
        f"The credentials this machine uses ({chain}) lack {need} on {shown}/*, or the bucket does not "
        "exist; a run needs list, read, write and delete there"
        + ("; check the bucket name" if action == "list" else "")
        + "; checkpoint.storage_options passes anything else to fsspec"
    )


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
