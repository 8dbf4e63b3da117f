"""Ranks that decide together end alike: what rank 0 meets at start reaches every rank with its exit
code (trainer/restart/agree.py, classified once by trainer/exit_codes.py `code_for`), and a finished
run whose last checkpoint the store lacks exits 143 on every rank, not on rank 0 only.

Two gloo processes on CPU stand in for the ranks of a job; each runs the scenarios in turn through
`spotune`'s own exit path (trainer/cli/main.py) and prints the code it would exit with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moto_fixture import free_port

from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_PREEMPTED

REPO = Path(__file__).resolve().parents[1]

TWO_RANKS = """
import datetime, json, sys
from pathlib import Path
import torch.distributed as dist
from trainer import config as C
from trainer.cli import main as cli
from trainer.restart.remote.run import RemoteRun
from trainer.restart.store.lifecycle import Store
from trainer.restart.remote.uploader import Uploader
from trainer.training.inputs import pin_data

port, rank, tmp = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
# Short, so that a rank left waiting for one that gave up fails the test in seconds, not 30 minutes.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=15))


def remote(url):
    return RemoteRun(url, {}, tmp / f"run-{rank}", keep_last=2, is_main=rank == 0, is_local_main=True)


def missing_backend():  # rank 0's Store() finds no ocifs: a setting to fix (pip install), on every rank
    remote("oci://bucket@namespace/run").connect()


def finished_not_stored():  # rank 0's uploader did not get the last checkpoint into the store
    run = remote(f"file://{tmp / 'store'}")
    if rank == 0:
        run.uploader = Uploader(Store(run.url), run.run_dir, 2, print)  # created, never flushed
    return run.exit_code(0, tmp / "final")


def hub_unreachable():  # rank 0 pins the hub dataset (offline, not cached): every rank hears of it
    cfg = C.from_dict({"output_dir": str(tmp / "pin"), "data": {"path": "hf://datasets/org/nothing"}})
    pin_data(cfg, rank == 0)


codes = {}
for scenario in (missing_backend, finished_not_stored, hub_unreachable):
    cli._dispatch = lambda args, scenario=scenario: scenario() or 0
    try:
        codes[scenario.__name__] = cli._main(["status", "unused"])
    except Exception as e:  # a traceback: exit 1
        codes[scenario.__name__] = f"traceback: {type(e).__name__}: {e}"
print(json.dumps(codes), flush=True)
"""


def test_what_rank_0_meets_at_start_ends_every_rank_with_its_code(tmp_path: Path) -> None:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, port, str(r), str(tmp_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    codes = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    expected = {
        "missing_backend": EXIT_BAD_INPUT,  # not 2 on rank 0 and 143 ("a fault of the moment") on rank 1
        "finished_not_stored": EXIT_PREEMPTED,  # not 143 on rank 0 and 0 on rank 1
        "hub_unreachable": EXIT_BAD_INPUT,  # not rank 1 left waiting in a broadcast that never comes
    }
    assert codes == [expected, expected], "\n".join(err[-2000:] for _, err in outs)
    assert "that is a fault of the moment" not in outs[1][1]
