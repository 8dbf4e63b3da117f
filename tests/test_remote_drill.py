"""The spot drill with an object store: SIGKILL the trainer at random moments (one of them
in the middle of an upload), SIGTERM it once (the upload is flushed before it exits), and
after every stop delete the local output_dir, as if the VM were gone; the same command on
the "new VM" resumes from the bucket until it finishes. The final adapter is bit-identical
to an uninterrupted run and the ledger, carried through the bucket, has a row for every
process, the killed ones included (recovered from their last heartbeat in the store)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from drill_reference import Reference, train_here
from moto_fixture import SECRET, s3_env, sparse
from test_kill_anywhere import (  # noqa: F401 (procs: a fixture)
    REPO,
    STEPS,
    _metric_rows,
    _recipe,
    _wait,
    drill_seed,
    procs,
    same_final,
    start_attempt,
)

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.books.ledger import read_rows
from trainer.restart.local.checkpoint import MANIFEST, PAUSE_ENV, CheckpointManager
from trainer.restart.store.lifecycle import UPLOAD_PAUSE_ENV, Store

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)


@pytest.mark.slow
def test_kill_delete_output_dir_rerun_from_the_bucket(
    tmp_path: Path,
    tiny_llama: Path,
    moto_endpoint: str,
    s3_remote: str,
    procs: list,  # noqa: F811
    uninterrupted: Reference,
    capfd: pytest.CaptureFixture[str],
) -> None:
    seed = drill_seed()
    rnd = random.Random(seed)
    print(f"kill schedule seed {seed}")
    data = uninterrupted.data
    cache = data.parent / "cache"
    ref_out, out = uninterrupted.out, tmp_path / "vm"

    raw = _recipe(out, tiny_llama, data, cache)
    raw["checkpoint"]["remote"] = s3_remote
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    store = Store(s3_remote)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(n: int, upload_pause: float = 0.0, save_pause: float = 0.0) -> subprocess.Popen:
        env = {
            **os.environ,
            **s3_env(moto_endpoint),
            UPLOAD_PAUSE_ENV: str(upload_pause),
            PAUSE_ENV: str(save_pause),
        }
        return start_attempt(procs, recipe, logs / f"attempt{n}.log", env)

    def remote_steps() -> list[int]:
        return store.committed()

    def new_vm() -> None:
        shutil.rmtree(out, ignore_errors=True)

    # 1: SIGKILL at a random moment once a checkpoint is in the bucket.
    # Slow saves (0.3 s each) keep the 8 tiny steps from finishing before the kill on a fast machine.
    p = start(1, save_pause=0.3)
    local = CheckpointManager(out / "checkpoints")
    uploaded = sparse(lambda: bool(remote_steps()))
    assert _wait(p, lambda: bool(local.committed()) and uploaded(), timeout=300), (logs / "attempt1.log").read_text()
    time.sleep(rnd.uniform(0.0, 0.6))
    p.kill(), p.wait()
    new_vm()

    # 2: SIGKILL in the middle of an upload (objects sent, manifest not yet).
    # Attempt 1 may have died mid-upload too, leaving a step without a manifest: only objects this
    # attempt wrote count. The store's clock has whole seconds, so start on a later second than the kill.
    time.sleep(1.1)
    since = int(time.time())
    p = start(2, upload_pause=3.0)
    before = remote_steps()

    def uploading() -> bool:
        store.fs.invalidate_cache()
        committed = set(remote_steps())
        found = store.fs.find(store.path("checkpoints"), detail=True)
        return any(
            _step_of(key) not in committed and info["LastModified"].timestamp() >= since for key, info in found.items()
        )

    # Its first own save is committed locally before its upload begins: only then look at the store (every look
    # costs a listing), at once from there on.
    saved = lambda: max(map(local.step_of, local.committed()), default=0) > before[-1]  # noqa: E731
    if _wait(p, lambda: saved() and uploading(), timeout=300):
        p.kill()
        p.wait()
        assert remote_steps()[-1] >= before[-1]  # the half-uploaded one is not a checkpoint
        half = sorted(
            {int(d.rsplit("-", 1)[1]) for d in store.fs.ls(store.path("checkpoints"), detail=False)}
            - set(remote_steps())
        )
        assert half and not store.fs.exists(store.step_path(half[-1], MANIFEST))
    new_vm()

    # 3: SIGTERM (a preemption notice): the step is saved and its upload flushed before exit 143.
    p = start(3)
    # This attempt's newest step: its last row (the store's rows can run past a commit a killed attempt never
    # finished, since they go up before each commit: trainer/restart/remote/uploader.py).
    logged = lambda: ([0] + [r["step"] for r in _metric_rows(out)])[-1]  # noqa: E731
    first = None
    # metrics.jsonl travels with the run, so wait for this attempt's own rows: after it says it is
    # resuming (its signal handlers are installed by then), a row more than it had at that moment.
    said = lambda: "resuming from" in (logs / "attempt3.log").read_text()  # noqa: E731
    if _wait(p, said, timeout=300):
        seen = len(_metric_rows(out))
        if _wait(p, lambda: len(_metric_rows(out)) > seen, timeout=300):
            first = logged()
            p.send_signal(signal.SIGTERM)
    code = p.wait(timeout=120)
    if code == EXIT_PREEMPTED:
        assert remote_steps()[-1] == logged() >= first  # nothing was lost with the VM
    new_vm()

    # Then the same command on a new VM each time until it finishes. These attempts are neither killed nor
    # about their process: they run in this one (its environment points at moto already: s3_remote, and at
    # one intra-op thread: bitwise), without a child's ~6 s of imports.
    here = 0  # attempts run in this process
    for _ in range(4, 9):
        new_vm()
        here += 1
        if train_here([str(recipe)]) == 0:
            break
    else:
        raise AssertionError(capfd.readouterr())
    said_here = capfd.readouterr()
    assert same_final(ref_out, out), _divergence(seed, ref_out, out, logs)
    # The half-finished upload was cleaned by a later attempt.
    store.fs.invalidate_cache()
    dirs = {int(d.rsplit("-", 1)[1]) for d in store.fs.ls(store.path("checkpoints"), detail=False)}
    assert dirs == set(remote_steps()) and remote_steps()[-1] == STEPS
    # Every attempt has its ledger row, though each machine's disk was thrown away: each process's, and
    # one for each attempt run in this process.
    booked = read_rows(out)
    rows = {r["pid"]: r for r in booked}
    pids = sorted([q.pid for q in procs] + [os.getpid()] * here)
    assert sorted(r["pid"] for r in booked) == pids, (sorted(rows), pids)
    for q in procs:
        row = rows[q.pid]
        if q.returncode == -signal.SIGKILL:
            assert row["exit_reason"] in ("killed", "finished"), row  # finished: killed while exiting
    assert all(r["device_seconds"] > 0 for r in booked)
    # The totals the last checkpoint carries count every earlier machine's time, and the last attempt's up to
    # that save: not its time after it (final/, the flush, the report), which only its row has. The last row
    # is the attempt that finished (a killed attempt's row is booked by the next one's start, before it).
    final_state = json.loads((out / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    *earlier, last = booked
    assert last["pid"] == os.getpid() and last["exit_reason"] == "finished", last
    assert final_state["ledger"]["attempts"] == len(procs) + here
    assert final_state["ledger"]["device_seconds"] >= sum(r["device_seconds"] for r in earlier), (final_state, booked)
    for q in procs:
        assert SECRET not in (logs / f"attempt{procs.index(q) + 1}.log").read_text()
    assert SECRET not in said_here.out + said_here.err


def _divergence(seed: int, ref_out: Path, out: Path, logs: Path) -> str:
    """What a failed comparison needs to be understood: the first step whose logged loss differs
    from the uninterrupted run's, and where each attempt resumed from."""
    ref = {r["step"]: (r["loss"], r.get("grad_norm")) for r in _metric_rows(ref_out) if "loss" in r}
    got = [(r["step"], r.get("attempt"), (r["loss"], r.get("grad_norm"))) for r in _metric_rows(out) if "loss" in r]
    first = next(
        (
            f"step {st} (attempt {at}): loss {v[0]!r} vs {ref.get(st, (None,))[0]!r}"
            for st, at, v in got
            if v[0] != ref.get(st, (None,))[0]
        ),
        "none",
    )
    # Each row in file order against the uninterrupted run: = when loss and grad norm are bit-equal.
    first += "; rows " + " ".join(f"{st}{'=' if v == ref.get(st) else '!'}" for st, _, v in got)
    said = [
        f"{f.name}: "
        + " | ".join(
            [*(line for line in f.read_text().splitlines() if "resum" in line), *f.read_text().splitlines()[-1:]]
        )
        for f in sorted(logs.glob("attempt*.log"))
    ]
    return "\n".join([f"kill schedule seed {seed}; first loss that differs: {first}", *said])


def _step_of(key: str) -> int:
    """The step of an object key under `<remote>/checkpoints/step-NNNNNN/`."""
    return int(key.split("/checkpoints/", 1)[1].split("/", 1)[0].rsplit("-", 1)[1])
