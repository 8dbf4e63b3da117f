"""The rule that keeps what a run paid for (trainer/restart/store/safety.py), broken on purpose against moto's S3:
every store write that would take a committed checkpoint out of sight above the step the attempt resumed
from is refused before it happens, and the store is left as it was. Each with the control that lets the
same write through when the rule allows it. And the rule's reach: every path of trainer/ that deletes,
moves or uncommits remote state asks it first."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from fences import Generation

from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.safety import Floor, SafetyViolation

PACKAGE = Path(__file__).resolve().parents[1] / "trainer"


def _commit(root: Path, step: int, fill: int | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(bytes([fill if fill is not None else step % 256]) * 512)

    return CheckpointManager(root, keep_last=10).save(step, write).path


def _store(remote: str, generation: int, resumed: int | None, seen: list[int], **kw: object) -> Store:
    store = Store(remote)
    store.fence = Generation(generation)
    store.floor.choose(resumed, seen, generation=generation, **kw)  # type: ignore[arg-type]
    return store


def test_a_fresh_machine_that_trained_from_step_0_cannot_hide_the_newer_checkpoints(
    tmp_path: Path, s3_remote: str
) -> None:
    """The fault sequence the rule is for: the store holds 16 and 20 (generation 1); a new holder saw them,
    could not download them, and trained from step 0. Its first commit (step 2, generation 2) would make
    16 and 20 a fenced holder's late writes (the generation rule), which `clean` then deletes."""
    local = tmp_path / "local"
    first = _store(s3_remote, 1, None, [])
    for step in (16, 20):
        first.upload(_commit(local, step), step)
    late = _store(s3_remote, 2, None, [16, 20])  # resumed from step 0 although it saw 16 and 20
    with pytest.raises(SafetyViolation, match=r"committing step 2 would take committed step\(s\) \[16, 20\]"):
        late.upload(_commit(local, 2), 2)
    assert Store(s3_remote).committed() == [16, 20]  # untouched: the manifest of step 2 was never written
    assert not late.fs.exists(late.step_path(2, MANIFEST))

    # Uncommitting one it protects (the same step again, other bytes) and pruning one are refused too.
    with pytest.raises(SafetyViolation, match="replacing step 20"):
        _store(s3_remote, 2, 16, [16, 20]).upload(_commit(tmp_path / "other", 20, fill=7), 20)
    with pytest.raises(SafetyViolation, match=r"pruning would take committed step\(s\) \[16\]"):
        _store(s3_remote, 2, 10, [16, 20]).prune(keep_last=1)
    assert Store(s3_remote).committed() == [16, 20]
    theirs = json.loads(Store(s3_remote).fs.cat_file(first.step_path(20, MANIFEST)))["files"]
    assert theirs == json.loads((local / "step-000020" / MANIFEST).read_text())["files"]

    # 20 found corrupt when it chose is still kept: not replaced (its objects would be overwritten), only
    # retired (renamed, kept), and a retire of a step that was not found corrupt is refused.
    corrupt = _store(s3_remote, 2, 16, [16, 20], corrupt=[20])
    with pytest.raises(SafetyViolation, match="replacing step 20 .* a checkpoint found corrupt is retired"):
        corrupt.upload(_commit(tmp_path / "other", 20, fill=7), 20)
    with pytest.raises(SafetyViolation, match=r"retiring would take committed step\(s\) \[20\]"):
        _store(s3_remote, 2, 16, [16, 20]).retire(16, only={20})
    assert Store(s3_remote).committed() == [16, 20]

    # The controls, where the rule allows: 20 found corrupt retired, then replaced by this attempt's own;
    # 16 at or below the step it resumed from (pruned), a holder that resumed from the newest (commits above it).
    (kept,) = corrupt.retire(16, only={20})
    corrupt.upload(_commit(tmp_path / "other", 20, fill=7), 20)
    assert corrupt.fs.exists(corrupt.path("checkpoints", kept, "adapter_model.safetensors"))
    assert _store(s3_remote, 2, 20, [16, 20]).prune(keep_last=1) == [16]
    _store(s3_remote, 3, 20, [20]).upload(_commit(local, 22), 22)
    assert Store(s3_remote).committed() == [20, 22]


def _guarded(source: str, name: str) -> list[str]:
    """The functions of `source` that delete, move or uncommit store objects without asking the floor."""
    offenders = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)]
        mutates = any(
            c.func.attr in ("rm", "rm_file", "mv") and ast.unparse(c.func.value).endswith("fs") for c in calls
        )  # type: ignore[attr-defined]
        asks = any(ast.unparse(c.func).startswith(("self.floor.allow", "self._allow")) for c in calls)
        if mutates and not asks:
            offenders.append(f"{name}:{node.name}")
    return offenders


# The one store deletion that is no run state: `Store.check` writes and deletes its own probe object.
PROBE = {"restart/store/transport.py:check"}


def test_every_path_that_deletes_moves_or_uncommits_remote_state_asks_the_rule() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        offenders += [o for o in _guarded(path.read_text(), rel) if o not in PROBE]
    assert not offenders, f"these delete, move or uncommit store objects without Floor.allow: {offenders}"
    # The control: an unguarded delete is seen, a guarded one is not; and the real code does delete.
    bad = "def prune(self):\n    self.fs.rm_file('x')\n"
    good = "def prune(self):\n    self.floor.allow('p', [], [])\n    self.fs.rm_file('x')\n"
    assert _guarded(bad, "f.py") == ["f.py:prune"] and _guarded(good, "f.py") == []
    assert "restart/store/lifecycle.py:prune" in _guarded(
        (PACKAGE / "restart" / "store" / "lifecycle.py").read_text().replace("self._allow(", "self._skip("),
        "restart/store/lifecycle.py",
    )


def test_an_unfinished_upload_is_removed_only_when_nothing_in_it_is_kept() -> None:
    """`Store.clean` asks this before deleting a step directory without a manifest: the directory of a retire
    cut off midway (its marker still there, or a retired folder of its step beside it) holds paid-for data."""
    floor = Floor()
    floor.allow_unfinished("s3://b/run/checkpoints/step-000010", {"adapter_model.safetensors"}, [])  # the control
    with pytest.raises(SafetyViolation, match=r"holds \['RETIRED-MANIFEST.json'\]"):
        floor.allow_unfinished("step-000010", {"adapter_model.safetensors", "RETIRED-MANIFEST.json"}, [])
    with pytest.raises(SafetyViolation, match=r"retired beside it: \['step-000010.retired-20260101T000000'\]"):
        floor.allow_unfinished("step-000010", {"adapter_model.safetensors"}, ["step-000010.retired-20260101T000000"])
    with pytest.raises(SafetyViolation, match="MANIFEST.json"):
        floor.allow_unfinished("step-000010", {"MANIFEST.json"}, [])
