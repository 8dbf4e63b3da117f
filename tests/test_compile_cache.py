"""`model.compile` once per run: the compiled artifacts travel with the checkpoint (through
`checkpoint.remote`, to an empty output_dir) and a resumed attempt in a fresh process loads them,
compiles in a fraction of the first attempt's time and ends bit-identical to the same resume
compiled from scratch; a key that differs is refused with its reason."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_start
import yaml
from safetensors.torch import load_file

from trainer import atomic, builtin_assets
from trainer.model import compile_cache as cc
from trainer.restart.books.ledger import read_rows
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)

REPO = Path(__file__).resolve().parents[1]
KEY = {"torch": torch.__version__, "python": "3.11.7", "device": "cpu x86_64 avx512", "model_shape": "0123456789abcdef"}


def _folder(tmp_path: Path, key: dict[str, str], blob: bytes = b"not torch's format") -> Path:
    folder = tmp_path / "step-000002" / cc.FOLDER
    folder.mkdir(parents=True)
    (folder / cc.BLOB).write_bytes(blob)
    (folder / cc.KEY).write_text(json.dumps({"key": key, "artifacts": ["inductor:x"], "kernels": []}))
    return folder.parent


def test_a_key_that_differs_is_refused_with_its_reason(tmp_path: Path) -> None:
    here = cc.CompileCache(KEY, tmp_path / "out" / cc.FOLDER)
    older = _folder(tmp_path, {**KEY, "torch": "2.11.0"})
    assert here.load(older) == f"refused: torch '2.11.0' in the checkpoint, {torch.__version__!r} here"
    assert not (tmp_path / "out").exists()  # nothing read, nothing staged: the run compiles from scratch
    # Control: the same key passes the check and reaches torch, which cannot read these bytes: a
    # miss with the reason, never an error.
    same = cc.CompileCache(KEY, tmp_path / "out2" / cc.FOLDER)
    shutil.rmtree(older)
    assert same.load(_folder(tmp_path, KEY)).startswith("miss: ")


def test_each_save_links_the_staged_artifacts(tmp_path: Path) -> None:
    stage = _folder(tmp_path, KEY) / cc.FOLDER  # an earlier attempt's staged copy, same key
    cache = cc.CompileCache(KEY, stage)
    for step in (2, 4):  # nothing compiled in this process since: the staged copy stands
        ckpt = tmp_path / f"save-{step}"
        cache.write_into(ckpt)
        assert (ckpt / cc.FOLDER / cc.BLOB).stat().st_ino == (stage / cc.BLOB).stat().st_ino
    # Control: a staged copy of another key is never put into a checkpoint.
    other = cc.CompileCache({**KEY, "python": "3.12.0"}, stage)
    other.write_into(tmp_path / "save-6")
    assert not (tmp_path / "save-6").exists()


def test_a_kill_between_the_stages_renames_leaves_the_staged_copy_in_use(tmp_path: Path) -> None:
    """`publish_dir` moves the old stage aside before renaming the new one in: killed between the two, the only
    staged copy has a temp name. The next attempt puts it back (and reuses it) and removes an unfinished copy that
    a kill while staging left. Before, it read no stage, serialised everything again, and the temp copies stayed."""
    stage = _folder(tmp_path, KEY) / cc.FOLDER
    aside = atomic.temp_sibling(stage, atomic.REPLACED)
    stage.rename(aside)  # killed here, inside publish_dir
    unfinished = atomic.temp_sibling(stage)
    unfinished.mkdir()
    (unfinished / cc.BLOB).write_bytes(b"half")
    cache = cc.CompileCache(KEY, stage)
    assert (stage / cc.BLOB).read_bytes() == b"not torch's format" and not aside.exists() and not unfinished.exists()
    cache.write_into(tmp_path / "save-2")  # the restored copy is the one each save links
    assert (tmp_path / "save-2" / cc.FOLDER / cc.BLOB).stat().st_ino == (stage / cc.BLOB).stat().st_ino
    # Control: no stage at all (nothing moved aside) is a plain miss, nothing made up.
    empty = cc.CompileCache(KEY, tmp_path / "none" / cc.FOLDER)
    empty.write_into(tmp_path / "save-4")
    assert not (tmp_path / "save-4").exists()


def test_the_key_follows_the_settings_that_shape_the_graph(tiny_llama: Path, tmp_path: Path) -> None:
    from trainer.config import AdapterConfig, ModelConfig
    from trainer.model.load import build
    from trainer.model.reference import InitAdapter

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4))
    cpu = torch.device("cpu")

    def key(model_cfg: ModelConfig, adapter: AdapterConfig, precision: str = "no") -> dict[str, str]:
        return cc.cache_key(cc.graph_settings(model, model_cfg, adapter, precision), cpu)

    base = key(ModelConfig(dtype="float32"), AdapterConfig(r=4))
    assert key(ModelConfig(dtype="float32", name_or_path="elsewhere", compile=True), AdapterConfig(r=4)) == base
    for other in (
        key(ModelConfig(dtype="float32"), AdapterConfig(r=8)),
        key(ModelConfig(dtype="float32", tiled_mlp="on"), AdapterConfig(r=4)),
        key(ModelConfig(dtype="bfloat16"), AdapterConfig(r=4)),
        key(ModelConfig(dtype="float32"), AdapterConfig(r=4), "bf16"),
    ):
        assert (
            cc.refusal(base, other)
            == f"model_shape {base['model_shape']!r} in the checkpoint, {other['model_shape']!r} here"
        )
    assert base["device"].startswith("cpu ")

    # Where adapter.init_from lies is no part of the graph (a resume on another machine finds it elsewhere);
    # the frozen reference adapter a DPO run keeps beside the trained one is.
    moved = [key(ModelConfig(dtype="float32"), AdapterConfig(r=4, init_from=p)) for p in ("/a/sft", "/b/sft")]
    assert moved == [base, base]
    model.save_pretrained(tmp_path / "sft")
    model = build(
        ModelConfig(name_or_path=str(tiny_llama), dtype="float32"),
        AdapterConfig(r=4),
        init=InitAdapter(tmp_path / "sft", reference=True),
    )
    assert key(ModelConfig(dtype="float32"), AdapterConfig(r=4, init_from="/a/sft")) != base


def test_kernels_built_by_another_toolchain_are_refused() -> None:
    """The `.so` kernels carried in `kernels/` link against the C library and come from the compiler of the
    image that built them: another image (an older glibc, another compiler) compiles anew instead of loading
    a library that may not load there, or crash."""
    here = cc.cache_key({"any": "settings"}, torch.device("cpu"))
    assert here["libc"].startswith("glibc") and here["compiler"] != "unknown", here
    for part, value in (("libc", "glibc 2.17"), ("compiler", "g++: g++ (GCC) 7.3.1")):
        assert cc.refusal({**here, part: value}, here) == f"{part} {value!r} in the checkpoint, {here[part]!r} here"
    assert cc.refusal(dict(here), here) is None  # the control: the same image loads them


def _recipe(out: Path, remote: Path, model: Path, data: Path, cache: Path, **model_keys: Any) -> Path:
    recipe = {
        "output_dir": str(out),
        "seed": 3,
        "model": {"name_or_path": str(model), "dtype": "float32", "attn_implementation": "sdpa", "compile": True}
        | model_keys,
        "adapter": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "seq_len": 64, "cache_dir": str(cache)},
        "train": {"max_steps": 4, "micro_batch_size": 2, "grad_accum": 1, "lr": 1e-2, "mixed_precision": "no"},
        "checkpoint": {"every_steps": 2, "every_minutes": None, "remote": str(remote)},
        "metrics": {"progress": False, "report": False, "log_every": 1},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _attempt(recipe: Path, tmp: Path, name: str) -> dict[str, Any]:
    """One `spotune train` process with Inductor's caches in fresh directories; its ledger row."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}"),
        "TRITON_CACHE_DIR": str(tmp / f"triton-{name}"),
    }
    log = tmp / f"{name}.log"
    # Forked from the warm forkserver (tests/warm_start.py): a new process whose compilers have compiled nothing.
    assert warm_start.start(["train", str(recipe)], log, env=env, new_session=False).wait(timeout=600) == 0, (
        log.read_text()[-6000:]
    )
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    return read_rows(out)[-1]


@pytest.mark.slow
def test_a_resumed_attempt_loads_the_artifacts_and_ends_identical(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Two `spotune train` processes: an uninterrupted compiled run, and a new machine that resumes
    from its step-2 checkpoint in the store with the artifacts. The resume compiles in a fraction
    of the time and ends bit-identical to the run that never stopped (the same kernels, loaded).

    A one-layer Llama: torch compiles the decoder layer's graph once, and a second layer only adds a
    second variant of it (the first layer's input, the frozen embedding's output, needs no gradient;
    every later layer's does), about 15 s more CPU per compile for nothing this test checks
    (tests/test_compile.py compiles both variants)."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("Inductor's CPU backend needs a C++ compiler (g++ or $CXX); none is installed")
    tiny_llama = builtin_assets.build_model(tmp_path / "model", "llama", tokenizer_dir=tiny_tokenizer, layers=1)
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    cache, remote = tmp_path / "data-cache", tmp_path / "remote"
    first = _attempt(_recipe(tmp_path / "first", remote, tiny_llama, data, cache), tmp_path, "first")
    assert first["phases"]["compile"] > 0 and first["compile_cache"] == "miss: no checkpoint to load from"
    saved = CheckpointManager(tmp_path / "first" / "checkpoints").committed()[0]
    assert saved.name == "step-000002"
    listed = json.loads((saved / MANIFEST).read_text())["files"]
    assert f"{cc.FOLDER}/{cc.BLOB}" in listed and f"{cc.FOLDER}/{cc.KEY}" in listed  # verified like every file

    # The new machine: an empty output_dir, and a store whose newest checkpoint is step 2.
    shutil.copytree(remote, tmp_path / "remote-2")
    for later in (tmp_path / "remote-2" / "checkpoints").glob("step-*"):
        if later.name != saved.name:
            shutil.rmtree(later)
    hit = _attempt(_recipe(tmp_path / "resumed", tmp_path / "remote-2", tiny_llama, data, cache), tmp_path, "resumed")

    ratio = hit["phases"]["compile"] / first["phases"]["compile"]
    print(
        f"compile seconds: first attempt {first['phases']['compile']:.1f}, resumed with the artifacts "
        f"{hit['phases']['compile']:.1f} (ratio {ratio:.2f})"
    )
    assert hit["compile_cache"].startswith("hit: ") and hit["phases"].get("restore", 0) > 0
    assert ratio < 0.5
    straight = load_file(tmp_path / "first" / "final" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)
    # The resumed attempt compiled nothing new: its checkpoint links the staged files it loaded,
    # byte for byte the first attempt's, never serialised again.
    last = CheckpointManager(tmp_path / "resumed" / "checkpoints").committed()[-1]
    blob = last / cc.FOLDER / cc.BLOB
    assert blob.stat().st_ino == (tmp_path / "resumed" / cc.FOLDER / cc.BLOB).stat().st_ino
    assert blob.read_bytes() == (saved / cc.FOLDER / cc.BLOB).read_bytes()
    # Control: training changed the adapter since the checkpoint it resumed from.
    resumed_from = load_file(saved / "adapter_model.safetensors")
    assert any(not torch.equal(resumed_from[k], resumed[k]) for k in resumed_from if k in resumed)


def test_the_forecast_counts_a_first_compile_and_a_resumed_one(tmp_path: Path) -> None:
    from test_plan_pilot import _attempt_log

    from trainer.plan import pilot
    from trainer.plan import timeline as tl

    _attempt_log(tmp_path)  # two processes, each with one warm-up step of 3.0 and 2.0 s over a 1.0 s mean
    plain = pilot.summarise(tmp_path, warmup_steps=1, device="cpu")
    rows = read_rows(tmp_path)
    rows[0]["phases"]["compile"], rows[0]["compile_cache"] = 1.5, "miss: no checkpoint to load from"
    rows[1]["phases"]["compile"], rows[1]["compile_cache"] = 0.25, "hit: 6 artifact(s) and 28 kernel librar(ies) loaded"
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    compiled = pilot.summarise(tmp_path, warmup_steps=1, device="cpu")
    # The compile is an item of its own, no longer warm-up: (2.0 - 1.5 + 1.0 - 0.25) / 2.
    assert compiled["fixed"]["compile"] == 1.5 and compiled["fixed"]["warmup_extra"] == pytest.approx(0.625)
    first = tl.attempt_items(compiled, tl.Target())
    restart = tl.restart_items(compiled, tl.Target(), None)
    assert tl.Item(tl.COMPILE_FIRST, 1.5, "pilot") in first
    assert tl.Item(tl.COMPILE_RESUMED, 0.25, "pilot: compiled artifacts hit") in restart
    assert tl.restart_items(compiled, tl.Target(restarts=[9.0], restart_compiles=[0.5, 0.25, 0.75]), None)[-1] == (
        tl.Item(tl.COMPILE_RESUMED, 0.5, "ledger: 3 resumed attempt(s)")
    )
    # Control: without model.compile neither item appears and the pilot's summary is as before.
    names = {i.name for i in tl.attempt_items(plain, tl.Target()) + tl.restart_items(plain, tl.Target(), None)}
    assert not names & {tl.COMPILE_FIRST, tl.COMPILE_RESUMED} and "compile" not in plain["fixed"]
