"""Whether an error is a fault of the moment: the one classifier of every store, hub and network error.

`classify(e)` walks the error's chain (`causes`: each cause, else the exception its `except` block was
handling) and returns a `Verdict`: transient (the run exits 143, a supervisor reruns it; a caller that
retries retries it) or permanent, with its kind. **An error nothing here knows is permanent**: a new
backend's unknown answer stops the run with its message instead of requeueing it for ever.

- Transient: timeouts; lost, reset or refused connections; broken transfers; HTTP 408, 429, 500, 502,
  503, 504 (and 520-524, what Cloudflare, in front of R2, answers when the store behind it does not);
  throttling codes (SlowDown, ServerBusy...). In each SDK's own form: botocore's `ClientError` (its
  code, its status) and connection errors, gcsfs's `HttpError` once its own retries are spent (it carries
  no `.response`: the status is its `.code`), azure-core's `ServiceRequestError` /
  `ServiceResponseError` and `HttpResponseError`'s status, aiohttp, requests, httpx, huggingface_hub.
- Permanent: refused credentials (401, InvalidAccessKeyId, SignatureDoesNotMatch...), refused
  permissions (403, AccessDenied, PermissionError), a missing bucket or container (404, NoSuchBucket),
  this machine's clock (RequestTimeTooSkewed), a full store (507, XMinioStorageFull, ENOSPC), a request
  the store does not implement (501, 505), any other 4xx (InvalidBucketName), offline mode
  (HF_HUB_OFFLINE), a bug, anything unknown.

One node of the chain decides: the first that says something specific (spotune's own markers, an SDK's
answer), else the first generic one (a builtin OSError: PermissionError, ConnectionError...), since s3fs
turns `ClientError`s into builtin errors that say less than their cause (RequestTimeTooSkewed becomes a
PermissionError). Classes are matched by type: a library's are looked up in `sys.modules` (an error of
a library never imported cannot exist, and nothing is imported to ask), spotune's own derive from
`Transient` or `Permanent` below. This module imports nothing of spotune: `trainer/exit_codes.py` asks it.
"""

from __future__ import annotations

import errno
import http.client
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


class Transient(Exception):
    """Base of spotune's errors that are a fault of the moment (a store that does not answer, a lease cut off
    from its store): decisive over their causes."""


class Permanent(Exception):
    """Base of spotune's errors that rerunning unchanged will not change (the store refused a request):
    decisive over their causes."""


KINDS: dict[str, str] = {
    # transient
    "timeout": "a timeout",
    "connection": "a lost or refused connection",
    "throttled": "throttling (too many requests)",
    "server": "a server error of the moment",
    "unreachable": "a service that does not answer",
    # permanent
    "credentials": "credentials refused",
    "permission": "permission refused",
    "missing": "no such bucket, container or path",
    "clock": "this machine's clock is off",
    "full": "the store is full",
    "unsupported": "a request the store does not implement",
    "request": "a request the store refused as invalid",
    "setting": "a setting to fix",
    "bug": "a bug",
    "unknown": "an error not known to be a fault of the moment",
}
"""Every kind a verdict may have, and how a message names it."""

TRANSIENT_KINDS = frozenset({"timeout", "connection", "throttled", "server", "unreachable"})


@dataclass(frozen=True)
class Verdict:
    """What an error means: `kind` (a key of KINDS), and the HTTP status and service error code it carried."""

    kind: str
    status: int | None = None
    code: str | None = None

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT_KINDS

    def __str__(self) -> str:
        said = [str(self.status)] if self.status is not None else []
        said += [self.code] if self.code and self.code != str(self.status) else []
        return KINDS[self.kind] + (f" ({' '.join(said)})" if said else "")


def causes(e: BaseException) -> Iterator[BaseException]:
    """`e` and the exceptions below it: each one's cause, else the exception its `except` block was handling
    (libraries re-raise either way; s3fs drops the cause on some paths). The one walk of an error's chain."""
    seen: BaseException | None = e
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        yield seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


def classify(e: BaseException) -> Verdict:
    """The verdict on `e` (see the module's docstring); permanent unless known to be transient."""
    generic: Verdict | None = None
    for seen in causes(e):
        specific = _specific(seen)
        if specific is not None:
            return specific
        if generic is None:
            generic = _generic(seen)
    if generic is not None:
        return generic
    return Verdict("bug" if isinstance(e, _BUGS) else "unknown")


def transient(e: BaseException) -> bool:
    """Whether `e` is a fault of the moment (exit 143, retried where a caller retries): `classify`'s verdict."""
    return classify(e).transient


def answer(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and service error code the first answer in `e`'s chain carried, if any (a conditional
    write refused: 412 PreconditionFailed)."""
    for seen in causes(e):
        status, code = _http(seen)
        if status is not None or code is not None:
            return status, code
    return None, None


# ---------------------------------------------------------------------------- the tables

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524})
UNSUPPORTED_STATUS = frozenset({501, 505})
FULL_STATUS = frozenset({507})

CODES: dict[str, str] = {
    # S3 (and MinIO, R2, moto): https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html
    "SlowDown": "throttled",
    "Throttling": "throttled",
    "ThrottlingException": "throttled",
    "RequestThrottled": "throttled",
    "TooManyRequests": "throttled",
    "TooManyRequestsException": "throttled",
    "RequestLimitExceeded": "throttled",
    "BandwidthLimitExceeded": "throttled",
    "RequestTimeout": "timeout",  # a 400: the connection went idle mid-upload
    "InternalError": "server",
    "ServiceUnavailable": "server",
    "OperationAborted": "server",  # a 409: a conflicting operation on the bucket is in progress
    "XMinioServerNotInitialized": "server",
    "RequestTimeTooSkewed": "clock",  # a 403 that s3fs turns into PermissionError: never a missing permission
    "InvalidAccessKeyId": "credentials",
    "SignatureDoesNotMatch": "credentials",
    "ExpiredToken": "credentials",
    "InvalidToken": "credentials",
    "TokenRefreshRequired": "credentials",
    "AccessDenied": "permission",
    "AllAccessDisabled": "permission",
    "AccountProblem": "permission",
    "NoSuchBucket": "missing",
    "NotImplemented": "unsupported",
    "XMinioStorageFull": "full",
    "XMinioAdminBucketQuotaExceeded": "full",
    "QuotaExceeded": "full",
    # Azure Blob Storage (x-ms-error-code)
    "ServerBusy": "throttled",
    "OperationTimedOut": "timeout",
    "AuthenticationFailed": "credentials",
    "InvalidAuthenticationInfo": "credentials",
    "NoAuthenticationInformation": "credentials",
    "AuthorizationFailure": "permission",
    "AuthorizationPermissionMismatch": "permission",
    "InsufficientAccountPermissions": "permission",
    "AccountIsDisabled": "permission",
    "ContainerNotFound": "missing",
}
"""Service error codes whose meaning is more specific than their HTTP status (a code not listed: the status decides)."""

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ETIMEDOUT",
        "ECONNRESET",
        "ECONNABORTED",
        "ECONNREFUSED",
        "EHOSTUNREACH",
        "EHOSTDOWN",
        "ENETUNREACH",
        "ENETDOWN",
        "ENETRESET",
        "ESTALE",  # an NFS handle gone stale under a file:// store: the server restarted
    )
    if hasattr(errno, name)
)
_FULL_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG") if hasattr(errno, n))
_BUGS = (TypeError, AttributeError, NameError, LookupError, AssertionError, ZeroDivisionError, RecursionError)

# Library classes, by module: (module, class name) pairs looked up in sys.modules, never imported.
_TRANSIENT_CLASSES: tuple[tuple[str, str], ...] = (
    ("botocore.exceptions", "EndpointConnectionError"),
    ("botocore.exceptions", "ConnectionClosedError"),
    ("botocore.exceptions", "ReadTimeoutError"),
    ("botocore.exceptions", "ConnectTimeoutError"),
    ("botocore.exceptions", "ProxyConnectionError"),
    ("botocore.exceptions", "ResponseStreamingError"),
    ("botocore.exceptions", "IncompleteReadError"),
    ("urllib3.exceptions", "ProtocolError"),
    ("urllib3.exceptions", "TimeoutError"),
    ("urllib3.exceptions", "NewConnectionError"),
    ("aiohttp.client_exceptions", "ClientConnectionError"),
    ("aiohttp.client_exceptions", "ClientPayloadError"),
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
    ("requests.exceptions", "ChunkedEncodingError"),
    ("httpx", "TransportError"),
    ("httpx2", "TransportError"),
    ("google.auth.exceptions", "TransportError"),
    ("gcsfs.retry", "ChecksumError"),  # a transfer that arrived torn
    ("azure.core.exceptions", "ServiceRequestError"),  # the request never reached the service
    ("azure.core.exceptions", "ServiceResponseError"),  # the answer did not arrive whole
    ("azure.core.exceptions", "IncompleteReadError"),
)
_PERMANENT_CLASSES: tuple[tuple[str, str, str], ...] = (
    ("huggingface_hub.errors", "OfflineModeIsEnabled", "setting"),  # a ConnectionError by class: HF_HUB_OFFLINE
    ("botocore.exceptions", "NoCredentialsError", "credentials"),
    ("botocore.exceptions", "PartialCredentialsError", "credentials"),
    ("botocore.exceptions", "CredentialRetrievalError", "credentials"),
    ("botocore.exceptions", "NoRegionError", "request"),
    ("botocore.exceptions", "ParamValidationError", "request"),
    ("google.auth.exceptions", "DefaultCredentialsError", "credentials"),
    ("google.auth.exceptions", "RefreshError", "credentials"),  # gcsfs retried it already
    ("azure.core.exceptions", "ClientAuthenticationError", "credentials"),
)
_NEUTRAL_CLASSES: tuple[tuple[str, str], ...] = (
    # A FileNotFoundError by class, raised for "not in the cache, and the hub could not say": its cause decides.
    ("huggingface_hub.errors", "LocalEntryNotFoundError"),
)


def _library(module: str, name: str) -> type | None:
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _is(e: BaseException, module: str, name: str) -> bool:
    cls = _library(module, name)
    return cls is not None and isinstance(e, cls)


def _specific(e: BaseException) -> Verdict | None:
    """What `e` alone says, when it says something specific: spotune's markers, an SDK's answer or class."""
    if isinstance(e, Transient):
        return Verdict("unreachable")
    if isinstance(e, Permanent):
        return Verdict("setting")
    for module, name, kind in _PERMANENT_CLASSES:
        if _is(e, module, name):
            status, code = _http(e)
            return Verdict(kind, status, code)
    if any(_is(e, module, name) for module, name in _NEUTRAL_CLASSES):
        return None
    status, code = _http(e)
    if status is not None or code is not None:
        return Verdict(_kind_of(status, code), status, code)
    for module, name in _TRANSIENT_CLASSES:
        if _is(e, module, name):
            return Verdict("timeout" if "Timeout" in name else "connection")
    return None


def _generic(e: BaseException) -> Verdict | None:
    """What a builtin error says: decides only when nothing more specific lies below it."""
    if any(_is(e, module, name) for module, name in _NEUTRAL_CLASSES):
        return None
    if isinstance(e, TimeoutError):
        return Verdict("timeout")
    if isinstance(e, (ConnectionError, http.client.IncompleteRead, http.client.RemoteDisconnected)):
        return Verdict("connection")
    if isinstance(e, PermissionError):
        return Verdict("permission")
    if isinstance(e, FileNotFoundError):
        return Verdict("missing")
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return Verdict("connection")
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
        return Verdict("full")
    return None


def _kind_of(status: int | None, code: str | None) -> str:
    if code in CODES:
        return CODES[code]
    if status is None:
        return "unknown"
    if status in TRANSIENT_STATUS:
        return "throttled" if status == 429 else "timeout" if status in (408, 504, 522, 524) else "server"
    if status in UNSUPPORTED_STATUS:
        return "unsupported"
    if status in FULL_STATUS:
        return "full"
    return {401: "credentials", 403: "permission", 404: "missing"}.get(
        status, "request" if 400 <= status < 500 else "unknown"
    )


def _http(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and service error code `e` itself carries, in its SDK's form."""
    status: Any = None
    code: Any = None
    response = getattr(e, "response", None)
    if _is(e, "botocore.exceptions", "ClientError") and isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    elif _is(e, "gcsfs.retry", "HttpError"):
        status = getattr(e, "code", None)  # no .response: what gcsfs kept of the answer once its retries ran out
    elif _is(e, "azure.core.exceptions", "HttpResponseError"):
        status, code = getattr(e, "status_code", None), getattr(e, "error_code", None)
        code = getattr(code, "value", code)  # azure-storage-blob's StorageErrorCode, a str enum
        if code is None and response is not None:  # as azure-core raised it: the code is the answer's header
            code = getattr(response, "headers", {}).get("x-ms-error-code")
    elif _is(e, "aiohttp.client_exceptions", "ClientResponseError"):
        status = getattr(e, "status", None)
    elif response is not None and not isinstance(response, dict):
        status = getattr(response, "status_code", None)  # requests, httpx, huggingface_hub
    if isinstance(status, str) and status.isdigit():
        status = int(status)
    if isinstance(code, str) and code.isdigit():  # botocore's code of an answer without a body (HEAD): the status
        status, code = status if isinstance(status, int) else int(code), None
    return (status if isinstance(status, int) and not isinstance(status, bool) else None), (str(code) if code else None)
