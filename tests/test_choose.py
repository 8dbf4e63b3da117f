"""rank 0's choice of the resume step (trainer/restart/remote/choose.py), in process against a `file://` store:
what is retried as a fault of the moment and what ends the attempt with its own code."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from trainer import exit_codes as E
from trainer.restart.store.errors import StoreDenied, StoreOffline, StoreUnreachable
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.verify import Corrupt


def _store(tmp_path: Path) -> Store:
    (tmp_path / "bucket").mkdir(exist_ok=True)  # a file:// store's parent must exist, as a bucket must
    store = Store(f"file://{tmp_path / 'bucket'}/run")
    store.check()
    return store


def test_only_a_fault_of_the_moment_is_retried(tmp_path: Path) -> None:
    """A full disk, a bug or this machine's own refused file are not the store's fault: they end the
    attempt at once with their own code (1), never 143 forever; the network, a store that does not answer
    and a lease cut off are retried, then 143. `exit_codes.transient` is the one definition of both."""
    from trainer.restart.remote.choose import retrying

    store = _store(tmp_path)
    said: list[str] = []
    local = tmp_path / "run" / "checkpoints" / "step-000010.tmp-download"
    not_the_store = [
        OSError(errno.ENOSPC, "No space left on device", str(local / "adapter_model.safetensors")),
        KeyError("files"),
        PermissionError(errno.EACCES, "Permission denied", str(local)),
        Corrupt("the one reason to skip a checkpoint"),
    ]
    for error in not_the_store:
        calls: list[int] = []

        def fail(error: BaseException = error, calls: list[int] = calls) -> None:
            calls.append(1)
            raise error

        with pytest.raises(type(error)) as got:
            retrying("reading the checkpoints of", 3.0, fail, said.append, store)
        assert got.value is error and calls == [1] and said == [], (error, said)
        assert E.code_for(error) == (E.EXIT_PREEMPTED if isinstance(error, Corrupt) else E.EXIT_ERROR)
    # The control: faults of the moment are retried (once here, the budget spent), then 143.
    for error in [ConnectionResetError(), StoreUnreachable("x"), StoreOffline("cut off"), TimeoutError()]:
        calls = []

        def flaky(error: BaseException = error, calls: list[int] = calls) -> str:
            calls.append(1)
            if len(calls) == 1:
                raise error
            return "read"

        assert retrying("reading the checkpoints of", 3.0, flaky, said.append, store) == "read", error
        assert calls == [1, 1] and said and "retrying in" in said[-1]
        assert E.transient(error) and E.code_for(error) == E.EXIT_PREEMPTED
    with pytest.raises(StoreUnreachable, match="reading .* failed: ConnectionResetError"):
        retrying("reading", 0.0, lambda: (_ for _ in ()).throw(ConnectionResetError()), said.append, store)


def test_a_refusal_is_the_stores_when_the_store_refused(tmp_path: Path) -> None:
    """`Store.fault` asks the one classifier (trainer/faults.py), which walks the chain (causes, and the
    exception an `except` block was handling): a refusal re-raised as another error is still a refusal
    (exit 2), while a PermissionError about a file on this machine, outside the store, is not the store's
    (no "lacks s3:GetObject"): it keeps its own code."""
    from trainer.restart.remote.choose import retrying

    store = _store(tmp_path)
    try:
        try:
            raise PermissionError("Access Denied")  # what s3fs raises, its set_cause=False path
        except PermissionError:
            raise OSError(errno.EIO, "the request failed")  # noqa: B904 (as s3fs does: the context only)
    except OSError as e:
        wrapped = e
    assert isinstance(store.fault(wrapped, "read"), StoreDenied) and not E.transient(wrapped)
    with pytest.raises(StoreDenied, match="read refused"):
        retrying("reading", 3.0, lambda: (_ for _ in ()).throw(wrapped), print, store)
    in_store = PermissionError(errno.EACCES, "Permission denied", f"{store.root}/checkpoints/step-000001/x")
    here = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "run" / "checkpoints"))
    assert isinstance(store.fault(in_store, "read"), StoreDenied) and store.fault(here, "read") is None


def test_an_unreachable_store_and_no_local_checkpoint_that_verifies_is_a_fault_of_the_moment(tmp_path: Path) -> None:
    """The store did not answer at start and every local checkpoint fails to verify: the store may hold
    good ones, so the attempt stops with 143 (rerun once it answers), not 2 ("none verifies")."""
    from trainer.restart.local.checkpoint import CheckpointError, CheckpointManager
    from trainer.restart.remote.choose import choose

    root = tmp_path / "run" / "checkpoints"
    manager = CheckpointManager(root, keep_last=2)
    saved = manager.save(10, lambda d: (d / "adapter_model.safetensors").write_bytes(b"a" * 64)).path
    (saved / "adapter_model.safetensors").write_bytes(b"b" * 64)  # rotted on this disk
    with pytest.raises(StoreUnreachable, match="(?s)verifies.*exit 143") as got:
        choose(root, "auto", _store(tmp_path), reachable=False, budget=0.0, message=print)
    assert E.code_for(got.value) == E.EXIT_PREEMPTED
    # The control: with no store configured, nothing else could hold a good checkpoint (exit 2).
    with pytest.raises(CheckpointError, match="verifies") as plain:
        choose(root, "auto", None, reachable=False, budget=0.0, message=print)
    assert E.code_for(plain.value) == E.EXIT_BAD_INPUT
