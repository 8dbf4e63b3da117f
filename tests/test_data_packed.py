"""`PackedRows` reads a prepared folder with pyarrow alone: the same columns `datasets` reads (SFT rows,
preference pairs, KTO's rows of ragged labels), the same after a DataLoader worker's pickling, a damaged
folder named with its fix, and neither `datasets` nor pandas imported by the CLI or by a run whose data
is prepared already."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_kto import TEMPLATE, unpaired_rows

from trainer import builtin_assets
from trainer.config import DataConfig
from trainer.data import DataError, prepare
from trainer.data.packed import PackedRows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Prepared train folders of each kind of packed row."""
    tmp = tmp_path_factory.mktemp("packed")
    kto = tmp / "kto.jsonl"
    kto.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(14)))
    made = {
        "sft": (DataConfig(path=str(builtin_assets.write_dataset(tmp / "sft.jsonl", n=40)), seq_len=128), False),
        "pairs": (DataConfig(path=str(builtin_assets.write_pairs(tmp / "pairs.jsonl", n=20)), seq_len=256), True),
        "kto": (DataConfig(path=str(kto), seq_len=256, chat_template=TEMPLATE), True),
    }
    return {
        kind: prepare(cfg, str(tiny_llama), tmp / "cache", progress=False, pairs=pairs).train_path
        for kind, (cfg, pairs) in made.items()
    }


def _same(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> bool:
    if ours.keys() != theirs.keys():
        return False
    for name, mine in ours.items():
        other = theirs[name]
        if mine.dtype == object or other.dtype == object:  # rows of different lengths: row by row
            if len(mine) != len(other) or not all(np.array_equal(a, b) for a, b in zip(mine, other, strict=True)):
                return False
        elif mine.dtype != other.dtype or not np.array_equal(mine, other):
            return False
    return True


@pytest.mark.parametrize("kind", ["sft", "pairs", "kto"])
def test_the_columns_are_datasets_own(folders: dict[str, Path], kind: str) -> None:
    path = folders[kind]
    ours, theirs = PackedRows(path), datasets.load_from_disk(str(path))
    assert ours.column_names == theirs.column_names and len(ours) == len(theirs) > 3
    as_numpy = theirs.with_format("numpy")
    picks = [len(ours) - 1, 0, 2, 2]  # out of order, repeated: a sampler's draw
    assert _same(ours.take(picks), as_numpy[picks])
    assert _same(ours.take(slice(1, 3)), as_numpy[1:3])
    assert _same(ours.take(slice(None)), as_numpy[:])
    names = ["input_ids", "num_real"]
    assert _same(ours.select(names).take(picks), theirs.with_format("numpy", columns=names)[picks])
    # The worker's copy (pickled by the DataLoader) is the folder and its columns, mapped again.
    copy = pickle.loads(pickle.dumps(ours.select(names)))
    assert len(pickle.dumps(ours.select(names))) < 1000 and copy.column_names == names
    assert _same(copy.take(picks), theirs.with_format("numpy", columns=names)[picks])
    # Control: other rows differ, so the comparison can fail.
    assert not _same(ours.take([0, 1]), as_numpy[[1, 0]])
    if kind == "kto":  # a ragged column: rows holding different numbers of units
        desirable = ours.take(slice(None))["desirable"]
        assert desirable.dtype == object and len({len(r) for r in desirable}) > 1


def test_a_damaged_folder_names_itself_and_the_fix(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"not a prepared dataset \(state.json: .*delete the folder and run again"):
        PackedRows(tmp_path)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "state.json").write_text((folders["sft"] / "state.json").read_text())
    data = (folders["sft"] / "data-00000-of-00001.arrow").read_bytes()
    (torn / "data-00000-of-00001.arrow").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"data-00000-of-00001.arrow: unreadable prepared rows .*spotune prepare"):
        PackedRows(torn)
    with pytest.raises(KeyError, match="no column 'num_pairs'"):
        PackedRows(folders["sft"]).select(["input_ids", "num_pairs"])


_COMMANDS_THEN_TRAIN = """
import contextlib, io, sys
from trainer.cli.main import main

HEAVY = ("torch", "transformers", "datasets", "pandas", "matplotlib")

def loaded():
    return ",".join(m for m in HEAVY if m in sys.modules) or "none"

print("cli", loaded())
for command in sys.argv[2:]:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(command.split()) == 0, command
    print(command.split()[0], loaded())
from trainer import config as C
from trainer.training import run
assert run.train(C.load(sys.argv[1], [])) == 0
print("train", loaded())
"""


def test_the_cli_and_a_run_on_prepared_data_import_only_what_they_use(tiny_llama: Path, tmp_path: Path) -> None:
    """`datasets` with pandas is 1.2 s of CPU at every start, torch with transformers 5 s: only building the
    data needs the first, only training (and the report's example) the second. In a fresh process: the CLI
    starts with neither; `prepare` of prepared data, `status` and `inspect` stay without them; a run whose
    data is in the cache trains without datasets. The control: a first run, whose data is not prepared
    yet, imports datasets (and trains)."""
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)

    def recipe(name: str) -> Path:
        path = tmp_path / f"{name}.yaml"
        settings = {
            "output_dir": str(tmp_path / name),
            "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
            "adapter": {"r": 4},
            "data": {"path": str(data), "seq_len": 64, "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.25},
            "train": {"max_steps": 1, "micro_batch_size": 2, "grad_accum": 1, "eval_every": 1},
            "checkpoint": {"every_steps": 1, "every_minutes": None},
            "metrics": {"progress": False, "report": False},
        }
        path.write_text(json.dumps(settings))
        return path

    def said(cfg: Path, *commands: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _COMMANDS_THEN_TRAIN, str(cfg), *commands], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return [
            line
            for line in done.stdout.splitlines()
            if line.split(" ")[0] in {"cli", "train", *(c.split()[0] for c in commands)}
        ]

    first = recipe("first")
    assert said(first) == ["cli none", "train torch,transformers,datasets,pandas"]  # the control: data built
    again = recipe("again")
    assert said(again, f"prepare {again}", f"status {tmp_path / 'first'}", f"inspect {again}") == [
        "cli none",
        "prepare none",
        "status none",
        "inspect matplotlib",  # it draws the length plot, once per prepared dataset
        "train torch,transformers,matplotlib",
    ]
