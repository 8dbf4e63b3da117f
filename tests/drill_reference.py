"""The one uninterrupted run the kill-and-resume drills compare against, trained once per session.

The drills (test_kill_anywhere.py, test_remote_drill.py, test_store_fault_drill.py,
test_nothing_lost_drill.py) stop and restart `test_kill_anywhere._recipe` on the built-in 16-row
dataset in every way a spot machine is stopped, and assert the finished adapter and every logged loss
equal this run's. Trained with one intra-op thread, as every `bitwise` module trains (conftest.py says
why), whichever module asks for it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_kill_anywhere import _metric_rows, _recipe

from trainer import builtin_assets
from trainer import config as C


@dataclass(frozen=True)
class Reference:
    data: Path
    """The dataset every drill trains on (its cache beside it)."""
    out: Path
    adapter: dict[str, torch.Tensor]
    losses: dict[int, float]
    """step -> loss of the uninterrupted run."""
    earlier: dict[str, torch.Tensor]
    """The adapter one checkpoint before the end: the control that shows a comparison can fail."""

    def same(self, adapter: dict[str, torch.Tensor]) -> bool:
        return adapter.keys() == self.adapter.keys() and all(torch.equal(adapter[k], self.adapter[k]) for k in adapter)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Reference:
    # Imported here, not at the top: conftest.py imports this module, and a pytest that never asks
    # for the reference (a --collect-only, a subprocess pytest of one file) would pay transformers' import.
    from trainer.training import run

    root = tmp_path_factory.mktemp("uninterrupted")
    data = builtin_assets.write_dataset(root / "data" / "train.jsonl", n=16)
    out = root / "run"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            assert run.train(C.from_dict(_recipe(out, tiny_llama, data, data.parent / "cache"))) == 0
        finally:
            torch.set_num_threads(threads)
    assert not (out / "report.html").exists()  # the drills' recipe sets metrics.report=false (tests/test_report.py: on)
    earlier = sorted((out / "checkpoints").glob("step-*"))[0] / "adapter_model.safetensors"
    ref = Reference(
        data=data,
        out=out,
        adapter=load_file(out / "final" / "adapter_model.safetensors"),
        losses={r["step"]: r["loss"] for r in _metric_rows(out)},
        earlier=load_file(earlier),
    )
    assert not ref.same(ref.earlier)  # the control: the comparison can fail
    return ref


def train_here(argv: list[str]) -> int:
    """`spotune train ARGV` in this process (the CLI's own path): a single-process reference run
    without the ~6 s of CPU a child process spends importing torch, transformers and peft, which
    this process has imported already. For references only: a run a test kills, or one whose
    process or launcher is what the test is about, stays a child process."""
    from trainer.cli.main import main

    return main(["train", *argv])
