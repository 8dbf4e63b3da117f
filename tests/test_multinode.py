"""Two nodes on localhost: two `torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1}`
launchers (static rendezvous: node_rank 0 holds rank 0), gloo on CPU, each node with its own
output_dir and data cache (its own disk) and one shared checkpoint store (moto S3).

Both nodes are SIGKILLed once rank 0 has committed a few checkpoints, and the newest one is
taken back out of the store (the kill came before its upload finished). Node 1's disk holds
a copy of that same step from an abandoned timeline: it verifies, but it is not rank 0's.
Relaunched, rank 0 chooses its own newest step, uploads it, and broadcasts it with the digest
of its files; node 1 sees that its copy differs and downloads rank 0's. The run then trains
every step on the rows of an uninterrupted single process and ends with its adapter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
import warm_start
from moto_fixture import s3_env
from safetensors.torch import load_file, save_file
from test_elastic import STEPS, _adapter, _args, _assert_close, _digests, _free_port

from trainer import config as C
from trainer.data.cache import in_turns
from trainer.restart.books.ledger import Ledger, read_rows
from trainer.restart.local.checkpoint import MANIFEST, PAUSE_ENV, CheckpointManager
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.store.lifecycle import Store
from trainer.training import run

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)

GLOBAL_BATCH = 2  # one row per rank per step on two nodes; two micro-batches in one process


def _launch(nodes: list[list[str]], logs: list[Path], env: dict[str, str]) -> list[warm_start.Started]:
    """One torchrun per node, as each machine of a cluster would start it."""
    port = str(_free_port())
    procs = []
    for node_rank, (args, log) in enumerate(zip(nodes, logs, strict=True)):
        cmd = [
            "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
            "--master_addr", "127.0.0.1", "--master_port", port, "-m", "trainer", "train", *args,
        ]  # fmt: skip
        # The launcher forked from the warm forkserver (tests/warm_start.py); its rank is a fresh interpreter.
        procs.append(warm_start.start(cmd, log, env=env, module="torch.distributed.run"))
    return procs


def _kill_all(procs: list[warm_start.Started]) -> None:
    """SIGKILL every launcher and worker together (one at a time, a survivor would see its peer
    vanish and exit on its own first)."""
    family: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            family += psutil.Process(p.pid).children(recursive=True)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for q in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    for p in procs:
        p.wait()
    psutil.wait_procs(family, timeout=30)


def _wait(procs: list[warm_start.Started], until, logs: list[Path], timeout: float = 300) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            _kill_all([p for p in procs if p.poll() is None])
            raise AssertionError("\n\n".join(f"{log}:\n{log.read_text()[-2500:]}" for log in logs))
        time.sleep(0.05)


def _newest_step(out: Path) -> int:
    """Rank 0's newest committed step (the uploader's staging links beside it are no checkpoints)."""
    committed = CheckpointManager(out / "checkpoints").committed()
    return CheckpointManager.step_of(committed[-1]) if committed else 0


def _files(checkpoint: Path) -> dict:
    return json.loads((checkpoint / MANIFEST).read_text())["files"]


def _stale_copy(src: Path, root: Path) -> Path:
    """Step `src` as an abandoned timeline left it on another disk: committed and verifying, other bytes."""

    def write(tmp: Path) -> None:
        for f in src.iterdir():
            if f.name == "adapter_model.safetensors":
                save_file({k: v + 0.01 for k, v in load_file(f).items()}, tmp / f.name)
            elif f.name != MANIFEST:
                (tmp / f.name).write_bytes(f.read_bytes())

    return CheckpointManager(root).save(CheckpointManager.step_of(src), write).path


@pytest.mark.slow
def test_two_nodes_resume_from_rank0s_step_after_a_kill(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, moto_endpoint: str, s3_remote: str
) -> None:
    ref = tmp_path / "reference"
    assert run.train(C.load(None, _args(tiny_llama, tiny_data, tmp_path / "ref-cache", ref, GLOBAL_BATCH))) == 0

    disks = [tmp_path / "node0", tmp_path / "node1"]
    outs = [d / "run" for d in disks]
    nodes = [
        [*_args(tiny_llama, tiny_data, d / "cache", d / "run", GLOBAL_BATCH), f"checkpoint.remote={s3_remote}"]
        for d in disks
    ]
    env = {**os.environ, **s3_env(moto_endpoint)}  # OMP_NUM_THREADS=1: `bitwise`
    env["PYTHONUNBUFFERED"] = "1"
    logs = [tmp_path / "node0-a.log", tmp_path / "node1-a.log"]
    procs = _launch(nodes, logs, {**env, PAUSE_ENV: "0.2"})  # slow saves: a fast machine cannot finish before the kill
    _wait(procs, lambda: _newest_step(outs[0]) >= 3, logs)
    _kill_all(procs)  # both machines gone at once: no handler runs anywhere
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2

    store = Store(s3_remote)
    step = _newest_step(outs[0])
    assert 3 <= step < STEPS
    if step in store.committed():  # the kill came before the newest upload finished (or now it did)
        store.fs.rm_file(store.step_path(step, MANIFEST))
    assert step not in store.committed()
    rank0 = outs[0] / "checkpoints" / f"step-{step:06d}"
    want = _files(rank0)
    at_step = load_file(rank0 / "adapter_model.safetensors")  # pruned locally before the run ends
    stale = _stale_copy(rank0, outs[1] / "checkpoints")
    assert CheckpointManager(stale.parent).verify(stale) == [] and _files(stale) != want

    logs = [tmp_path / "node0-b.log", tmp_path / "node1-b.log"]
    procs = _launch(nodes, logs, env)
    _wait(procs, lambda: all(p.poll() is not None for p in procs), logs)
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log.read_text()[-2500:] for log in logs)
    node0, node1 = (log.read_text() for log in logs)

    # Rank 0 chose its own newest step, put it in the store, and every rank resumed from it.
    assert f"resuming from {rank0} at step {step} of {STEPS}" in node0
    assert f"uploaded {s3_remote}/checkpoints/step-{step:06d} for the nodes that lack it" in node0
    assert f"rank 1: this node lacked step {step}; downloaded {s3_remote}/checkpoints/step-{step:06d}" in node1
    assert f"rank 1: resuming from {stale} at step {step} (chosen by rank 0)" in node1
    assert _files(stale) == want, "node 1 replaced its stale copy with rank 0's checkpoint"
    assert CheckpointManager(stale.parent).verify(stale) == []

    # The same rows every step as one uninterrupted process (the redone steps too), and its adapter.
    expected = _digests(ref)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert _digests(outs[0]) == expected
    _assert_close(_adapter(outs[0]), _adapter(ref))
    assert not (outs[1] / "final").exists(), "only rank 0 writes the final adapter"
    # Control: the tolerance is tight enough to tell the checkpoint at `step` from the end of the run.
    at_step = {k.replace(".default", ""): v for k, v in at_step.items()}
    assert at_step.keys() == _adapter(ref).keys()
    with pytest.raises(AssertionError, match="max abs difference"):
        _assert_close(at_step, _adapter(ref))
    assert all(torch.isfinite(t).all() for t in _adapter(outs[0]).values())


def _prepare_on_two_nodes_of_two(
    turns: Callable[..., str], shared_disk: bool
) -> tuple[list[tuple[str, int]], dict[int, str]]:
    """Four rank threads, two per node, each preparing through `turns`; a node's cache is a dict
    entry (one for both nodes when `shared_disk`). Returns the events and each rank's result."""
    barrier = threading.Barrier(4, timeout=30)
    lock = threading.Lock()
    caches: dict[int, str] = {}
    events: list[tuple[str, int]] = []
    results: dict[int, str] = {}

    def rank(r: int) -> None:
        node = 0 if shared_disk else r // 2

        def build() -> str:
            with lock:
                hit = caches.get(node)
                events.append(("reuse" if hit else "prepare", r))
            if hit:
                return hit
            time.sleep(0.05)  # preparing takes a while: concurrent builds of one cache overlap
            with lock:
                return caches.setdefault(node, f"cache of node {node}")

        results[r] = turns(build, is_main=r == 0, is_local_main=r % 2 == 0, barrier=barrier.wait)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return events, results


def _main_process_first(build: Callable[[], str], *, is_main: bool, is_local_main: bool, barrier: Callable) -> str:
    """What `accelerator.main_process_first()` did before: rank 0, then every other rank at once."""
    if is_main:
        out = build()
        barrier()
        return out
    barrier()
    return build()


def test_data_is_prepared_once_per_node_disk() -> None:
    events, results = _prepare_on_two_nodes_of_two(in_turns, shared_disk=False)
    assert events[0] == ("prepare", 0)
    assert sorted(r for what, r in events if what == "prepare") == [0, 2]  # each node's first rank, once
    assert results == {0: "cache of node 0", 1: "cache of node 0", 2: "cache of node 1", 3: "cache of node 1"}
    events, results = _prepare_on_two_nodes_of_two(in_turns, shared_disk=True)
    assert [r for what, r in events if what == "prepare"] == [0]  # one shared cache: rank 0 alone
    assert set(results.values()) == {"cache of node 0"}
    # Control: rank 0 first and then everyone else has both ranks of node 1 prepare its cache.
    events, _ = _prepare_on_two_nodes_of_two(_main_process_first, shared_disk=False)
    assert sorted(r for what, r in events if what == "prepare") == [0, 2, 3]


def test_a_node_that_was_rank0_before_continues_the_stores_history(tmp_path: Path, s3_remote: str) -> None:
    """Which node holds rank 0 can change between attempts (c10d rendezvous orders nodes at random;
    SLURM's first node is whichever it allocates). Node A was rank 0 in attempt 1 and was killed;
    node B ran attempt 2 and uploaded the history; now A is rank 0 again. Its older metrics must
    not replace the store's, and its stale heartbeat must not count attempt 1 twice."""
    store = Store(s3_remote)
    rows = [json.dumps({"step": s}) + "\n" for s in range(1, 5)]
    ledger = [json.dumps({"attempt": 1, "pid": 11, "exit_reason": "killed"}), json.dumps({"attempt": 2, "pid": 22})]
    src = tmp_path / "b"
    src.mkdir()
    (src / "metrics.jsonl").write_text("".join(rows))
    (src / "ledger.jsonl").write_text("\n".join(ledger) + "\n")
    for name in ("metrics.jsonl", "ledger.jsonl"):
        store.put(src / name, name)
    a = tmp_path / "a"
    a.mkdir()
    (a / "metrics.jsonl").write_text("".join(rows[:2]))
    (a / "ledger.current.json").write_text(json.dumps({"attempt": 1, "pid": 11}))
    assert fetch_run_files(store, a) == ["metrics.jsonl", "ledger.jsonl"]
    assert (a / "metrics.jsonl").read_text() == "".join(rows)
    assert not (a / "ledger.current.json").exists()
    assert Ledger.open(a, 1).attempt == 3 and len(read_rows(a)) == 2
    # Rows this node wrote that the store lacks (killed before their upload) are kept beside the store's.
    mine = json.dumps({"step": 3, "here": 1}) + "\n"
    (a / "metrics.jsonl").write_text("".join(rows[:2]) + mine)
    assert fetch_run_files(store, a) == ["metrics.jsonl"]
    assert (a / "metrics.jsonl").read_text() == "".join(rows) + mine
    assert fetch_run_files(store, a) == []  # control: nothing more to merge the second time
