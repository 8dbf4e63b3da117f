"""Multi-node resume: rank 0 chooses the step and broadcasts it; a node whose local disk is
empty downloads that checkpoint from the store. Two gloo processes, each with its own
output_dir standing in for its node's disk, against the moto S3 server."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trainer.restart.checkpoint import CheckpointManager
from trainer.restart.remote import RemoteRun
from trainer.restart.storage import Store


def _commit(manager: CheckpointManager, step: int) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "rng.safetensors").write_bytes(bytes([step]) * 512)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))

    return manager.save(step, write).path


def _rank(rank: int, tmp: str, remote: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    node = Path(tmp) / f"node{rank}"
    run = RemoteRun(remote, {}, node, keep_last=2, is_main=rank == 0, is_local_main=True)
    run.connect()
    path, _ = run.resolve("auto")
    (Path(tmp) / f"chosen{rank}").write_text(str(path))
    torch.distributed.destroy_process_group()


def test_rank0_chooses_and_an_empty_node_downloads(tmp_path: Path, s3_remote: str) -> None:
    store = Store(s3_remote)
    # Node 0 has steps 2 and 4 locally; the store has 2 and 4 too (4 is the newest that verifies).
    node0 = CheckpointManager(tmp_path / "node0" / "checkpoints")
    for step in (2, 4):
        store.upload(_commit(node0, step), step)
    # Node 1's disk holds a stale step 6 of an abandoned timeline: it must follow rank 0, not it.
    _commit(CheckpointManager(tmp_path / "node1" / "checkpoints"), 6)
    mp.spawn(_rank, args=(str(tmp_path), s3_remote), nprocs=2, join=True)
    chosen = [Path((tmp_path / f"chosen{r}").read_text()) for r in (0, 1)]
    assert [p.name for p in chosen] == ["step-000004", "step-000004"]
    assert chosen[1] == tmp_path / "node1" / "checkpoints" / "step-000004"
    assert CheckpointManager(chosen[1].parent).verify(chosen[1]) == []  # downloaded and verified
    assert (chosen[1] / "rng.safetensors").read_bytes() == bytes([4]) * 512
