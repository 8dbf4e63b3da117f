"""The spot drills, for preference tuning. A DPO run with `checkpoint.remote` is SIGKILLed at a random
moment and its output_dir deleted as if the VM were gone; the same command resumes from the bucket
until it finishes (SIGTERM, save-in-a-kill and the ledger are the SFT drills'; the path is the same). The final adapter is bit-identical to an uninterrupted run's, and so is every logged figure
of every step, redone ones included: loss, rewards, reward accuracy, log-probs, and the evaluation's.
The uninterrupted run's first step is DPO's ln 2 (a fresh adapter is its own reference) with zero
rewards, and its later steps are not (the control that the comparison compares something). And two
real ranks with uneven shares train as one process does (tests/test_elastic.py's machinery)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from moto_fixture import s3_env
from test_kill_anywhere import (  # noqa: F401 (procs: a fixture)
    _wait,
    drill_seed,
    finish_on_new_machines,
    procs,
    same_final,
    start_attempt,
)

from trainer import builtin_assets
from trainer import config as C
from trainer.restart.local.checkpoint import PAUSE_ENV
from trainer.restart.store.lifecycle import Store
from trainer.training import run

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)

STEPS = 8
FIGURES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")


def _recipe(out: Path, model: Path, data: Path, cache: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "seed": 5,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {
            "r": 4,
            "alpha": 8,
            "dropout": 0.1,
        },  # off for DPO (trainer/config: dropout_off); the SFT drills draw masks
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(cache), "eval_fraction": 0.1, "loader_workers": 1},
        "train": {
            "objective": "dpo",
            "beta": 0.5,
            "max_steps": STEPS,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "lr": 1e-2,
            "warmup_steps": 2,
            "eval_every": 4,
        },
        "checkpoint": {"every_steps": 2, "every_minutes": None, "keep_last": 2},
        "metrics": {"progress": False, "log_every": 1},
    }


def _rows(out: Path) -> list[dict[str, Any]]:
    """Every metrics row of a run that has ended (no line is being written)."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_killed_anywhere_on_wiped_machines_resumes_bit_identical(
    tmp_path: Path,
    tiny_llama: Path,
    moto_endpoint: str,
    s3_remote: str,
    procs: list,  # noqa: F811
) -> None:
    seed = drill_seed()
    rnd = random.Random(seed)
    print(f"kill schedule seed {seed}")
    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=48)
    cache = tmp_path / "cache"
    ref_out, out = tmp_path / "reference", tmp_path / "vm"
    assert run.train(C.from_dict(_recipe(ref_out, tiny_llama, data, cache))) == 0
    reference = {(r["step"], "eval_loss" in r): r for r in _rows(ref_out)}
    first = reference[(1, False)]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == 0.0
    assert reference[(STEPS, False)]["loss"] != pytest.approx(first["loss"], abs=1e-3)
    assert reference[(STEPS, True)]["eval_rewards/accuracies"] is not None
    page = (ref_out / "report.html").read_text()  # the report the run wrote plots margin and accuracy
    assert (ref_out / "preference.png").read_bytes().startswith(b"\x89PNG") and 'data-file="preference.png"' in page

    raw = _recipe(out, tiny_llama, data, cache)
    raw["checkpoint"]["remote"] = s3_remote
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    store = Store(s3_remote)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(n: int, save_pause: float = 0.0) -> subprocess.Popen:
        env = {**os.environ, **s3_env(moto_endpoint), PAUSE_ENV: str(save_pause)}
        return start_attempt(procs, recipe, logs / f"attempt{n}.log", env)

    def new_vm() -> None:
        shutil.rmtree(out, ignore_errors=True)

    # 1: SIGKILL at a random moment once a checkpoint is in the bucket (slow saves keep 8 steps from ending first).
    p = start(1, save_pause=0.3)
    assert _wait(p, lambda: bool(store.committed()), timeout=300), (logs / "attempt1.log").read_text()
    time.sleep(rnd.uniform(0.0, 0.6))
    p.kill(), p.wait()
    new_vm()

    # Then the same command on a new VM each time until it finishes.
    finish_on_new_machines(start, new_vm, range(2, 6), logs)
    assert same_final(ref_out, out), f"seed {seed}"
    rows = _rows(out)  # carried through the bucket: every attempt's rows, redone steps included
    assert {r["step"] for r in rows if "loss" in r} == set(range(1, STEPS + 1))
    for row in rows:
        expected = reference[(row["step"], "eval_loss" in row)]
        names = [f"eval_{f}" if f != "loss" else "eval_loss" for f in FIGURES] if "eval_loss" in row else FIGURES
        for name in names:
            if name in expected:
                assert row[name] == expected[name], (row["step"], name, seed)


@pytest.mark.slow
def test_dpo_on_two_ranks_with_uneven_shares_equals_one_process(tmp_path: Path, tiny_llama: Path) -> None:
    """Real processes (gloo DDP): a global batch of 3 rows on 2 ranks, so one rank runs a filler
    micro-batch (no pair, still a reference and a policy forward, in lockstep); the same pairs per step
    (`sample_digest`) and the same adapter as one process, within float32 summation order."""
    from drill_reference import train_here
    from test_elastic import _adapter, _args, _assert_close, _digests, _run

    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=40)
    cache = tmp_path / "cache"
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["train.objective=dpo", "train.max_steps=2"]
    assert train_here([*_args(tiny_llama, data, cache, one, 3), *extra]) == 0  # the one process: this one
    assert _run(2, [*_args(tiny_llama, data, cache, two, 3), *extra], tmp_path / "two.log") == 0, (
        tmp_path / "two.log"
    ).read_text()[-3000:]
    assert _digests(two) == _digests(one) and len(_digests(one)) == 2
    _assert_close(_adapter(two), _adapter(one))
    rows = {r["step"]: r for r in _rows(one) if "loss" in r}
    for row in _rows(two):
        if "loss" in row:  # the step's loss and rewards, reduced per pair over both ranks
            for name in FIGURES:
                assert row[name] == pytest.approx(rows[row["step"]][name], rel=1e-5, abs=1e-6), name
    # Control: the first step is ln 2 on both, the second moved, so equal figures are not a constant.
    assert rows[2]["loss"] != pytest.approx(rows[1]["loss"], abs=1e-4) and rows[2]["rewards/margins"] > 0


def _from_sft(out: Path, model: Path, data: Path, init_from: Path, objective: str, steps: int, **extra: Any):
    """A preference run of `steps` starting from the SFT adapter at `init_from`: a constant schedule, so
    `steps` may grow between attempts ("K, then K more" must equal "2K straight": test_remote_resume.py)."""
    raw = _recipe(out, model, data, data.parent / "cache")
    raw["adapter"]["init_from"] = str(init_from)
    raw["data"].pop("eval_fraction")
    raw["train"].update(objective=objective, max_steps=steps, schedule="constant", warmup_steps=0, eval_every=None)
    raw["checkpoint"]["every_steps"] = 1
    cfg = C.from_dict(raw)
    return cfg.replace(**extra) if extra else cfg


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """A finished SFT run (its final/ is what a preference run starts from): 2 steps, LoRA B no longer 0."""
    root = tmp_path_factory.mktemp("sft")
    data = builtin_assets.write_dataset(root / "sft.jsonl", n=8)
    raw = _recipe(root / "run", tiny_llama, data, root / "cache")
    raw["data"].pop("eval_fraction")
    raw["train"] = {"max_steps": 2, "micro_batch_size": 2, "grad_accum": 1, "lr": 1e-2}
    assert run.train(C.from_dict(raw)) == 0
    return root / "run"


@pytest.mark.parametrize("objective", ["dpo", pytest.param("orpo", marks=pytest.mark.slow)])
def test_a_run_from_an_sft_adapter_resumes_on_a_wiped_machine_without_its_path(
    tmp_path: Path, tiny_llama: Path, sft_adapter: Path, s3_remote: str, objective: str
) -> None:
    """SFT -> DPO (or ORPO) on spot machines: the first start copies `adapter.init_from` into the run and the
    store; the machine is then wiped and the SFT run's directory is gone too (another machine's disk). The
    same command resumes from the store, the starting adapter (DPO's reference) from the run's copy, and
    ends bit-identical to an uninterrupted run; 2 steps then 4 equals 4 straight."""
    from safetensors.torch import load_file

    from trainer.model.reference import INIT_DIR, INIT_FILES
    from trainer.training.inputs import init_adapter

    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=16)
    sft = Path(shutil.copytree(sft_adapter, tmp_path / "sft"))  # this test's own: it is deleted below
    straight, vm = tmp_path / "straight", tmp_path / "vm"
    assert run.train(_from_sft(straight, tiny_llama, data, sft, objective, 4)) == 0
    expected = load_file(straight / "final" / "adapter_model.safetensors")

    remote = {"checkpoint.remote": s3_remote}
    assert run.train(_from_sft(vm, tiny_llama, data, sft, objective, 2, **remote)) == 0
    kept = vm / INIT_DIR
    assert (kept / "adapter_model.safetensors").read_bytes() == (
        sft / "final" / "adapter_model.safetensors"
    ).read_bytes()
    store = Store(s3_remote)
    assert all(store.read_run_file(rel) == (vm / rel).read_bytes() for rel in INIT_FILES)
    halfway = load_file(vm / "final" / "adapter_model.safetensors")
    assert not all(torch.equal(halfway[k], expected[k]) for k in expected)  # control: 2 steps are not 4

    shutil.rmtree(vm)  # a fresh machine...
    shutil.rmtree(sft)  # ...that cannot reach the SFT run
    cfg = _from_sft(vm, tiny_llama, data, sft, objective, 4, **remote)
    with pytest.raises(C.ConfigError, match="adapter.init_from: no adapter"):
        init_adapter(cfg)  # before: the path alone, which is gone (the resume was refused)
    assert run.train(cfg) == 0
    resumed = load_file(vm / "final" / "adapter_model.safetensors")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert init_adapter(cfg).path == kept  # type: ignore[union-attr]
    steps = [r["step"] for r in _rows(vm) if "loss" in r]
    assert sorted(steps) == [1, 2, 3, 4]  # resumed at step 2 (from scratch, steps 1 and 2 would be logged twice)
