"""CheckpointManager: atomic save, verification, pruning, corruption handling, disk full, resume choice."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.restart.local.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    ResumeMismatch,
    resolve_resume,
)
from trainer.restart.local.state import TrainState, check_compatible


def writer(step: int, size: int = 1000):
    def write(d: Path) -> None:
        save_file({"w": torch.full((size,), float(step))}, d / "adapter_model.safetensors")
        (d / "trainer_state.json").write_text(json.dumps({"step": step}))
        (d / "sub").mkdir()
        (d / "sub" / "extra.json").write_text("{}")

    return write


def make(tmp_path: Path, steps: list[int], keep_last: int = 5) -> CheckpointManager:
    m = CheckpointManager(tmp_path / "checkpoints", keep_last=keep_last)
    for s in steps:
        m.save(s, writer(s))
    return m


def test_save_commits_verifies_and_records_time_and_size(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path / "ck", keep_last=2)
    res = m.save(200, writer(200))
    assert res.path == tmp_path / "ck" / "step-000200" and res.path.is_dir() and not res.skipped
    assert res.seconds > 0 and res.bytes == sum(f.stat().st_size for f in res.path.rglob("*") if f.is_file())
    manifest = json.loads((res.path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"adapter_model.safetensors", "trainer_state.json", "sub/extra.json"}
    assert m.verify(res.path) == []
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-000200"]  # no temp dir left


def test_prune_keeps_the_newest_only_after_commit(tmp_path: Path) -> None:
    m = make(tmp_path, [1, 2, 3], keep_last=2)
    assert [p.name for p in m.committed()] == ["step-000002", "step-000003"]

    def failing(d: Path) -> None:
        raise RuntimeError("writer broke")

    with pytest.raises(CheckpointError, match="writer broke"):
        m.save(4, failing)
    assert [p.name for p in m.committed()] == ["step-000002", "step-000003"]  # nothing pruned for a failed save
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=1)


def test_same_step_twice_is_a_no_op(tmp_path: Path) -> None:
    m = make(tmp_path, [5])
    calls = []
    res = m.save(5, lambda d: calls.append(d))
    assert res.skipped and calls == [] and m.verify(res.path) == []


def test_same_step_left_by_another_run_is_replaced(tmp_path: Path) -> None:
    old = make(tmp_path, [5])
    before = (old.step_dir(5) / "MANIFEST.json").read_text()
    fresh = CheckpointManager(old.root, keep_last=3)  # a new run in the same directory (resume=never)
    res = fresh.save(5, lambda d: (d / "trainer_state.json").write_text('{"step": 5, "run": "new"}'))
    assert not res.skipped and fresh.verify(res.path) == []
    assert (res.path / "MANIFEST.json").read_text() != before  # the new run's state, not the old one's


def test_same_step_over_a_corrupt_copy_replaces_it(tmp_path: Path) -> None:
    m = make(tmp_path, [5])
    (m.step_dir(5) / "trainer_state.json").write_text("garbage!")
    assert m.verify(m.step_dir(5))
    res = m.save(5, writer(5))
    assert not res.skipped and m.verify(res.path) == []
    assert [p.name for p in m.root.iterdir()] == ["step-000005"]


def _truncate(d: Path) -> str:
    f = d / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return "adapter_model.safetensors: .* bytes, the manifest says .*truncated"


def _flip(d: Path) -> str:
    f = d / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    return "adapter_model.safetensors: sha256 differs"


def _delete(d: Path) -> str:
    (d / "sub" / "extra.json").unlink()
    return "sub/extra.json: missing"


def _empty_manifest(d: Path) -> str:
    (d / MANIFEST).write_text("")
    return "MANIFEST.json: unreadable"


def _no_manifest(d: Path) -> str:
    (d / MANIFEST).unlink()
    return "MANIFEST.json: missing"


@pytest.mark.parametrize("corrupt", [_truncate, _flip, _delete, _empty_manifest, _no_manifest])
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, corrupt) -> None:
    m = make(tmp_path, [10, 20])
    pattern = corrupt(m.step_dir(20))
    path, messages = resolve_resume(m.root, "auto")
    assert path == m.step_dir(10)
    assert len(messages) == 1 and str(m.step_dir(20)) in messages[0]
    import re

    assert re.search(pattern, messages[0]), messages[0]


def test_stale_temp_dir_is_ignored_and_removed(tmp_path: Path) -> None:
    m = make(tmp_path, [10])
    stale = m.root / "step-000020.tmp-deadbeef"
    stale.mkdir()
    (stale / "adapter_model.safetensors").write_bytes(b"half")
    path, messages = resolve_resume(m.root, "auto")
    assert path == m.step_dir(10) and not stale.exists()
    assert any("removed unfinished save" in x and stale.name in x for x in messages)
    # rank > 0 passes clean=False: the stale dir is still ignored but left to rank 0
    stale.mkdir()
    assert resolve_resume(m.root, "auto", clean=False)[0] == m.step_dir(10) and stale.exists()


def test_none_verifying_raises_instead_of_starting_over(tmp_path: Path) -> None:
    m = make(tmp_path, [10, 20])
    _flip(m.step_dir(10)), _truncate(m.step_dir(20))
    with pytest.raises(CheckpointError, match="(?s)no checkpoint under .* verifies.*checkpoint.resume=never"):
        resolve_resume(m.root, "auto")
    assert resolve_resume(tmp_path / "nothing", "auto") == (None, [])


def test_resume_never_and_explicit_path(tmp_path: Path) -> None:
    m = make(tmp_path, [10, 20, 30])
    assert resolve_resume(m.root, str(m.step_dir(10)), clean=False) == (m.step_dir(10), [])  # other ranks only read
    assert len(m.committed()) == 3
    path, messages = resolve_resume(m.root, str(m.step_dir(10)))
    assert path == m.step_dir(10) and "set aside 2 newer checkpoint(s)" in messages[0]
    # The abandoned timeline is renamed, not deleted, and no longer committed: a later
    # resume=auto continues the new timeline instead of jumping back to step 30.
    assert [p.name for p in m.committed()] == ["step-000010"]
    assert sorted(p.name.split(".")[0] for p in m.root.glob("step-*.retired-*")) == ["step-000020", "step-000030"]
    assert resolve_resume(m.root, "auto")[0] == m.step_dir(10)
    path, messages = resolve_resume(m.root, "never")
    assert path is None and "starting at step 0; set aside 1 newer" in messages[0] and m.committed() == []

    m = make(tmp_path / "b", [10])
    assert resolve_resume(m.root, str(m.step_dir(10)))[0] == m.step_dir(10)
    _delete(m.step_dir(10))
    with pytest.raises(CheckpointError, match="does not verify: sub/extra.json: missing"):
        resolve_resume(m.root, str(m.step_dir(10)))
    with pytest.raises(CheckpointError, match="is not a directory"):
        resolve_resume(m.root, str(tmp_path / "nope"))


def test_disk_full_in_the_writer_keeps_previous_checkpoints(tmp_path: Path) -> None:
    m = make(tmp_path, [10, 20], keep_last=2)

    def enospc(d: Path) -> None:
        (d / "optimizer.safetensors").write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d / "optimizer.safetensors"))

    with pytest.raises(CheckpointError) as info:
        m.save(30, enospc)
    msg = str(info.value)
    assert "No space left on device" in msg and "optimizer.safetensors" in msg and "step-000030.tmp-" in msg
    assert "step-000010, step-000020" in msg
    assert sorted(p.name for p in m.root.iterdir()) == ["step-000010", "step-000020"]
    assert all(m.verify(p) == [] for p in m.committed())


def test_disk_full_at_fsync_keeps_previous_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = make(tmp_path, [10])

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        m.save(20, writer(20))
    monkeypatch.undo()
    assert [p.name for p in m.root.iterdir()] == ["step-000010"] and m.verify(m.step_dir(10)) == []


def test_file_size_limit_in_a_real_process(tmp_path: Path) -> None:
    """A real failing write (RLIMIT_FSIZE) inside safetensors, in a child process."""
    m = make(tmp_path, [10])
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from safetensors.torch import save_file
        from trainer.restart.local.checkpoint import CheckpointManager, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        m = CheckpointManager({str(m.root)!r}, keep_last=2)
        try:
            m.save(20, lambda d: save_file({{"w": torch.zeros(1_000_000)}}, d / "optimizer.safetensors"))
        except CheckpointError as e:
            print(e); sys.exit(7)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120
    )
    assert proc.returncode == 7, proc.stderr
    assert "saving checkpoint step 20" in proc.stdout and "step-000020.tmp-" in proc.stdout
    assert [p.name for p in m.root.iterdir()] == ["step-000010"] and m.verify(m.step_dir(10)) == []


def test_check_compatible() -> None:
    structural = {"adapter.r": 8, "data.seq_len": 128, "global_batch_rows": 4}
    saved = TrainState(structural=structural, data_fingerprint="abc")
    assert check_compatible(saved, dict(structural), "abc", allow=False) == []
    changed = {**structural, "adapter.r": 16}
    with pytest.raises(ResumeMismatch) as info:
        check_compatible(saved, changed, "abd", allow=False)
    msg = str(info.value)
    assert "adapter.r: 8 -> 16" in msg and "dataset fingerprint: 'abc' -> 'abd'" in msg
    assert "checkpoint.allow_config_change=true" in msg
    assert len(check_compatible(saved, changed, "abd", allow=True)) == 2
    assert check_compatible({"structural": structural, "data_fingerprint": "abc"}, structural, "abc", False) == []


@pytest.mark.parametrize("cleaner", ["clean_stale", "resolve_resume"])
def test_a_save_killed_between_its_renames_keeps_the_old_copy(tmp_path: Path, cleaner: str) -> None:
    # publish_dir over an existing step-5: the old copy is renamed aside, then the kill comes before the
    # new one is renamed into place. Both are temp names now; the cleaner must not delete both.
    import trainer.atomic as atomic

    m = make(tmp_path, [5])
    final = m.step_dir(5)
    aside = atomic.temp_sibling(final, atomic.REPLACED)
    os.rename(final, aside)  # publish_dir's first rename
    new = atomic.temp_sibling(final)
    new.mkdir()  # the new copy, written and fsynced, not yet renamed
    if cleaner == "clean_stale":
        removed = m.clean_stale()
        assert removed == [new]
    else:
        assert resolve_resume(m.root, "auto")[0] == final
    assert m.verify(final) == [] and not aside.exists() and not new.exists()
    assert json.loads((final / "trainer_state.json").read_text()) == {"step": 5}


def test_remove_temp_siblings_restores_a_replaced_copy(tmp_path: Path) -> None:
    from trainer.atomic import REPLACED, remove_temp_siblings, temp_sibling

    final = tmp_path / "final"
    aside = temp_sibling(final, REPLACED)
    aside.mkdir()
    (aside / "adapter_config.json").write_text("{}")
    unfinished = temp_sibling(final)
    unfinished.mkdir()
    assert remove_temp_siblings(final) == [unfinished]
    assert (final / "adapter_config.json").read_text() == "{}"
    # Control: with `final` in place, a replaced copy is a leftover like any other and goes.
    again = temp_sibling(final, REPLACED)
    again.mkdir()
    assert remove_temp_siblings(final) == [again] and final.is_dir()
