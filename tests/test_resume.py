"""Bitwise resume on CPU fp32: 2k steps straight equal k steps, stop, resume for k more.

The run has gradient accumulation, LoRA dropout above zero and packed data; the stop
falls mid-epoch and the continuation crosses an epoch boundary (50 examples, rendered through
the tiny tokenizer's chat template, packed three or four to a row into 15 rows of 128, 4 rows a
step: 3 steps an epoch; stop at step 4 = epoch 1 cursor 4, epoch 2 starts at step 7).
Controls: resuming without the RNG or without the sampler position changes the losses,
and the checkpoints at two different steps differ.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer import builtin_assets
from trainer import config as C
from trainer.data import sampler
from trainer.restart.local import state
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.training import run

K = 4


def _cfg(out: Path, model: Path, data: Path, cache: Path, max_steps: int, **extra: Any) -> C.RunConfig:
    raw = {
        "output_dir": str(out),
        "seed": 3,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(cache)},
        "train": {
            "max_steps": max_steps,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "lr": 1e-2,
            "schedule": "constant",
            "warmup_steps": 2,
        },
        "checkpoint": {"every_steps": None, "every_minutes": None},
        "metrics": {"progress": False, "report": False},
    }
    return C.from_dict(raw).replace(**extra) if extra else C.from_dict(raw)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume")
    data = builtin_assets.write_dataset(root / "train.jsonl", n=50)
    make = lambda name, steps: _cfg(root / name, tiny_llama, data, root / "cache", steps)  # noqa: E731

    assert run.train(make("straight", 2 * K)) == 0
    assert run.train(make("split", K)) == 0
    assert run.train(make("split", 2 * K)) == 0  # same output_dir: resumes from step K

    # Controls: resume from the step-K checkpoint while skipping one piece of the restore.
    controls = {}
    for name in ("no_rng", "no_sampler"):
        out = root / name
        (out / "checkpoints").mkdir(parents=True)
        src = root / "split" / "checkpoints" / f"step-{K:06d}"
        shutil.copytree(src, out / "checkpoints" / src.name)
        mp = pytest.MonkeyPatch()
        if name == "no_rng":
            mp.setattr(state, "restore_rng", lambda tensors: None)
        else:
            original = sampler.StepSampler.micro_batches
            # A sampler that forgot its position: the resumed run starts again at step 0's rows.
            mp.setattr(
                sampler.StepSampler,
                "micro_batches",
                lambda self, step, *a, original=original: original(self, step - K, *a),
            )
        try:
            assert run.train(make(name, K + 1)) == 0
        finally:
            mp.undo()
        controls[name] = _losses(out)
    return {"root": root, "data": data, "controls": controls}


def test_split_run_equals_straight_run_bitwise(runs: dict[str, Any]) -> None:
    root = runs["root"]
    straight, split = _losses(root / "straight"), _losses(root / "split")
    assert sorted(straight) == list(range(1, 2 * K + 1))
    assert split == straight  # every per-step loss, exactly
    counters = lambda name: [  # noqa: E731 - token counters carry across the restart too
        (r["step"], r["trainable_tokens"], r["real_tokens"])
        for r in map(json.loads, (root / name / "metrics.jsonl").read_text().splitlines())
    ]
    assert counters("split") == counters("straight")
    a = load_file(root / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(root / "split" / "final" / "adapter_model.safetensors")
    assert a and _equal(a, b)
    ck = lambda name: root / name / "checkpoints" / f"step-{2 * K:06d}"  # noqa: E731
    assert _equal(load_file(ck("straight") / "optimizer.safetensors"), load_file(ck("split") / "optimizer.safetensors"))
    st = state.TrainState.from_json((ck("split") / "trainer_state.json").read_text())
    assert (st.step, st.epoch, st.cursor) == (2 * K, 2, 8)  # crossed into epoch 2
    resumed = state.TrainState.from_json(
        (root / "split" / "checkpoints" / f"step-{K:06d}" / "trainer_state.json").read_text()
    )
    assert (resumed.epoch, resumed.cursor) == (1, 4)  # the stop was mid-epoch
    rows = [json.loads(x) for x in (root / "split" / "ledger.jsonl").read_text().splitlines()]
    assert [r["exit_reason"] for r in rows] == ["finished", "finished"]


def test_checkpoints_at_different_steps_differ(runs: dict[str, Any]) -> None:
    ck = runs["root"] / "split" / "checkpoints"
    a = load_file(ck / f"step-{K:06d}" / "adapter_model.safetensors")
    b = load_file(ck / f"step-{2 * K:06d}" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and not _equal(a, b)


@pytest.mark.parametrize("control", ["no_rng", "no_sampler"])
def test_resume_without_rng_or_sampler_state_differs(runs: dict[str, Any], control: str) -> None:
    straight = _losses(runs["root"] / "straight")
    got = runs["controls"][control]
    assert got[K + 1] != straight[K + 1]


def test_corrupt_newest_checkpoint_falls_back_and_still_matches(
    runs: dict[str, Any], tiny_llama: Path, capsys: pytest.CaptureFixture
) -> None:
    """End to end: a flipped byte in the newest checkpoint -> resume from the previous one,
    say which file was bad, redo the steps, and finish with the same adapter."""
    root = runs["root"]
    out = root / "fallback"
    shutil.copytree(root / "split" / "checkpoints", out / "checkpoints")
    bad = out / "checkpoints" / f"step-{2 * K:06d}" / "optimizer.safetensors"
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0xFF
    bad.write_bytes(bytes(data))
    cfg = _cfg(out, tiny_llama, runs["data"], root / "cache", 2 * K)
    assert run.train(cfg) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert f"step-{2 * K:06d} is corrupt, skipped: optimizer.safetensors: sha256 differs" in text
    assert f"resuming from {out / 'checkpoints' / f'step-{K:06d}'}" in text
    assert sorted(_losses(out)) == list(range(K + 1, 2 * K + 1))
    a = load_file(root / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(out / "final" / "adapter_model.safetensors")
    assert _equal(a, b)
    ck = CheckpointManager(out / "checkpoints")
    assert ck.verify(ck.step_dir(2 * K)) == []  # the corrupt copy was replaced by a good one
