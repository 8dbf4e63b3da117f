"""The one classifier of store and hub errors (trainer/faults.py), against each library's own exception
constructors: botocore's ClientError and s3fs's translation of it, gcsfs's `validate_response` and
`HttpError`, azure-core's errors as azure-storage-blob raises them (adlfs), huggingface_hub's
`hf_raise_for_status`. Each row: whether it is a fault of the moment, its kind, the exit code a store
request failing with it ends the run with (`Store.fault`, then `exit_codes.code_for`), and what the
message names."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer import exit_codes as E
from trainer.faults import classify, transient
from trainer.restart.store.errors import StoreDenied, StoreUnreachable
from trainer.restart.store.lifecycle import Store


def s3(code: str, status: int) -> BaseException:
    """botocore's ClientError as the S3 API answers `code` with `status`."""
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": f"{code} said the store"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )


def s3fs_said(code: str, status: int) -> BaseException:
    """What s3fs raises for that ClientError (its translation to a builtin error, the ClientError its cause)."""
    from s3fs.errors import translate_boto_error

    return translate_boto_error(s3(code, status))


def gcs(status: int, body: dict | None = None) -> BaseException:
    """What gcsfs raises for an answer of `status` (its own `validate_response`)."""
    from gcsfs.retry import validate_response

    try:
        validate_response(status, json.dumps({"error": body}).encode() if body else b"", "bucket/run/x")
    except Exception as e:
        return e
    raise AssertionError(f"gcsfs accepted {status}")


def gcs_out_of_retries(status: int) -> BaseException:
    """gcsfs's HttpError once its own retries are spent: a code, no `.response`."""
    from gcsfs.retry import HttpError

    return HttpError({"code": status, "message": "Backend Error"})


def azure(status: int, code: str) -> BaseException:
    """What azure-storage-blob (under adlfs) raises for an answer of `status` with `x-ms-error-code: code`."""
    import requests
    from azure.core.exceptions import HttpResponseError
    from azure.core.pipeline.transport import HttpRequest, RequestsTransportResponse
    from azure.storage.blob._shared.response_handlers import process_storage_error

    answer = requests.Response()
    answer.status_code, answer.reason, answer._content = status, code, b""
    answer.headers["x-ms-error-code"] = code
    request = HttpRequest("PUT", "https://acct.blob.core.windows.net/container/run/x")
    try:
        process_storage_error(HttpResponseError(response=RequestsTransportResponse(request, answer)))
    except Exception as e:
        return e
    raise AssertionError("azure accepted it")


def azure_class(name: str) -> Callable[[], BaseException]:
    def make() -> BaseException:
        import azure.core.exceptions as A

        return getattr(A, name)("Connection refused by acct.blob.core.windows.net")

    return make


def hub(status: int) -> BaseException:
    """What huggingface_hub raises for an answer of `status`."""
    import httpx2
    from huggingface_hub.utils import hf_raise_for_status

    try:
        hf_raise_for_status(httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/x")))
    except Exception as e:
        return e
    raise AssertionError("the hub accepted it")


def botocore(name: str) -> Callable[[], BaseException]:
    def make() -> BaseException:
        import botocore.exceptions as B

        return getattr(B, name)(endpoint_url="https://s3.example.com")

    return make


class UnknownBackendError(Exception):
    """What a backend nobody has seen yet raises."""


# (name, the exception, transient, kind, exit code of a store request failing with it, the message names)
TABLE: list[tuple[str, Callable[[], BaseException], bool, str, int, str]] = [
    # S3: botocore's ClientError, raw and as s3fs raises it
    ("s3 503 SlowDown", lambda: s3("SlowDown", 503), True, "throttled", 143, "unreachable"),
    ("s3fs 503 SlowDown", lambda: s3fs_said("SlowDown", 503), True, "throttled", 143, "unreachable"),
    ("s3fs 500 InternalError", lambda: s3fs_said("InternalError", 500), True, "server", 143, "unreachable"),
    ("s3fs 400 RequestTimeout", lambda: s3fs_said("RequestTimeout", 400), True, "timeout", 143, "unreachable"),
    ("s3 504", lambda: s3("GatewayTimeout", 504), True, "timeout", 143, "unreachable"),
    ("s3 502", lambda: s3("BadGateway", 502), True, "server", 143, "unreachable"),
    ("s3 408", lambda: s3("RequestTimeout", 408), True, "timeout", 143, "unreachable"),
    ("s3 429", lambda: s3("TooManyRequests", 429), True, "throttled", 143, "unreachable"),
    ("s3fs 403 AccessDenied", lambda: s3fs_said("AccessDenied", 403), False, "permission", 2, "lack s3:PutObject"),
    (
        "s3fs 403 InvalidAccessKeyId",
        lambda: s3fs_said("InvalidAccessKeyId", 403),
        False,
        "credentials",
        2,
        "credentials",
    ),
    ("s3fs 403 RequestTimeTooSkewed", lambda: s3fs_said("RequestTimeTooSkewed", 403), False, "clock", 2, "clock skew"),
    ("s3fs 404 NoSuchBucket", lambda: s3fs_said("NoSuchBucket", 404), False, "missing", 2, "check the bucket name"),
    ("s3fs 400 InvalidBucketName", lambda: s3fs_said("InvalidBucketName", 400), False, "request", 2, "bucket name"),
    (
        "s3fs 501 NotImplemented",
        lambda: s3fs_said("NotImplemented", 501),
        False,
        "unsupported",
        2,
        "does not implement",
    ),
    ("s3 505", lambda: s3("HTTPVersionNotSupported", 505), False, "unsupported", 2, "does not implement"),
    ("MinIO 507 XMinioStorageFull", lambda: s3fs_said("XMinioStorageFull", 507), False, "full", 2, "is full"),
    ("s3 HEAD 403 (no body)", lambda: s3("403", 403), False, "permission", 2, "s3:PutObject"),
    ("botocore EndpointConnectionError", botocore("EndpointConnectionError"), True, "connection", 143, "unreachable"),
    ("botocore ReadTimeoutError", botocore("ReadTimeoutError"), True, "timeout", 143, "unreachable"),
    (
        "botocore NoCredentialsError",
        lambda: __import__("botocore.exceptions").exceptions.NoCredentialsError(),
        False,
        "credentials",
        2,
        "credentials",
    ),
    # GCS: gcsfs's own errors
    (
        "gcsfs 403 Forbidden",
        lambda: gcs(403, {"message": "no storage.objects.create access"}),
        False,
        "unknown",
        2,
        "lack s3:PutObject",
    ),
    (
        "gcsfs 401",
        lambda: gcs(401, {"code": 401, "message": "Anonymous caller"}),
        False,
        "credentials",
        2,
        "credentials",
    ),
    ("gcsfs 404", lambda: gcs(404), False, "missing", 2, "bucket"),
    ("gcsfs 502", lambda: gcs(502), True, "connection", 143, "unreachable"),
    ("gcsfs 503 out of retries", lambda: gcs_out_of_retries(503), True, "server", 143, "unreachable"),
    ("gcsfs 429 out of retries", lambda: gcs_out_of_retries(429), True, "throttled", 143, "unreachable"),
    ("gcsfs 400 invalid", lambda: gcs(400, {"message": "invalid argument"}), False, "unknown", 2, "refused"),
    # Azure: azure-storage-blob's errors (adlfs passes them on)
    ("azure 503 ServerBusy", lambda: azure(503, "ServerBusy"), True, "throttled", 143, "unreachable"),
    ("azure 500 OperationTimedOut", lambda: azure(500, "OperationTimedOut"), True, "timeout", 143, "unreachable"),
    (
        "azure 403 AuthenticationFailed",
        lambda: azure(403, "AuthenticationFailed"),
        False,
        "credentials",
        2,
        "credentials",
    ),
    (
        "azure 403 AuthorizationPermissionMismatch",
        lambda: azure(403, "AuthorizationPermissionMismatch"),
        False,
        "permission",
        2,
        "lack s3:PutObject",
    ),
    ("azure 404 ContainerNotFound", lambda: azure(404, "ContainerNotFound"), False, "missing", 2, "bucket"),
    ("azure ServiceRequestError", azure_class("ServiceRequestError"), True, "connection", 143, "unreachable"),
    ("azure ServiceResponseError", azure_class("ServiceResponseError"), True, "connection", 143, "unreachable"),
    # builtins and the unknown
    (
        "ConnectionResetError",
        lambda: ConnectionResetError(errno.ECONNRESET, "reset"),
        True,
        "connection",
        143,
        "unreachable",
    ),
    ("socket.timeout", lambda: TimeoutError("timed out"), True, "timeout", 143, "unreachable"),
    ("an unknown backend's error", lambda: UnknownBackendError("what is this"), False, "unknown", 2, "refused"),
    ("a bug", lambda: KeyError("files"), False, "bug", 1, "files"),
]


@pytest.mark.parametrize(("name", "make", "is_transient", "kind", "code", "names"), TABLE, ids=[r[0] for r in TABLE])
def test_each_librarys_own_errors(
    name: str, make: Callable[[], BaseException], is_transient: bool, kind: str, code: int, names: str
) -> None:
    e = make()
    verdict = classify(e)
    assert (verdict.transient, verdict.kind) == (is_transient, kind), (name, verdict, repr(e))
    assert transient(e) is is_transient
    fault = Store("s3://bucket/run").fault(e, "write")
    assert E.code_for(fault or e) == code, (name, fault)
    assert isinstance(fault, StoreUnreachable if is_transient else StoreDenied if code == 2 else type(None))
    assert names in str(fault or e), (name, str(fault))


def test_clock_skew_is_named_as_clock_skew_not_a_missing_permission() -> None:
    """s3fs turns RequestTimeTooSkewed into a PermissionError: its cause says what it is."""
    fault = Store("s3://bucket/run").fault(s3fs_said("RequestTimeTooSkewed", 403), "write")
    assert isinstance(fault, StoreDenied) and "s3:PutObject" not in str(fault) and "chrony" in str(fault)
    # The control: a plain AccessDenied does name the permission.
    assert "s3:PutObject" in str(Store("s3://bucket/run").fault(s3fs_said("AccessDenied", 403), "write"))


def test_a_gcs_store_names_its_own_permission() -> None:
    """gcsfs's 403 is a bare OSError("Forbidden"): permanent by default (exit 2, never 143 for ever),
    naming the permission in GCS's words."""
    store = Store("gs://bucket/run", {"token": "anon"})
    fault = store.fault(gcs(403, {"message": "caller lacks storage.objects.create"}), "write")
    assert isinstance(fault, StoreDenied) and "storage.objects.create" in str(fault) and E.code_for(fault) == 2


def test_hub_errors_under_spotunes_own_decide_the_exit_code() -> None:
    """A DataError raised from a hub answer: 143 when the hub failed for the moment, 2 otherwise."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    from trainer.data.read import DataError

    def raised_from(cause: BaseException) -> DataError:
        try:
            raise DataError("data.path: the hub failed") from cause
        except DataError as e:
            return e

    for status in (429, 500, 502, 503, 504):
        assert transient(hub(status)) and E.code_for(raised_from(hub(status))) == E.EXIT_PREEMPTED, status
    for status in (400, 401, 403, 404, 501):
        assert not transient(hub(status)) and E.code_for(raised_from(hub(status))) == E.EXIT_BAD_INPUT, status
    # HF_HUB_OFFLINE: a ConnectionError by class, a setting by meaning
    assert E.code_for(raised_from(OfflineModeIsEnabled("offline"))) == E.EXIT_BAD_INPUT


def test_classes_are_matched_by_type_not_by_name() -> None:
    """A class that merely shares a name with one of spotune's is not spotune's; StoreAhead stops with 143 (a
    restart resumes from the store's newer step), not 1."""
    from trainer.restart.store.safety import StoreAhead

    class ConfigError(Exception):  # not trainer.config.ConfigError
        pass

    class StoreUnreachable(Exception):  # not trainer.restart.store.errors.StoreUnreachable
        pass

    assert E.code_for(ConfigError("x")) == E.EXIT_ERROR
    assert E.code_for(StoreUnreachable("x")) == E.EXIT_ERROR and not transient(StoreUnreachable("x"))
    assert E.code_for(StoreAhead("ahead")) == E.EXIT_PREEMPTED
    assert not hasattr(E, "BY_CLASS")


def test_a_full_local_disk_is_not_the_stores(tmp_path: Path) -> None:
    """ENOSPC on this machine's own disk (a download's destination) keeps its own code; under a file:// store's
    root it is the store that is full (exit 2)."""
    (tmp_path / "bucket").mkdir()
    store = Store(f"file://{tmp_path / 'bucket'}/run")
    here = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "local" / "x"))
    there = OSError(errno.ENOSPC, "No space left on device", f"{store.root}/checkpoints/x")
    assert store.fault(here, "write") is None and E.code_for(here) == E.EXIT_ERROR
    fault = store.fault(there, "write")
    assert isinstance(fault, StoreDenied) and "is full" in str(fault) and E.code_for(fault) == E.EXIT_BAD_INPUT


def test_a_file_store_whose_mount_is_missing_is_a_setting_and_nothing_is_created(tmp_path: Path) -> None:
    """Its parent folder is never made: a missing mount would be a folder on this disk, empty, and a fresh
    machine would train from step 0 into it."""
    store = Store(f"file://{tmp_path / 'mnt' / 'nfs'}/run")
    with pytest.raises(StoreDenied, match=f"the folder {tmp_path / 'mnt' / 'nfs'} does not exist") as got:
        store.check()
    assert E.code_for(got.value) == E.EXIT_BAD_INPUT and not (tmp_path / "mnt").exists()
    # The control: once mounted (the parent exists), the run's own folder is made.
    (tmp_path / "mnt" / "nfs").mkdir(parents=True)
    store.check()
    assert (tmp_path / "mnt" / "nfs" / "run").is_dir()
