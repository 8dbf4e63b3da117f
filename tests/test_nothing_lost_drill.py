"""Nothing paid for is lost, end to end: `python -m trainer train` against moto's S3 through the fault
proxy (tests/fault_proxy.py), one run taken through every fault sequence that used to delete its history
or end its job for good, one attempt after another:

(d) a store that lists and reads but refuses writes: exit 2 at start, naming s3:PutObject; nothing written;
(a) a fresh machine whose checkpoint downloads fail (503 SlowDown and reset connections): it retries, then
    exits 143 without training (it used to train from step 0, then delete the store's newer checkpoints);
(b) a machine whose disk survived comes back while the store is down, after another machine trained
    further: it trains on its stale checkpoint cut off, then finds the store ahead once it answers and
    exits 143 having written nothing (it used to take the run back and delete the newer timeline);
(c) a transient listing error while two ranks resume: retried, then 143 on both ranks alike (it used to
    be 2, "bad input", on every rank but 0); a shorter one is retried and survived.

Throughout, the store's newest committed step never goes down. At the end the adapter and every logged
loss equal the uninterrupted run's, and every attempt that took the run has its row in the store's ledger
(the write-refused one never took it: it stopped before writing anything)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import warm_start
import yaml
from drill_reference import Reference
from fault_proxy import FaultProxy
from moto_fixture import s3_env
from safetensors.torch import load_file
from test_kill_anywhere import REPO, STEPS, _metric_rows, _recipe, _wait, procs  # noqa: F401 (procs: a fixture)

from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_FILE_ENV, EXIT_PREEMPTED
from trainer.restart.local.checkpoint import MANIFEST, PAUSE_ENV
from trainer.restart.store.lifecycle import Store

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)

DOWNLOADS = r"^(GET|HEAD) /[^?]*/checkpoints/step-\d+/(?!MANIFEST)"
"""A checkpoint's objects, not its manifest: listing and choosing work, downloading does not."""
LISTING = r"^GET /[^/?]+\?[^ ]*prefix=run(/|%2F)checkpoints"
"""Listing the checkpoints (where the ranks choose their step)."""
WRITES = r"^(PUT|POST|DELETE) "


class Newest:
    """The store's newest committed step, watched beside the drill (the test talks to moto directly)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.seen: list[int] = []
        self._manifests: dict[str, str] | None = None  # the manifests' etags at the last reading of `now`
        self._newest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def now(self) -> int:
        self.store.fs.invalidate_cache()
        return (self.store.committed() or [0])[-1]

    def _sample(self) -> int:
        """`now()`, its manifests read only when a listing shows one added, removed or rewritten (its etag): the
        committed steps are a function of the manifests alone, and one listing costs this process (client and
        moto's server) a third of listing and reading every manifest, twice a second for the whole drill."""
        self.store.fs.invalidate_cache()
        found = self.store.fs.find(self.store.path("checkpoints"), detail=True)
        manifests = {k: str(v.get("ETag")) for k, v in found.items() if k.endswith("/" + MANIFEST)}
        if manifests != self._manifests:  # read after the listing: a change in between is seen at the next one
            self._manifests, self._newest = manifests, self.now()
        return self._newest

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.seen.append(self._sample())
            except Exception:  # a listing between an upload's objects: the next one counts
                self._manifests = None
                continue

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        self.seen.append(self.now())
        return self.seen


def _objects(store: Store) -> dict[str, Any]:
    """Every object of the run but the lease (and the probes), with its etag: what a write would change."""
    store.fs.invalidate_cache()
    found = store.fs.find(store.root, detail=True)
    return {k: v["ETag"] for k, v in found.items() if not k.endswith(("lease.json", "-probe"))}


def _ledger(store: Store, tmp: Path) -> list[dict[str, Any]]:
    local = tmp / "store-ledger.jsonl"
    assert store.get("ledger.jsonl", local)
    return [json.loads(x) for x in local.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_no_fault_deletes_what_was_paid_for_and_every_transient_one_is_restartable(
    tmp_path: Path,
    tiny_llama: Path,
    moto_endpoint: str,
    s3_remote: str,
    uninterrupted: Reference,
    procs: list,  # noqa: F811
) -> None:
    data = uninterrupted.data
    a_disk, b_disk = tmp_path / "vm-a", tmp_path / "vm-b"  # two machines' disks for one run
    recipes: dict[Path, Path] = {}
    for out in (a_disk, b_disk):
        raw = _recipe(out, tiny_llama, data, data.parent / "cache")
        raw["checkpoint"].update(
            remote=s3_remote, lease_seconds=3, store_retry_seconds=3, store_outage_seconds=120, notice_seconds=10
        )
        recipes[out] = tmp_path / f"{out.name}.yaml"
        recipes[out].write_text(yaml.safe_dump(raw))
    proxy = FaultProxy(moto_endpoint, tmp_path)
    env = {**s3_env(proxy.url), "AWS_MAX_ATTEMPTS": "1", PAUSE_ENV: "0.5"}  # slow saves: time to act between
    store = Store(s3_remote)  # the test itself talks to moto directly
    logs: list[Path] = []

    def start(out: Path, *, torchrun: bool = False, **extra: str) -> subprocess.Popen:
        logs.append(tmp_path / f"attempt{len(logs) + 1}.log")
        # Forked from the warm forkserver (tests/warm_start.py): a process of its own whose imports are done;
        # under torchrun that is the launcher, and its ranks are forked too.
        args = ["train", str(recipes[out])]
        if torchrun:
            args = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", *args]
        module = "torch.distributed.run" if torchrun else "trainer"
        procs.append(warm_start.start(args, logs[-1], env={**os.environ, **env, **extra}, module=module))
        return procs[-1]

    def said() -> str:
        return logs[-1].read_text()

    def sigterm_once(p: subprocess.Popen, out: Path, at_step: int) -> None:
        """SIGTERM (a spot notice) once `out` has logged step `at_step`: it saves, uploads and exits 143."""
        assert _wait(p, lambda: max((r["step"] for r in _metric_rows(out)), default=0) >= at_step), said()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == EXIT_PREEMPTED, said()

    newest = Newest(store)
    timings: dict[str, float] = {}
    try:
        # (d) Writes refused (403 AccessDenied): exit 2 at start with the permission, not 143 forever.
        began = time.monotonic()
        proxy.set(refuse=[{"match": WRITES, "as": "denied"}])
        p = start(a_disk)
        assert p.wait(timeout=120) == EXIT_BAD_INPUT, said()
        assert "s3:PutObject" in said() and "write refused" in said(), said()
        assert not _objects(store) and not (a_disk / "checkpoints").exists()
        timings["(d) write refused"] = time.monotonic() - began

        # Machine A trains a little (permissions fixed) and is preempted: the store holds its step.
        began = time.monotonic()
        proxy.set()
        sigterm_once(start(a_disk), a_disk, at_step=1)
        a_step = newest.now()
        assert a_step >= 1 and a_step < STEPS, said()
        pids = [procs[-1].pid]

        # (a) A fresh machine B cannot download the checkpoint (503 SlowDown, resets): retried, then 143,
        # nothing trained, nothing written; the store's newest stays.
        proxy.set(refuse=[{"match": DOWNLOADS, "as": "flaky"}])
        before = _objects(store)
        p = start(b_disk)
        assert p.wait(timeout=120) == EXIT_PREEMPTED, said()
        assert "stopping before training from an older checkpoint" in said() and "retrying in" in said(), said()
        assert _metric_rows(b_disk) == _metric_rows(a_disk)  # the run's history came down; it trained nothing
        assert not list((b_disk / "checkpoints").glob("step-*"))
        assert newest.now() == a_step and _objects(store) == before
        pids.append(p.pid)
        timings["A trains, (a) downloads failing"] = time.monotonic() - began

        # B again, the store healthy: it resumes from A's step, trains further, and is preempted.
        began = time.monotonic()
        proxy.set()
        sigterm_once(start(b_disk), b_disk, at_step=a_step + 2)
        b_step = newest.now()
        assert b_step > a_step, (a_step, b_step)
        pids.append(procs[-1].pid)

        # (b) A comes back with its stale disk while the store is down: it trains on from a_step cut off;
        # once the store answers it finds it ahead and stops: 143, nothing written but the lease.
        proxy.set(down=True)
        rows = len(_metric_rows(a_disk))
        p = start(a_disk)
        assert _wait(p, lambda: len(_metric_rows(a_disk)) > rows, timeout=180), said()
        before = _objects(store)
        proxy.set()
        assert p.wait(timeout=180) == EXIT_PREEMPTED, said()
        assert f"Continuing from the local checkpoint step-{a_step:06d}" in said(), said()
        assert f"holds step {b_step}, newer than step {a_step} this attempt resumed from" in said(), said()
        assert _objects(store) == before and newest.now() == b_step
        pids.append(p.pid)
        timings["B trains, (b) stale disk"] = time.monotonic() - began

        # (c) Two ranks resume on A; listing the checkpoints fails for longer than store_retry_seconds:
        # 143 on both ranks (the exit file they merge into says so), nothing trained.
        began = time.monotonic()
        exit_file = tmp_path / "exit-code"
        proxy.set(refuse=[{"match": LISTING, "as": "flaky"}])
        local = sorted(d.name for d in (a_disk / "checkpoints").glob("step-*"))
        p = start(a_disk, torchrun=True, **{EXIT_FILE_ENV: str(exit_file)})
        p.wait(timeout=300)
        assert exit_file.read_text().strip() == str(EXIT_PREEMPTED), said()
        assert "rank 0 could not choose the checkpoint to resume from: reading the checkpoints of" in said(), said()
        assert sorted(d.name for d in (a_disk / "checkpoints").glob("step-*")) == local  # it trained nothing
        assert newest.now() == b_step
        timings["(c) listing failing, two ranks"] = time.monotonic() - began

        # A shorter listing fault is retried and survived: the run resumes from the store's newest and ends.
        began = time.monotonic()
        proxy.set(refuse=[{"match": LISTING, "as": "flaky", "times": 7}])
        p = start(a_disk, **{PAUSE_ENV: "0"})
        assert p.wait(timeout=300) == 0, said()
        assert "retrying in" in said(), said()
        pids.append(p.pid)
        timings["listing retried, finished"] = time.monotonic() - began
    finally:
        seen = newest.stop()
        proxy.stop()
    print("drill durations: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))

    assert seen == sorted(seen), seen  # the store's newest committed step never went down
    assert seen[-1] == STEPS
    assert uninterrupted.same(load_file(a_disk / "final" / "adapter_model.safetensors"))
    assert not uninterrupted.same(uninterrupted.earlier)  # the control
    store.fs.invalidate_cache()
    metrics = tmp_path / "store-metrics.jsonl"
    assert store.get("metrics.jsonl", metrics)
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    trained = [r for r in rows if "loss" in r]
    assert {r["step"] for r in trained} == set(range(1, STEPS + 1))
    assert all(r["loss"] == uninterrupted.losses[r["step"]] for r in trained)  # redone steps included
    ledger = _ledger(store, tmp_path)
    assert set(pids) <= {r["pid"] for r in ledger}, (pids, ledger)
    assert [r for r in ledger if r["world_size"] == 2]  # the two-rank attempt, booked from its lease
    # The stale disk's own row: stopped by the store ahead, as it exited (143), even where it trained to the
    # last step cut off before the store answered: its branch is not the run's.
    (stale,) = [r for r in ledger if r["pid"] == pids[3]]
    assert stale["exit_reason"] == "preempted", stale
    refused = {e.get("action") for e in proxy.log()}
    assert {"refused denied", "refused flaky", "down"} <= refused, refused
