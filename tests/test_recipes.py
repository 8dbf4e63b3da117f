"""Every shipped recipe loads, validates and is estimated offline; the count is asserted so none is
silently skipped. GPU recipes train an instruct model through its own chat template."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from trainer import builtin_assets
from trainer import config as C
from trainer.cli import world
from trainer.data.sampler import run_steps
from trainer.plan.lacks import frugal_gib

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
GPU_RECIPES = [p for p in RECIPES if "gpu" in p.parts]
# Post-trained (chat) models: the name says so, or the publisher ships only the chat model under it.
CHAT_MODELS = ("-Instruct", "-it", "Qwen/Qwen3-8B", "microsoft/phi-4", "Qwen/Qwen3-30B-A3B", "openai/gpt-oss-20b")


def test_recipe_count() -> None:
    assert len(RECIPES) == 17, [str(p) for p in RECIPES]
    assert len(GPU_RECIPES) == 16


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path: Path) -> None:
    cfg = C.load(path)
    assert cfg.output_dir == f"runs/{path.stem}"
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), "each recipe opens with a comment"
    formats = [cfg.data.format, *(s.format for s in cfg.data.sources)]
    assert "chat" not in formats, "recipes use the current format names (`messages`, not the former `chat`)"


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipe_settings(path: Path) -> None:
    """The global batch defines the run, `auto` picks the memory settings on the GPU in hand, bf16
    autocast on, LoRA dropout off (it copies every adapted input), and a chat model learns
    conversations through its own template, never an alpaca prompt."""
    cfg = C.load(path)
    header = path.read_text().split("\noutput_dir:")[0]
    assert f"spotune estimate recipes/gpu/{path.name}" in header
    assert f"train recipes/gpu/{path.name}" in header
    assert cfg.train.global_batch_size is not None and cfg.train.grad_accum is None
    assert cfg.train.micro_batch_size == "auto" and cfg.model.gradient_checkpointing == "auto"
    assert cfg.train.mixed_precision == "bf16" and cfg.adapter.dropout == 0.0
    assert cfg.checkpoint.preemption_notice == "auto"
    assert cfg.data.format != "alpaca"
    if cfg.train.objective != "sft":  # preference pairs, through the same template
        assert cfg.data.format == "preference" and '"chosen"' in header and '"rejected"' in header
    elif any(mark in cfg.model.name_or_path for mark in CHAT_MODELS):
        assert cfg.data.format == "messages", cfg.model.name_or_path  # the current name (`chat` is its former one)
        assert '"messages"' in header, "the header shows the data layout"
    if cfg.adapter.method == "qlora":
        assert cfg.adapter.quant_bits == 4 and cfg.model.dtype == "bfloat16"  # NF4 with bf16 compute
        # paged 8-bit AdamW on one GPU; FSDP steps sharded parameters, which bitsandbytes cannot
        assert cfg.train.optimizer == ("adamw" if cfg.train.distributed == "fsdp" else "paged_adamw_8bit")


def _gpus(path: Path) -> int:
    return 4 if "fsdp" in path.name else 1


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_gpu_recipe_estimates_offline_without_its_data(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's data file is not here (a hub dataset: not in this offline cache): the memory fit per
    GPU still answers (from the shipped model shape), and --tokens gives the hours and cost with the exact
    step count."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    cfg = C.load(path)
    assert not Path(cfg.data.path).exists()
    fit = world.estimate_for_run(cfg, gpus=_gpus(path))
    assert fit["data"]["source"] == "none" and "data.path" in fit["data"]["problem"]
    assert "--tokens N" in fit["needs"] and fit["recommendation"] is None
    assert fit["model"]["params"] > 4e8
    h100 = next(o for o in fit["options"] if o["gpu"] == "H100-SXM")
    assert h100["fits"] and fit["memory_gib"]["total"] < h100["memory_gib"]

    tokens = 3_000_000
    full = world.estimate_for_run(cfg, gpus=_gpus(path), tokens=tokens, gpu="H100-SXM")
    rows = math.ceil(tokens / cfg.data.seq_len)
    assert full["data"]["source"] == "given" and full["data"]["rows_per_epoch"] == rows
    assert full["run"]["global_batch_rows"] == cfg.train.global_batch_size
    assert full["run"]["steps"] == run_steps(rows, cfg.train.global_batch_size, cfg.train.max_steps, cfg.train.epochs)
    assert full["memory_gib"]["total"] == fit["memory_gib"]["total"]
    assert all(o["cost"]["expected"] > 0 for o in full["options"])


def test_estimate_without_data_prints_the_memory_fit() -> None:
    """The command line, offline with no token: the fit per GPU, then what time and cost need."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_TOKEN", None)
    recipe = "recipes/gpu/llama-3.1-70b-fsdp-qlora.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "estimate", recipe, "--gpus", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(
        "cheapest GPU that fits (by cost per million trained tokens; throughput assumed, not measured: each GPU's peak"
    )
    model = next(line for line in lines if line.startswith("model "))
    assert model.startswith("model   meta-llama/Llama-3.1-70B-Instruct (llama, 70,553.7M params, nf4)")
    assert any(line.startswith("memory  GiB per GPU") and ": weights " in line for line in lines)
    rows = [line.split() for line in lines if line[:1].isupper()]
    fits = {row[0]: row[2] for row in rows if len(row) > 2 and row[2] in ("yes", "NO")}
    assert fits["H100-SXM"] == "yes" and fits["L4"] == "NO"  # 26 GiB per GPU over 2 GPUs
    assert "does not fit: per-device memory under FSDP fits with more of them (--gpus N) on:" in out.stdout
    assert "L4 x4" in out.stdout
    assert "data: data.path: data/train.jsonl does not exist" in out.stdout
    assert "give data.path=FILE" in out.stdout and "--tokens N" in out.stdout


def test_a_data_problem_is_still_an_error(tmp_path: Path) -> None:
    """Control: data that is there but unreadable is the data's problem, not a memory-only estimate."""
    bad = tmp_path / "train.jsonl"
    bad.write_text("{not json\n")
    cfg = C.load(REPO / "recipes" / "gpu" / "llama-3.2-1b-lora.yaml", [f"data.path={bad}"])
    with pytest.raises(Exception) as err:
        world.estimate_for_run(cfg)
    assert str(bad) in str(err.value) or "data.path" in str(err.value)


@pytest.mark.skipif(not (SHARED_DATA / "tokenizers").is_dir(), reason=f"{SHARED_DATA / 'tokenizers'} is absent")
def test_chat_recipe_estimates_conversations_through_the_models_template(tmp_path: Path) -> None:
    """The Llama recipe on conversations, tokenized by Llama 3.1 Instruct's own tokenizer and template."""
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as f:
        for ex in builtin_assets.make_examples(400, seed=1):
            user = ex["instruction"] + ("\n\n" + ex["input"] if ex["input"] else "")
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": ex["output"]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    tokenizer = SHARED_DATA / "tokenizers" / "llama-3.1-instruct"
    cfg = C.load(
        REPO / "recipes" / "gpu" / "llama-3.1-8b-qlora.yaml",
        [f"data.path={data}", f"data.tokenizer={tokenizer}", "data.seq_len=512", f"output_dir={tmp_path / 'run'}"],
    )
    result = world.estimate_for_run(cfg, gpu="H100-SXM")
    d = result["data"]
    assert d["source"] == "sample" and d["sampled_examples"] == 400 and d["examples"] == 400
    # only the assistant turns are trained: fewer trainable tokens than real ones
    assert 0 < d["trainable_tokens_per_epoch"] < d["real_tokens_per_epoch"]


def test_config_reference_documents_every_key() -> None:
    """docs/config-reference.md is what scripts/config_reference.py writes, for the keys of this schema."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(REPO / "scripts"))
    page = (REPO / "docs" / "config-reference.md").read_text()
    assert page == config_reference.page(), "docs/config-reference.md is stale: run python scripts/config_reference.py"
    missing = [key for key, _, _ in C.field_docs() if f"| `{key}` |" not in page]
    assert not missing


def test_readme_commands_match_ci() -> None:
    root = Path(__file__).resolve().parents[1]
    assert "make test" in (root / ".ci" / "run").read_text()
    readme = (root / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_docs_list_every_recipe() -> None:
    page = (REPO / "docs" / "recipes.md").read_text()
    missing = [
        str(p.relative_to(REPO / "recipes")) for p in RECIPES if f"`{p.relative_to(REPO / 'recipes')}`" not in page
    ]
    assert not missing, f"docs/recipes.md lacks {missing}"
    for path in GPU_RECIPES:
        assert f"`{C.load(path).model.name_or_path}`" in page


def _gb_claim(text: str) -> int | None:
    found = re.search(r"\bone (\d+) GB\+", text)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_recipe_header_and_docs_agree_on_the_gpu_and_the_estimate_fits_it(path: Path) -> None:
    """A recipe's first line and its row in docs/recipes.md name the same GPU memory ("one N GB+"), and
    the estimate with the `auto` settings at their most frugal fits it (a GPU sold as N GB shows about
    0.95 x N GB to torch)."""
    header = path.read_text().splitlines()[0]
    row = next(line for line in (REPO / "docs" / "recipes.md").read_text().splitlines() if f"`gpu/{path.name}`" in line)
    gpus = row.rstrip(" |").rsplit("|", 1)[-1]
    claim = _gb_claim(header)
    assert claim == _gb_claim(gpus), (header, gpus)
    if claim is None:
        assert " GB" not in header, header  # a claim in another form ("one 24-80 GB GPU") would not be checked
        return
    cfg = C.load(path)
    job, _ = world._job(cfg, builtin_assets.resolve_model(cfg.model.name_or_path))
    assert frugal_gib(job, 1) <= 0.95 * claim * 1e9 / 2**30, (path.name, frugal_gib(job, 1))


def test_the_tiny_recipe_reads_your_own_file_in_any_format_and_a_small_one_is_told_its_override(
    tmp_path: Path, tiny_tokenizer: Path
) -> None:
    """`spotune train recipes/tiny-cpu.yaml data.path=my.jsonl` reads a messages file as it reads alpaca
    (data.format auto); a file too small for one step is answered with the override that runs it."""
    from trainer.data import prepare
    from trainer.data.sampler import steps_per_epoch

    rows = [
        {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]}
        for i in range(12)
    ]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = C.load(REPO / "recipes" / "tiny-cpu.yaml", [f"data.path={mine}"])
    assert cfg.data.format == "auto"
    prepared = prepare(cfg.data, str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert prepared.manifest["train"]["format"] == "messages" and prepared.manifest["train"]["examples_out"] == 12
    n_rows = prepared.manifest["train"]["rows"]
    needed = C.batch_split(cfg.train, 1).global_rows
    assert n_rows < needed  # 12 short answers: fewer packed rows than the recipe's step takes
    with pytest.raises(C.ConfigError) as e:
        steps_per_epoch(n_rows, needed)
    override = "train.micro_batch_size=1 train.grad_accum=1"
    assert f"{override} (one row a step, {n_rows} steps an epoch)" in str(e.value)
    fixed = C.load(REPO / "recipes" / "tiny-cpu.yaml", [f"data.path={mine}", *override.split()])
    assert steps_per_epoch(n_rows, C.batch_split(fixed.train, 1).global_rows) == n_rows  # what it said
