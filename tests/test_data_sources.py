"""Where examples come from: local files and folders, hub datasets pinned to a commit, mixes.

A hub dataset is the huggingface_hub cache layout built by hand (refs/, snapshots/<commit>/,
blobs/) in a temporary HF_HOME, read with HF_HUB_OFFLINE=1 through the real `snapshot_download`.
A second commit pushed after the first prepare stands in for a dataset updated mid-run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import datasets
import pandas as pd
import pytest
import yaml

from trainer import config as C
from trainer.config import DataConfig, SourceConfig
from trainer.data import DataError, Prepared, prepare
from trainer.data.prepare import data_fingerprint
from trainer.data.show import show_examples
from trainer.data.sources import pin_revisions

ALPACA = [
    {"instruction": f"Count to {i}.", "input": "", "output": " ".join(str(k) for k in range(1, i + 2))}
    for i in range(12)
]
QA = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(10)]
COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    buf = io.BytesIO()
    pd.DataFrame(rows).to_parquet(buf, index=False)
    return buf.getvalue()


def _prep(tmp_path: Path, tok: Path, seed: int = 0, **kw: Any) -> Prepared:
    kw.setdefault("seq_len", 128)
    return prepare(DataConfig(**kw), str(tok), tmp_path / "cache", progress=False, seed=seed)


def _error(tmp_path: Path, tok: Path, **kw: Any) -> str:
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, **kw)
    return str(e.value)


def _docs(p: Prepared) -> list[list[int]]:
    """Every document's token ids, in packed order."""
    out = []
    for row in datasets.load_from_disk(str(p.train_path)):
        real, pos = row["num_real"], row["position_ids"]
        starts = [i for i in range(real) if pos[i] == 0]
        out += [row["input_ids"][s:e] for s, e in zip(starts, starts[1:] + [real], strict=False)]
    return sorted(out)


# ----------------------------------------------------------------------------- the fake hub


class FakeHub:
    """A huggingface_hub cache in a temporary HF_HOME; `push` adds a commit and moves a ref to it."""

    def __init__(self, home: Path) -> None:
        self.cache = home / "hub"

    def push(
        self, repo: str, files: dict[str, bytes | str], commit: str, ref: str = "main", kind: str = "datasets"
    ) -> Path:
        root = self.cache / f"{kind}--{repo.replace('/', '--')}"
        snap = root / "snapshots" / commit
        for rel, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            blob = root / "blobs" / hashlib.sha256(raw).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(raw)
            link = snap / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../" * (len(Path(rel).parts) - 1)) / ".." / ".." / "blobs" / blob.name)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
        return snap


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # huggingface_hub reads its environment once, at import: set what it read.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return FakeHub(home)


def _hub_repo(hub: FakeHub, commit: str = COMMIT_A, rows: list[dict[str, Any]] = ALPACA) -> Path:
    return hub.push(
        "org/instruct",
        {
            "data/train-00000-of-00002.parquet": _parquet_bytes(rows[:6]),
            "data/train-00001-of-00002.parquet": _parquet_bytes(rows[6:]),
            "data/test-00000-of-00001.parquet": _parquet_bytes(rows[:2]),
        },
        commit,
    )


# ----------------------------------------------------------------------------- local kinds


def test_a_file_a_folder_of_files_and_a_saved_dataset_give_the_same_rows(tmp_path: Path, tiny_tokenizer: Path) -> None:
    one = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "all.jsonl", ALPACA)))

    folder = tmp_path / "folder"
    _jsonl(folder / "part-a.jsonl", ALPACA[:5])
    _jsonl(folder / "sub" / "part-b.jsonl", ALPACA[5:])
    (folder / "notes.txt").write_text("not data")  # another format than the folder's: not read
    many = _prep(tmp_path, tiny_tokenizer, path=str(folder))
    assert _docs(many) == _docs(one) and many.manifest["train"]["examples_in"] == len(ALPACA)

    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(QA), "test": datasets.Dataset.from_list(ALPACA)}
    ).save_to_disk(str(saved))
    test_split = _prep(tmp_path, tiny_tokenizer, path=str(saved), split="test")
    assert _docs(test_split) == _docs(one)
    assert "splits: train, test" in _error(tmp_path, tiny_tokenizer, path=str(saved), split="validation")


def test_compressed_files_and_arrow_shards_give_the_same_rows(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """What hub repositories ship besides plain files: .jsonl.gz, a JSON array in .json.bz2, .csv.xz, and the
    .arrow shards of a pushed save_to_disk."""
    import bz2
    import gzip
    import lzma

    one = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "all.jsonl", ALPACA)))
    folder = tmp_path / "packed"
    folder.mkdir()
    (folder / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ALPACA[:4]).encode()))
    (folder / "b.json.bz2").write_bytes(bz2.compress(json.dumps(ALPACA[4:8]).encode()))
    csv = io.StringIO()
    pd.DataFrame(ALPACA[8:]).to_csv(csv, index=False)
    (tmp_path / "c.csv.xz").write_bytes(lzma.compress(csv.getvalue().encode()))
    sources = [{"path": str(folder)}, {"path": str(tmp_path / "c.csv.xz")}]
    many = prepare(_mix_cfg(sources, seq_len=128, format="auto"), str(tiny_tokenizer), tmp_path / "c", progress=False)
    assert _docs(many) == _docs(one) and many.manifest["train"]["examples_in"] == len(ALPACA)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ALPACA).save_to_disk(str(saved))
    (shard,) = saved.glob("*.arrow")
    assert _docs(_prep(tmp_path, tiny_tokenizer, path=str(shard))) == _docs(one)
    # The control: a compressed file of another kind is named, with what is read.
    (tmp_path / "x.txt.gz").write_bytes(gzip.compress(b"hello"))
    assert "unknown data format" in _error(tmp_path, tiny_tokenizer, path=str(tmp_path / "x.txt.gz"))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"instruction": "a", "output": "b"}\n{oops\n'))
    assert f"{broken}:2: malformed JSON line" in _error(tmp_path, tiny_tokenizer, path=str(broken))


def test_a_folder_resolves_its_splits_and_files_as_load_dataset_does(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """datasets' own rules (called, not copied): sharded names, split folders, split synonyms
    (`training`, `dev`), a folder's one format; each split has the rows `load_dataset` gives it."""
    folder = tmp_path / "snap"
    _jsonl(folder / "data" / "train-00000-of-00001.jsonl", ALPACA)
    _jsonl(folder / "data" / "validation-00000-of-00001.jsonl", ALPACA[:3])
    synonyms = tmp_path / "synonyms"
    _jsonl(synonyms / "training.jsonl", ALPACA[:7])
    _jsonl(synonyms / "dev.jsonl", ALPACA[:2])
    _jsonl(synonyms / "testing.jsonl", ALPACA[:1])
    mixed = tmp_path / "mixed"  # parquet wins a tie: load_dataset reads one format per folder
    _jsonl(mixed / "a.jsonl", ALPACA[:5])
    pd.DataFrame(ALPACA[5:]).to_parquet(_jsonl(mixed / "b.parquet", []), index=False)
    cases = [(folder, "train"), (folder, "validation"), (synonyms, "train"), (synonyms, "validation")]
    cases += [(synonyms, "test"), (mixed, "train")]
    for path, split in cases:
        n = _prep(tmp_path, tiny_tokenizer, path=str(path), split=split).manifest["train"]["examples_in"]
        with TemporaryDirectory() as cache:
            assert n == len(datasets.load_dataset(str(path), split=split, cache_dir=cache)), (path, split)
    assert _prep(tmp_path, tiny_tokenizer, path=str(synonyms)).manifest["train"]["examples_in"] == 7  # training.jsonl
    msg = _error(tmp_path, tiny_tokenizer, path=str(folder), split="dev")
    assert "no split 'dev'" in msg and "splits: train, validation" in msg
    assert "subsets: none; folders: data" in _error(tmp_path, tiny_tokenizer, path=str(folder), subset="nope")
    # A subset without a card entry is a folder, read as load_dataset(path, data_dir=subset) reads it.
    _jsonl(folder / "data" / "extra" / "train.jsonl", ALPACA[:4])
    assert _prep(tmp_path, tiny_tokenizer, path=str(folder), subset="extra").manifest["train"]["examples_in"] == 4


# ----------------------------------------------------------------------------- the hub


def test_a_hub_dataset_is_read_offline_from_the_cache(tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub) -> None:
    _hub_repo(fake_hub)
    local = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "all.jsonl", ALPACA)))
    for path in ("hf://datasets/org/instruct", "org/instruct", f"hf://datasets/org/instruct@{COMMIT_A}"):
        p = _prep(tmp_path, tiny_tokenizer, path=path)
        assert _docs(p) == _docs(local), path
        assert p.manifest["sources"]["mix"][0]["commit"] == COMMIT_A
        assert p.manifest["sources"]["train"] == f"hf://datasets/org/instruct@{COMMIT_A}"
    test = _prep(tmp_path, tiny_tokenizer, path="org/instruct", split="test")
    assert test.manifest["train"]["examples_in"] == 2
    # A folder a user downloaded (a snapshot) reads the same way.
    snapshot = fake_hub.cache / "datasets--org--instruct" / "snapshots" / COMMIT_A
    assert _docs(_prep(tmp_path, tiny_tokenizer, path=str(snapshot))) == _docs(local)


def test_the_card_configs_choose_the_subset_and_split_files(
    tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub
) -> None:
    card = """---
configs:
- config_name: easy
  data_files:
  - split: train
    path: "easy/*-train.jsonl"
  - split: test
    path: "easy/*-test.jsonl"
- config_name: hard
  default: true
  data_files: "hard/*.jsonl"
- config_name: mapped
  data_files:
  - split: train
    path: "easy/*-train.jsonl"
  - split: test
    path: ["hard/*.jsonl", "easy/none-*.jsonl"]
---
# A dataset card
"""
    rows = lambda r: "".join(json.dumps(x) + "\n" for x in r)  # noqa: E731
    fake_hub.push(
        "org/graded",
        {
            "README.md": card,
            "easy/a-train.jsonl": rows(ALPACA[:4]),
            "easy/b-train.jsonl": rows(ALPACA[4:7]),
            "easy/a-test.jsonl": rows(ALPACA[:1]),
            "hard/all.jsonl": rows(ALPACA),
        },
        COMMIT_A,
    )
    n = lambda p: p.manifest["train"]["examples_in"]  # noqa: E731
    assert n(_prep(tmp_path, tiny_tokenizer, path="org/graded")) == 12  # the default subset
    assert n(_prep(tmp_path, tiny_tokenizer, path="org/graded", subset="easy")) == 7
    assert n(_prep(tmp_path, tiny_tokenizer, path="org/graded", subset="easy", split="test")) == 1
    assert n(_prep(tmp_path, tiny_tokenizer, path="org/graded", subset="mapped", split="test")) == 12
    assert "subsets: easy, hard, mapped" in _error(tmp_path, tiny_tokenizer, path="org/graded", subset="medium")
    assert "splits: train, test" in _error(tmp_path, tiny_tokenizer, path="org/graded", subset="easy", split="dev")


def test_a_new_commit_never_changes_a_pinned_source(tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub) -> None:
    _hub_repo(fake_hub, COMMIT_A)
    cfg = DataConfig(path="hf://datasets/org/instruct", seq_len=128)
    pinned, notes = pin_revisions(cfg, None)
    assert pinned.revision == COMMIT_A and "is commit aaaaaaaaaaaa" in notes[0]
    first = prepare(pinned, str(tiny_tokenizer), tmp_path / "cache", progress=False)

    _hub_repo(fake_hub, COMMIT_B, rows=ALPACA[:8])  # the dataset is updated: main now names B
    again, notes = pin_revisions(cfg, pinned)  # a restart: the run's config.yaml holds the first pin
    assert again.revision == COMMIT_A and "stays at commit aaaaaaaaaaaa" in notes[0]
    resumed = prepare(again, str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert resumed.reused and resumed.fingerprint == first.fingerprint
    # Control: a new run (nothing pinned) reads the new commit, and so other data.
    fresh = prepare(pin_revisions(cfg, None)[0], str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert fresh.fingerprint != first.fingerprint and fresh.manifest["train"]["examples_in"] == 8
    # A saved pin of another dataset (or subset) is not taken.
    other = DataConfig(path="hf://datasets/org/instruct", split="test")
    assert pin_revisions(other, pinned)[0].revision == COMMIT_B
    # An explicit commit is kept as given.
    assert pin_revisions(DataConfig(path="org/instruct", revision=COMMIT_B), pinned)[0].revision == COMMIT_B
    # A hub eval_path is pinned by writing the commit into it.
    with_eval = DataConfig(path="hf://datasets/org/instruct", eval_path="org/instruct")
    saved_eval = dataclasses.replace(with_eval, eval_path=f"hf://datasets/org/instruct@{COMMIT_A}")
    assert pin_revisions(with_eval, saved_eval)[0].eval_path == f"hf://datasets/org/instruct@{COMMIT_A}"
    assert pin_revisions(with_eval, None)[0].eval_path == f"hf://datasets/org/instruct@{COMMIT_B}"


def test_hub_errors_name_the_key_and_the_fix(tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub) -> None:
    msg = _error(tmp_path, tiny_tokenizer, path="org/unknown")
    assert "data.path" in msg and "org/unknown" in msg and "HF_HUB_OFFLINE" in msg and "HF_TOKEN" in msg
    _hub_repo(fake_hub)
    msg = _error(tmp_path, tiny_tokenizer, path="org/instruct", revision="v2")
    assert "data.path" in msg and "@v2" in msg and "HF_HUB_OFFLINE" in msg
    assert "hf://datasets/org/name" in _error(tmp_path, tiny_tokenizer, path="hf://models/org/instruct")
    # A missing local file stays a missing file, even when it looks like org/name.
    msg = _error(tmp_path, tiny_tokenizer, path="data/missing.jsonl")
    assert "does not exist" in msg and "data.path" in msg


# ----------------------------------------------------------------------------- mixes


def _mix(tmp_path: Path) -> list[dict[str, Any]]:
    alpaca = _jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    qa = tmp_path / "qa.parquet"
    pd.DataFrame(QA).to_parquet(qa, index=False)
    return [
        {"path": str(alpaca), "rows": 5},
        {"path": str(qa), "fields": {"instruction": "question", "output": "answer"}, "fraction": 0.5},
    ]


def _mix_cfg(sources: list[dict[str, Any]], **data: Any) -> DataConfig:
    return C.from_dict({"data": {"sources": sources, "seq_len": 128, "format": "alpaca", **data}}).data


def test_a_mix_takes_exact_counts_deterministically(tmp_path: Path, tiny_tokenizer: Path) -> None:
    sources = _mix(tmp_path)
    prep = lambda cfg, seed=0: prepare(cfg, str(tiny_tokenizer), tmp_path / "cache", progress=False, seed=seed)  # noqa: E731
    a = prep(_mix_cfg(sources))
    assert [(m["rows"], m["chosen"]) for m in a.manifest["sources"]["mix"]] == [(12, 5), (10, 5)]
    assert [s["examples_in"] for s in a.manifest["train"]["sources"]] == [5, 5]
    assert a.manifest["train"]["examples_out"] == 10
    b = prep(_mix_cfg(sources))
    assert b.reused and _docs(b) == _docs(a)
    # Built anew in another cache, the same mix gives the same rows.
    again = prepare(_mix_cfg(sources), str(tiny_tokenizer), tmp_path / "cache2", progress=False)
    assert not again.reused and _docs(again) == _docs(a)

    other_seed = prep(_mix_cfg(sources), seed=1)
    assert other_seed.fingerprint != a.fingerprint and _docs(other_seed) != _docs(a)  # control: the seed chooses
    variants = [
        [dict(sources[0], rows=6), sources[1]],
        [{"path": sources[0]["path"], "fraction": 0.4}, sources[1]],
        [dict(sources[0], format="text", fields={"text": "instruction"}), sources[1]],
        [sources[0], dict(sources[1], fraction=0.6)],
    ]
    fps = {a.fingerprint, other_seed.fingerprint} | {
        data_fingerprint(_mix_cfg(v), str(tiny_tokenizer)) for v in variants
    }
    assert len(fps) == 2 + len(variants)  # every change of the mix is a new fingerprint

    # Each source's choice depends on its own entry only: growing one leaves the other's rows.
    all_qa = {tuple(d) for d in _docs(prep(_mix_cfg([{k: v for k, v in sources[1].items() if k != "fraction"}])))}
    qa_part = lambda p: [d for d in _docs(p) if tuple(d) in all_qa]  # noqa: E731
    grown = prep(_mix_cfg([dict(sources[0], rows=12), sources[1]]))
    assert len(qa_part(a)) == 5 and qa_part(grown) == qa_part(a)


def test_every_lost_row_is_counted_per_source(tmp_path: Path, tiny_tokenizer: Path) -> None:
    long = [{"instruction": "Say it all. " + "word " * 300, "input": "", "output": "ok"}] * 2
    nulls = [{"question": None, "answer": "x"}, {"question": "y", "answer": None}]
    mixed = _jsonl(tmp_path / "long.jsonl", ALPACA[:3] + long)
    qa = _jsonl(tmp_path / "qa.jsonl", QA[:4] + nulls)
    cfg = _mix_cfg(
        [{"path": str(mixed)}, {"path": str(qa), "fields": {"instruction": "question", "output": "answer"}}],
        overlong="drop",
    )
    p = prepare(cfg, str(tiny_tokenizer), tmp_path / "cache", progress=False)
    per = p.manifest["train"]["sources"]
    assert [(s["examples_in"], s["examples_out"], s["dropped"]) for s in per] == [
        (5, 3, {"overlong": 2}),
        (6, 4, {"null_field": 2}),
    ]
    assert p.manifest["train"]["dropped"] == {"null_field": 2, "overlong": 2}
    text = p.summary()
    assert "from data.sources[0]: 5 in -> 3 kept; dropped: overlong 2" in text
    assert "from data.sources[1]: 6 in -> 4 kept; dropped: null_field 2" in text
    assert f"source data.sources[1]: {qa}: 6 rows, all rows" in text


def test_bad_mix_entries_name_their_key(tmp_path: Path, tiny_tokenizer: Path) -> None:
    sources = _mix(tmp_path)
    with pytest.raises(C.ConfigError) as e:
        C.from_dict(
            {
                "data": {
                    "path": "x.jsonl",
                    "sources": [{"path": sources[0]["path"], "rows": 2, "fraction": 0.5}, {"rows": 0, "colour": 1}],
                }
            }
        )
    text = str(e.value)
    for want in (
        "data.sources: set either data.path",
        "data.sources[0]: set rows or fraction, not both",
        "data.sources[1].colour: unknown key",
        "data.sources[1].path: every source needs a path",
        "data.sources[1].rows: must be at least 1",
    ):
        assert want in text, want

    def fails(entries: list[dict[str, Any]]) -> str:
        with pytest.raises(DataError) as err:
            prepare(_mix_cfg(entries), str(tiny_tokenizer), tmp_path / "cache", progress=False)
        return str(err.value)

    with pytest.raises(C.ConfigError, match=r"data.sources\[1\].format: expected one of 'auto', 'alpaca'"):
        _mix_cfg([sources[0], dict(sources[1], format="sharegpt-ish")])  # refused at load, with its line
    msg = fails([sources[0], dict(sources[1], fields={"question": "question"})])
    assert "data.sources[1].fields: 'question' is not a field of format 'alpaca'" in msg
    msg = fails([sources[0], {"path": sources[1]["path"]}])  # the qa columns are not the alpaca defaults
    assert "field 'instruction' not found" in msg and "set data.sources[1].fields.instruction" in msg
    with pytest.raises(DataError) as shown:  # `inspect --show` reads a source as prepare does: the same refusal
        show_examples(_mix_cfg([sources[0], {"path": sources[1]["path"]}]), str(tiny_tokenizer), 1)
    assert str(shown.value) == msg
    assert "alpaca" in show_examples(_mix_cfg(sources[:1]), str(tiny_tokenizer), 1)  # control: a good source shows
    msg = fails([dict(sources[0], rows=13), sources[1]])
    assert "data.sources[0].rows: asks for 13 rows but the source has 12" in msg
    msg = fails([sources[0], {"path": str(tmp_path / "nope.jsonl")}])
    assert "data.sources[1].path" in msg and "does not exist" in msg


def test_a_hub_source_in_a_mix_is_pinned_by_its_own_entry(
    tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub
) -> None:
    _hub_repo(fake_hub, COMMIT_A)
    cfg = _mix_cfg([_mix(tmp_path)[0], {"path": "org/instruct", "rows": 4}])
    pinned, _ = pin_revisions(cfg, None)
    assert [s.revision for s in pinned.sources] == [None, COMMIT_A]
    _hub_repo(fake_hub, COMMIT_B, rows=ALPACA[:8])
    assert [s.revision for s in pin_revisions(cfg, pinned)[0].sources] == [None, COMMIT_A]
    p = prepare(pin_revisions(cfg, pinned)[0], str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert [m["commit"] for m in p.manifest["sources"]["mix"]] == [None, COMMIT_A]
    assert isinstance(pinned.sources[1], SourceConfig)
    shutil.rmtree(fake_hub.cache)  # the cache is gone and offline: the error says what to do
    with pytest.raises(DataError, match=r"data\.sources\[1\]\.path.*HF_HUB_OFFLINE"):
        prepare(pinned, str(tiny_tokenizer), tmp_path / "cache", progress=False)


# ----------------------------------------------------------------------------- a run on a new machine


def test_a_new_machine_resumes_on_the_commit_of_the_first_start(
    tmp_path: Path, tiny_llama: Path, fake_hub: FakeHub, s3_remote: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer.restart.local.checkpoint import ResumeMismatch
    from trainer.restart.store.generations import run_file_copies
    from trainer.restart.store.lifecycle import Store
    from trainer.training import run

    out = tmp_path / "run"
    _hub_repo(fake_hub, COMMIT_A)

    def cfg(steps: int) -> C.RunConfig:
        raw = {
            "output_dir": str(out),  # the data cache sits inside it: a new machine has none
            "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
            "adapter": {"r": 4, "alpha": 8},
            "data": {"path": "hf://datasets/org/instruct", "seq_len": 128},
            "train": {"max_steps": steps, "micro_batch_size": 2, "lr": 1e-2, "schedule": "constant"},
            "checkpoint": {"every_steps": 1, "every_minutes": None, "remote": s3_remote},
            "metrics": {"progress": False, "report": False},
        }
        return C.from_dict(raw)

    assert run.train(cfg(1)) == 0
    saved = C.from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert saved.data.revision == COMMIT_A and saved.data.path == "hf://datasets/org/instruct"
    state = json.loads((out / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert state["config"]["data"]["revision"] == COMMIT_A  # every checkpoint carries the pin too

    _hub_repo(fake_hub, COMMIT_B, rows=ALPACA[:8])  # the dataset moves on mid-run
    shutil.rmtree(out)  # a new machine: an empty disk
    capsys.readouterr()
    assert run.train(cfg(2)) == 0
    logs = "".join(capsys.readouterr())
    assert "stays at commit aaaaaaaaaaaa" in logs and "at step 1 of 2" in logs
    (manifest,) = [json.loads(m.read_text()) for m in (out / "data").glob("*/manifest.json")]
    assert manifest["sources"]["mix"][0]["commit"] == COMMIT_A

    # Control: without the pin (config.yaml gone here and in the store) the new commit is read,
    # and the resume refuses to train on other data than its checkpoints did.
    shutil.rmtree(out)
    store = Store(s3_remote)
    for copy in run_file_copies(store.fs, store.path("config.yaml")).values():  # every generation's
        store.fs.rm(copy)
    with pytest.raises(ResumeMismatch, match="dataset fingerprint"):
        run.train(cfg(3))


def test_an_unreachable_hub_is_retried_and_never_a_data_error(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from huggingface_hub import constants
    from moto_fixture import free_port

    from trainer.data import hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(hub, "RETRY_SECONDS", (0.0, 0.0))
    with pytest.raises(hub.HubUnreachable) as e:
        hub.download(hub.HubId("org/instruct", None), None, ["README.md"], "data.path")
    # a transient fault: not the exit code that tells a supervisor to give up
    assert not isinstance(e.value, DataError) and "could not be reached" in str(e.value)
    assert capsys.readouterr().err.count("Retrying in 0s") == 2
    # With the data in the cache, an unreachable hub does not matter.
    _hub_repo(fake_hub)
    assert hub.download(hub.HubId("org/instruct", None), None, ["README.md"], "data.path")[1] == COMMIT_A


def test_eval_split_reads_the_held_out_split_at_the_same_commit(
    tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub
) -> None:
    _hub_repo(fake_hub)
    p = _prep(tmp_path, tiny_tokenizer, path="org/instruct", eval_split="test", eval_fraction=0.5)
    assert p.manifest["train"]["examples_in"] == 12 and p.manifest["eval"]["examples_in"] == 2  # not the fraction
    assert p.manifest["sources"]["eval"] == f"hf://datasets/org/instruct@{COMMIT_A}"
    q = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "t.jsonl", ALPACA)), eval_path="org/instruct")
    assert q.manifest["eval"]["examples_in"] == 12  # an eval_path reads its train split unless told
    q = _prep(tmp_path, tiny_tokenizer, path=str(tmp_path / "t.jsonl"), eval_path="org/instruct", eval_split="test")
    assert q.manifest["eval"]["examples_in"] == 2
    assert "no split 'dev'" in _error(tmp_path, tiny_tokenizer, path="org/instruct", eval_split="dev")


def test_estimate_samples_every_source_of_a_mix_in_its_share(
    tmp_path: Path, tiny_tokenizer: Path, fake_hub: FakeHub
) -> None:
    from trainer.plan import workload

    _hub_repo(fake_hub)
    cfg = _mix_cfg([_mix(tmp_path)[0], {"path": "org/instruct", "rows": 10}])
    w = workload.from_sample(cfg, cfg.path, str(tiny_tokenizer), sample_size=6)
    assert w.sampled_examples == 6 and w.examples == 15  # 2 + 4 sampled of 5 + 10, scaled by 15 / 6
    assert w.rows > 0 and w.real_tokens > 0


@pytest.mark.parametrize(
    ("code", "error_code", "want"), [(403, "GatedRepo", "is gated"), (401, "RepoNotFound", "private")]
)
def test_a_gated_or_private_dataset_names_hf_token_and_never_shows_it(
    tmp_path: Path,
    tiny_tokenizer: Path,
    fake_hub: FakeHub,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
    error_code: str,
    want: str,
) -> None:
    """A local HTTP server answers as the hub does for a gated (or private, unauthorised) repo."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802  (the http.server spelling)
            self.send_response(code)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", "Access to this dataset is restricted.")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_123")
        msg = _error(tmp_path, tiny_tokenizer, path="org/members-only")
    finally:
        server.shutdown()
    assert "data.path" in msg and want in msg and "HF_TOKEN" in msg
    assert "hf_not_a_real_token_123" not in msg


def test_a_malformed_json_line_is_named_at_the_column_the_parser_gives(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """A line cut short (a file copied half-way) fails at its end: the column is the line's length + 1, as
    `json.loads` of the line alone says, not column 1 of the newline after it."""
    cut = json.dumps({"instruction": "a" * 60, "output": "b" * 30})[:-1]
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n" + cut + "\n")
    with pytest.raises(json.JSONDecodeError) as parser:
        json.loads(cut)
    assert parser.value.colno == len(cut) + 1 > 1
    assert f"{path}:2: malformed JSON line (Expecting ',' delimiter at column {len(cut) + 1})" in _error(
        tmp_path, tiny_tokenizer, path=str(path)
    )
    # One JSON document written over several lines (not JSON Lines) is named where the parser stops.
    pretty = tmp_path / "pretty.json"
    pretty.write_text('{\n  "instruction": "a",\n  "output": "b",\n}\n')
    assert f"{pretty}:4: malformed JSON (Expecting property name enclosed in double quotes at column 1)" in _error(
        tmp_path, tiny_tokenizer, path=str(pretty)
    )
