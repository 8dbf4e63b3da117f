"""The floor of trainer/restart/store/safety.py is built once per attempt, under the lease, and a corrupt verdict
is confirmed before anything acts on it. Against a `file://` store (a folder), with real `Lease` objects:

- one machine whose reads of every newer remote checkpoint fail their hash check (bad RAM, a bad disk)
  used to train from step 0 and then delete them (the store went from [100, 200, 300] to [50]): now a
  second download into a fresh directory must agree, a checkpoint found corrupt is retired (renamed,
  kept), and with nothing local that verifies the attempt stops with exit 2 naming the steps;
- an attempt whose first lease request blipped chose from a listing made without the lease; the holder
  committed 600 and 700 meanwhile and released; the attempt took the lease, replaced 600 and deleted
  700: now the floor, read under another generation, reads the store again and stops (StoreAhead, 143);
- a stale listing (it missed the newest steps) no longer lets a commit hide them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fences import Generation

from trainer.exit_codes import EXIT_BAD_INPUT, code_for
from trainer.restart.local.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from trainer.restart.ownership.lease import Lease
from trainer.restart.remote.choose import choose
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.safety import SafetyViolation, StoreAhead


class BadReads:
    """This machine's filesystem view of the store: every checkpoint object it downloads comes back with a
    byte flipped (bad RAM, a bad disk or tmpfs), its first `times` reads of each object (None: every read)."""

    def __init__(self, fs: Any, times: int | None = None) -> None:
        self._fs = fs
        self.times = times
        self.reads: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def get_file(self, rpath: str, lpath: str, **kw: Any) -> None:
        self._fs.get_file(rpath, lpath, **kw)
        if rpath.endswith(MANIFEST):
            return
        n = self.reads[rpath] = self.reads.get(rpath, 0) + 1
        if self.times is None or n <= self.times:
            data = bytearray(Path(lpath).read_bytes())
            data[0] ^= 0xFF
            Path(lpath).write_bytes(bytes(data))


def _commit(root: Path, step: int, fill: int | None = None) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(bytes([fill if fill is not None else step % 256]) * 512)

    return CheckpointManager(root, keep_last=10).save(step, write).path


def _writer(url: str, generation: int, resumed: int | None, seen: list[int]) -> Store:
    store = Store(url)
    store.fence = Generation(generation)
    store.floor.choose(resumed, seen, generation=generation)
    return store


def _history(tmp_path: Path, steps: tuple[int, ...] = (100, 200, 300)) -> str:
    """A run whose store holds `steps`, committed by generation 1."""
    url = f"file://{tmp_path / 'store'}"
    first = _writer(url, 1, None, [])
    for step in steps:
        first.upload(_commit(tmp_path / "first", step), step)
    assert Store(url).committed() == list(steps)
    return url


def _fresh(url: str, generation: int, times: int | None = None) -> Store:
    store = Store(url)
    store.fence = Generation(generation)
    store.fs = BadReads(store.fs, times)
    return store


def _retired(url: str) -> list[str]:
    store = Store(url)
    return sorted(
        p.rsplit("/", 1)[-1] for p in store.fs.ls(store.path("checkpoints"), detail=False) if ".retired-" in p
    )


def test_one_machines_corrupt_reads_stop_the_attempt_with_exit_2_and_delete_nothing(tmp_path: Path) -> None:
    url = _history(tmp_path)
    fresh = _fresh(url, 2)
    root = tmp_path / "fresh" / "checkpoints"
    with pytest.raises(
        CheckpointError, match=r"every checkpoint of checkpoint.remote=.* \(\[100, 200, 300\]\) is corrupt"
    ) as e:
        choose(root, "auto", fresh, True, budget=0, message=print)
    assert code_for(e.value) == EXIT_BAD_INPUT  # a setting or a machine to look at: no restart in a loop
    assert "step 300: " in str(e.value) and "sha256 differs" in str(e.value) and "another machine" in str(e.value)
    assert all(n == 2 for n in fresh.fs.reads.values()) and len(fresh.fs.reads) == 3  # each confirmed once
    assert Store(url).committed() == [100, 200, 300] and _retired(url) == []  # nothing changed in the store
    assert not list(root.glob("step-*"))  # no download left behind, no confirmation folder either


def test_a_corrupt_read_that_a_second_download_does_not_confirm_is_used(tmp_path: Path) -> None:
    url = _history(tmp_path)
    fresh = _fresh(url, 2, times=1)  # one bad read per object, then good ones
    chosen, notes = choose(tmp_path / "fresh" / "checkpoints", "auto", fresh, True, budget=0, message=print)
    assert chosen == tmp_path / "fresh" / "checkpoints" / "step-000300"
    assert not CheckpointManager(chosen.parent).verify(chosen)
    assert any("read corrupt once" in n and "step-000300" in n for n in notes), notes
    assert fresh.floor.resumed == 300 and Store(url).committed() == [100, 200, 300]
    assert [p.name for p in chosen.parent.iterdir()] == ["step-000300"]  # the confirmation folder is gone


def test_checkpoints_found_corrupt_are_retired_and_kept_when_an_older_one_verifies(tmp_path: Path) -> None:
    """The store's objects really are corrupt (every read agrees), and this disk holds step 50 that verifies:
    the attempt resumes from 50, and 100-300 are retired (renamed, kept) before its first commit, which
    would otherwise make them a fenced holder's late writes for `clean` to delete."""
    url = _history(tmp_path)
    store = Store(url)
    for step in (100, 200, 300):  # the bytes in the store disagree with their manifests
        store.fs.pipe_file(store.step_path(step, "adapter_model.safetensors"), b"\x00" * 512)
    root = tmp_path / "fresh" / "checkpoints"
    local = _commit(root, 50)
    fresh = _fresh(url, 2, times=0)  # this machine reads correctly
    chosen, notes = choose(root, "auto", fresh, True, budget=0, message=print)
    assert chosen == local
    assert any("retired the corrupt remote checkpoint(s) [100, 200, 300]" in n for n in notes), notes
    retired = _retired(url)
    assert [r.split(".")[0] for r in retired] == ["step-000100", "step-000200", "step-000300"]
    for name in retired:  # kept whole: the objects and the manifest, renamed
        assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(store.path("checkpoints", name), detail=False)) == [
            "RETIRED-MANIFEST.json",
            "adapter_model.safetensors",
        ]
    fresh.upload(local, 50)
    fresh.upload(_commit(root, 60), 60)
    assert fresh.clean() == [] and fresh.prune(keep_last=2) == []
    assert Store(url).committed() == [50, 60] and _retired(url) == retired  # nothing deleted, ever


def test_a_corrupt_step_is_protected_until_retired(tmp_path: Path) -> None:
    url = _history(tmp_path, (100, 200))
    store = _writer(url, 2, 100, [100, 200])
    store.floor.choose(100, [100, 200], corrupt=[200], generation=2)
    with pytest.raises(SafetyViolation, match=r"committing step 150 would take committed step\(s\) \[200\]"):
        store.upload(_commit(tmp_path / "mine", 150), 150)
    with pytest.raises(SafetyViolation, match=r"retiring would take committed step\(s\) \[100\]"):
        _writer(url, 2, 50, [100, 200]).retire(50, only={100})  # only one found corrupt (or a new timeline)
    assert Store(url).committed() == [100, 200]
    store.retire(100, only={200})  # the control
    store.upload(_commit(tmp_path / "mine", 150), 150)
    assert Store(url).committed() == [100, 150]


def test_a_floor_chosen_without_the_lease_is_read_again_when_the_lease_is_taken(tmp_path: Path) -> None:
    """Real leases: the holder H has 500 committed; attempt A's first lease request blipped (it goes on cut
    off, as `owner.take` does), and it chooses 500 from a listing made without the lease. H, in its notice
    window, commits 600 and 700 and releases. A's lease thread takes the lease; A saves its own 600. It used
    to replace H's 600 and, with its commit hiding 700, delete 700 at the next `clean`."""
    (tmp_path / "store").mkdir()  # the mounted folder a `file://` store is
    url = f"file://{tmp_path / 'store'}"
    said: list[str] = []
    holder = Lease(Store(url), 30.0, tmp_path / "h", message=said.append)
    holder.acquire()
    holder.store.fence = holder
    holder.store.floor.choose(None, [], generation=holder.generation)
    theirs = {step: _commit(tmp_path / "h" / "checkpoints", step) for step in (500, 600, 700)}
    holder.store.upload(theirs[500], 500)

    attempt = Lease(Store(url), 30.0, tmp_path / "a", message=said.append)
    attempt.offline("a blip: connection reset")  # its first request failed; the lease thread takes it later
    store = Store(url)
    store.fence = attempt
    stopped: list[str] = []
    store.floor.on_ahead = stopped.append
    chosen, _ = choose(tmp_path / "a" / "checkpoints", "auto", store, True, budget=0, message=said.append)
    assert chosen is not None and chosen.name == "step-000500"

    for step in (600, 700):  # the holder's notice window
        holder.store.upload(theirs[step], step)
    holder.release()
    attempt.keeper.tick()  # the lease thread: the store answers, the lease is free
    assert attempt.held and attempt.generation == 2

    ours = _commit(tmp_path / "a" / "checkpoints", 600, fill=9)  # trained 500 -> 600 on its own
    with pytest.raises(StoreAhead, match="holds step 700, newer than step 500 .* without holding the run's lease"):
        store.upload(ours, 600)
    with pytest.raises(StoreAhead):  # and writes nothing more there
        store.prune(keep_last=1)
    assert len(stopped) == 1  # asked to stop once: save locally, exit 143; the next attempt resumes from 700
    assert Store(url).committed() == [500, 600, 700]
    there = json.loads(Store(url).fs.cat_file(store.step_path(600, MANIFEST)))["files"]
    assert there == json.loads((theirs[600] / MANIFEST).read_text())["files"]  # the holder's 600, untouched

    # The control: chosen while holding the lease, the same attempt's floor lets its commits through.
    attempt.release()
    again = Lease(Store(url), 30.0, tmp_path / "a", message=said.append)
    again.acquire()
    store = Store(url)
    store.fence = again
    chosen, _ = choose(tmp_path / "a2" / "checkpoints", "auto", store, True, budget=0, message=said.append)
    assert chosen is not None and chosen.name == "step-000700" and store.floor.generation == 3
    store.upload(_commit(tmp_path / "a2" / "checkpoints", 800), 800)
    assert Store(url).committed() == [500, 600, 700, 800]
    again.release()


def test_a_stale_listing_never_lets_a_commit_hide_the_steps_it_missed(tmp_path: Path) -> None:
    """The attempt holds the lease, but its listing (an NFS attribute cache, an eventually consistent
    gateway) missed 600 and 700: committing 550 under its newer generation would hide them (the generation
    rule), and `clean` would then delete them. The floor stops the attempt instead (StoreAhead, exit 143)."""
    url = _history(tmp_path, (500, 600, 700))
    stale = _writer(url, 2, 500, [500])
    with pytest.raises(StoreAhead, match=r"holds committed step\(s\) \[600, 700\]"):
        stale.upload(_commit(tmp_path / "a", 550), 550)
    assert Store(url).committed() == [500, 600, 700]
    assert not Store(url).fs.exists(stale.step_path(550, MANIFEST))
    # The control: the steps it committed itself are its own to hide or prune.
    fresh = _writer(url, 3, 700, [500, 600, 700])
    for step in (710, 720, 730):
        fresh.upload(_commit(tmp_path / "b", step), step)
    assert fresh.prune(keep_last=2) == [500, 600, 700, 710]  # those at or below 700, and its own 710
    assert Store(url).committed() == [720, 730]


def test_a_late_write_of_the_very_bytes_this_attempt_trained_is_its_own_to_prune(tmp_path: Path) -> None:
    """A killed holder's (generation 1) manifest PUT of step 400 lands after this attempt (generation 2)
    resumed from 300; it trains 400 itself, the same bytes (exact resume), and its upload finds those very
    bytes committed and sends nothing. Pruning 400 once 500 and 600 are committed takes nothing paid for:
    it used to count 400 as another machine's newer step and stop a healthy attempt (StoreAhead, exit 143)."""
    url = _history(tmp_path)
    taker = _writer(url, 2, 300, [100, 200, 300])
    _writer(url, 1, 300, [100, 200, 300]).upload(_commit(tmp_path / "killed", 400), 400)  # the late write lands
    assert taker.upload(_commit(tmp_path / "taker", 400), 400) == 0  # those very bytes: nothing sent
    for step in (500, 600):
        taker.upload(_commit(tmp_path / "taker", step), step)
    assert taker.prune(2) == [100, 200, 300, 400]
    assert Store(url).committed() == [500, 600] and taker.floor.ahead is None


def test_a_late_manifest_out_of_sight_is_replaced_not_taken_for_this_attempts_commit(tmp_path: Path) -> None:
    """A killed holder's (generation 1) manifest of step 500 lands above this attempt's (generation 2) newest
    commit, 400: readers do not see it (the generation rule). The attempt's own upload of 500, the same bytes,
    commits it under its generation instead of taking the hidden one for committed (step 500 stayed out of
    every reader's sight, the store's newest stuck at 400)."""
    url = _history(tmp_path)
    taker = _writer(url, 2, 300, [100, 200, 300])
    taker.upload(_commit(tmp_path / "taker", 400), 400)
    _writer(url, 1, 300, [100, 200, 300]).upload(_commit(tmp_path / "killed", 500), 500)  # the late write lands
    assert Store(url).committed() == [100, 200, 300, 400]  # out of sight: generation 2 committed only up to 400
    assert taker.upload(_commit(tmp_path / "taker", 500), 500) > 0
    assert Store(url).committed() == [100, 200, 300, 400, 500]
