"""Multi-node resume: rank 0 chooses the step and broadcasts it; a node whose local disk is
empty downloads that checkpoint from the store; the rank that ran out of memory pushes its `auto`
record itself. Two gloo processes, each with its own output_dir standing in for its node's disk,
against the moto S3 server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trainer.exit_codes import EXIT_PREEMPTED, code_for
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.ownership.lease import Lease
from trainer.restart.ownership.lease_object import Follower
from trainer.restart.ownership.lock import RunBusy
from trainer.restart.remote.run import RemoteRun
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.remote.uploader import RAN_OUT_FILE
from trainer.restart.store.lifecycle import Store


def _commit(manager: CheckpointManager, step: int, fill: int | None = None) -> Path:
    """Step `step`, its bytes `fill` (another timeline's step of that number: other bytes) or the step."""

    def write(tmp: Path) -> None:
        (tmp / "rng.safetensors").write_bytes(bytes([step if fill is None else fill]) * 512)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))

    return manager.save(step, write).path


def _resolve(rank: int, remote: str | None, node: Path, setting: str = "auto", *, local_main: bool = True) -> str:
    """The checkpoint this rank resumes from, or the class of what it raised."""
    run = RemoteRun(remote, {}, node, keep_last=2, is_main=rank == 0, is_local_main=local_main, retry_seconds=5.0)
    try:
        run.connect()
        return str(run.resolve(setting)[0])
    except Exception as e:
        return type(e).__name__


def _rank(rank: int, tmp: str, remote: str) -> None:
    """Several scenarios in one pair of processes (each start costs seconds)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    (Path(tmp) / f"chosen{rank}").write_text(_resolve(rank, remote, Path(tmp) / f"node{rank}"))
    # The store's copy of rank 0's step holds a late object of a fenced holder (same size, other bytes).
    chosen = _resolve(rank, f"{remote}-late", Path(tmp) / f"late-node{rank}")
    (Path(tmp) / f"late{rank}").write_text(chosen)
    # Both ranks on one node (one disk), no store: rank 0 resumes from a checkpoint outside the run's own.
    explicit = str(Path(tmp) / "elsewhere" / "checkpoints" / "step-000004")
    chosen = _resolve(rank, None, Path(tmp) / "one-node", explicit, local_main=rank == 0)
    (Path(tmp) / f"explicit{rank}").write_text(chosen)
    torch.distributed.destroy_process_group()


def test_rank0_chooses_and_an_empty_node_downloads(tmp_path: Path, s3_remote: str) -> None:
    store = Store(s3_remote)
    # Node 0 has steps 2 and 4 locally; the store has 2 and 4 too (4 is the newest that verifies).
    node0 = CheckpointManager(tmp_path / "node0" / "checkpoints")
    for step in (2, 4):
        store.upload(_commit(node0, step), step)
    # Node 1's disk holds a stale step 6 of an abandoned timeline: it must follow rank 0, not it.
    _commit(CheckpointManager(tmp_path / "node1" / "checkpoints"), 6)
    # Scenario 2: rank 0's step 4 is in the store under the same manifest, but an object there is another
    # writer's (a fenced holder's late upload): node 1's download finds it corrupt; rank 0 sends it again.
    late = Store(f"{s3_remote}-late")
    late_step = late.upload(_commit(CheckpointManager(tmp_path / "late-node0" / "checkpoints"), 4), 4)
    assert late_step > 0
    late.fs.pipe_file(late.step_path(4, "rng.safetensors"), bytes([9]) * 512)
    # Scenario 3: checkpoint.resume=<a path outside output_dir>, while the run's own step 4 is another timeline's.
    explicit = _commit(CheckpointManager(tmp_path / "elsewhere" / "checkpoints"), 4)
    own = _commit(CheckpointManager(tmp_path / "one-node" / "checkpoints"), 4, fill=7)
    mp.spawn(_rank, args=(str(tmp_path), s3_remote), nprocs=2, join=True)
    chosen = [Path((tmp_path / f"chosen{r}").read_text()) for r in (0, 1)]
    assert [p.name for p in chosen] == ["step-000004", "step-000004"]
    assert chosen[1] == tmp_path / "node1" / "checkpoints" / "step-000004"
    assert CheckpointManager(chosen[1].parent).verify(chosen[1]) == []  # downloaded and verified
    assert (chosen[1] / "rng.safetensors").read_bytes() == bytes([4]) * 512

    fetched = tmp_path / "late-node1" / "checkpoints" / "step-000004"
    assert [(tmp_path / f"late{r}").read_text() for r in (0, 1)] == [
        str(tmp_path / "late-node0" / "checkpoints" / "step-000004"),
        str(fetched),
    ]  # once exit 143 on every rank, and the next attempt met the same store: forever
    assert (fetched / "rng.safetensors").read_bytes() == bytes([4]) * 512
    assert late.fs.cat_file(late.step_path(4, "rng.safetensors")) == bytes([4]) * 512

    # Every rank of rank 0's node restores rank 0's checkpoint, not the run's own step of that number.
    assert [(tmp_path / f"explicit{r}").read_text() for r in (0, 1)] == [str(explicit)] * 2
    assert CheckpointManager(own.parent).verify(own) == []  # control: the other step 4 is there and verifies


def _faults_of_one_rank(rank: int, tmp: str, remote: str, dead: str) -> None:
    """Two scenarios in one pair of processes (each start costs seconds): rank 1 runs out of memory; then
    node 1 lacks rank 0's step while the store does not answer."""
    import os

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg-faults", rank=rank, world_size=2)
    node = Path(tmp) / f"oom-node{rank}"
    lease = None
    if rank == 0:  # the job's main process holds the run, as owner.take does
        lease = Lease(Store(remote), 30.0, node, message=lambda m: None)
        lease.acquire()
    run = RemoteRun(remote, {}, node, keep_last=2, is_main=rank == 0, is_local_main=True, message=lambda m: None)
    run.fence = lease
    run.connect()
    if rank == 1:  # it ran out of memory with an `auto` setting: the record, then the push from this rank
        node.mkdir(parents=True, exist_ok=True)
        (node / RAN_OUT_FILE).write_text('{"micro_batch_size": 4, "gradient_checkpointing": false}\n')
        run.push_run_files(notice_seconds=5.0)
    torch.distributed.barrier()
    if lease is not None:
        lease.release()

    os.environ.update(AWS_ENDPOINT_URL=dead, AWS_MAX_ATTEMPTS="1")  # nothing listens there
    node = Path(tmp) / f"down-node{rank}"
    run = RemoteRun(remote, {}, node, keep_last=2, is_main=rank == 0, is_local_main=True, retry_seconds=0.5)
    run.message = lambda m: None
    try:
        run.connect()  # rank 0 has a local checkpoint: it goes on cut off
        run.resolve("auto")
        outcome = "resumed"
    except Exception as e:
        outcome = str(code_for(e))  # what cli/main exits with: the class may be the agreed failure's
    (Path(tmp) / f"outcome{rank}").write_text(outcome)
    torch.distributed.destroy_process_group()


def test_a_fault_on_one_rank(tmp_path: Path, s3_remote: str) -> None:
    """- Rank 1's `auto` setting ran out of memory: its record reaches the store from rank 1 itself (rank 0 is
    stuck in a collective), under the attempt's lease, so a fresh machine does not choose it again.
    - Rank 0 resumes from its local step, node 1 lacks it and the store does not answer: every rank raises
    ends with exit 143 (restartable), not 2 ("bad input", which it used to be)."""
    from moto_fixture import free_port

    _commit(CheckpointManager(tmp_path / "down-node0" / "checkpoints"), 2)
    dead = f"http://127.0.0.1:{free_port()}"
    mp.spawn(_faults_of_one_rank, args=(str(tmp_path), s3_remote, dead), nprocs=2, join=True)
    fresh = tmp_path / "fresh"
    assert RAN_OUT_FILE in fetch_run_files(Store(s3_remote), fresh)
    assert json.loads((fresh / RAN_OUT_FILE).read_text())["micro_batch_size"] == 4
    # The control: a rank whose attempt no longer holds the lease writes nothing.
    stale = Store(s3_remote)
    stale.fence = Follower(stale, holder="an attempt that is gone")
    (tmp_path / "other.json").write_text("{}\n")
    with pytest.raises(RunBusy):
        stale.put(tmp_path / "other.json", "other.json")
    assert [(tmp_path / f"outcome{r}").read_text() for r in (0, 1)] == [str(EXIT_PREEMPTED)] * 2


def _new_run_rank(rank: int, tmp: str, remote: str) -> None:
    """checkpoint.resume=never on two nodes, each with its own disk holding the old run."""
    from trainer.restart.remote import new_run

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg-never", rank=rank, world_size=2)
    node = Path(tmp) / f"never-node{rank}"
    run = RemoteRun(remote, {}, node, keep_last=2, is_main=rank == 0, is_local_main=True, message=lambda m: None)
    stamp = new_run.stamp() + (f"-rank{rank}" if rank else "")  # rank 0's name must win on every node
    run.connect(new_run.Request("never", stamp), lambda folder: new_run.set_aside(node, folder))
    (Path(tmp) / f"never{rank}").write_text(str(run.resolve(run.request.acts_on)[0]))
    torch.distributed.destroy_process_group()


def test_resume_never_sets_every_nodes_own_disk_aside(tmp_path: Path) -> None:
    """Before, only rank 0's disk was set aside: node 1 kept the old run's checkpoints committed and its files
    (a later `auto` there could meet them). Each node's disk now goes aside into rank 0's folder name."""
    remote = (tmp_path / "store").as_uri()
    (tmp_path / "store").mkdir()
    for rank in (0, 1):
        node = tmp_path / f"never-node{rank}"
        _commit(CheckpointManager(node / "checkpoints"), 4)
        (node / "metrics.jsonl").write_text('{"step": 4}\n')
    mp.spawn(_new_run_rank, args=(str(tmp_path), remote), nprocs=2, join=True)
    assert [(tmp_path / f"never{r}").read_text() for r in (0, 1)] == ["None", "None"]
    folders = []
    for rank in (0, 1):
        node = tmp_path / f"never-node{rank}"
        assert CheckpointManager(node / "checkpoints").committed() == [], rank
        assert [p.name.split(".retired-")[0] for p in (node / "checkpoints").iterdir()] == ["step-000004"]
        aside = [p for p in node.iterdir() if p.name.startswith("previous-run-")]
        assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == '{"step": 4}\n', rank
        folders.append(aside[0].name)
    assert folders[0] == folders[1] and "rank1" not in folders[1]
