"""The demo's first screen tells the truth: on the built-in data packing beats padding, and the
length histogram's bins fit the data."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from trainer import builtin_assets
from trainer.config import DataConfig
from trainer.data import prepare
from trainer.data.stats import ascii_histogram, histogram_edges, length_stats

REPO = Path(__file__).resolve().parents[1]


def _demo_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def demo_manifest(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """The built-in data prepared with the demo's settings (2,000 examples, 512-token rows)."""
    data = builtin_assets.write_dataset(tmp_path_factory.mktemp("demo-data") / "train.jsonl")
    prepared = prepare(
        DataConfig(path=str(data), seq_len=512), str(tiny_llama), tmp_path_factory.mktemp("c"), progress=False
    )
    return prepared.manifest


def test_demo_data_is_long_tailed_and_packing_beats_padding(demo_manifest: dict) -> None:  # type: ignore[type-arg]
    st = demo_manifest["train"]
    lengths = st["lengths"]
    assert lengths["p99"] >= 1.8 * lengths["p50"], "real SFT lengths have a long tail"
    assert st["truncated"] == 0
    assert st["packing_efficiency"] >= 0.95
    # 99.8% vs 46.9% when measured (rows rendered by the tiny model's chat template)
    assert st["packing_efficiency"] >= 1.15 * st["baseline"]["efficiency"]
    text = _demo_module().packing_comparison(demo_manifest)
    ratio = st["packing_efficiency"] / st["baseline"]["efficiency"]
    assert f"{st['rows']:,} rows of 512 tokens" in text and f"padding computes {ratio:.2f}x" in text


def test_histogram_bins_fit_the_data(demo_manifest: dict) -> None:  # type: ignore[type-arg]
    hist = demo_manifest["train"]["lengths"]["histogram"]
    edges, counts = hist["edges"], hist["counts"]
    assert 8 <= len(counts) <= 20 and sum(c == 0 for c in counts) <= 2
    assert edges[0] <= demo_manifest["train"]["lengths"]["min"] < edges[1]
    assert sum(counts) == demo_manifest["train"]["examples_out"]


@pytest.mark.parametrize(
    "lens",
    [
        np.array([7]),
        np.arange(1, 4),
        np.random.default_rng(0).integers(60, 110, 500),
        np.random.default_rng(0).lognormal(5, 1, 3000).astype(int) + 1,  # a tail far beyond p99
    ],
)
def test_histogram_edges_cover_every_example_in_round_bins(lens: np.ndarray) -> None:
    edges = histogram_edges(lens)
    counts, _ = np.histogram(lens, bins=edges)
    assert counts.sum() == lens.size and len(counts) <= 20
    assert edges[0] <= lens.min() and edges[-1] == lens.max() + 1 or edges[-2] <= lens.max() < edges[-1]
    widths = set(np.diff(edges[:-1]).tolist())
    assert len(widths) <= 1  # every bin but the last has one round width
    assert (counts > 0).mean() >= 0.5


def test_the_old_histogram_left_most_bins_empty() -> None:
    """Control: bins spanning [0, max] (the former rule) leave most bins empty on template-heavy data."""
    lens = np.random.default_rng(0).integers(60, 110, 500)
    old = np.unique(np.linspace(0, lens.max() + 1, 21).round().astype(np.int64))
    assert (np.histogram(lens, bins=old)[0] == 0).sum() > 10
    assert (np.histogram(lens, bins=histogram_edges(lens))[0] == 0).sum() == 0
    assert len(ascii_histogram(length_stats(lens)["histogram"])) == len(histogram_edges(lens)) - 1


def test_the_demo_asks_as_trained_and_its_chat_command_gives_the_same_answer(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo prints each question as the model is asked it (the alpaca input after a blank line, not
    after a space), and its last line is the `spotune chat` command that gives the same greedy reply, and runs
    when pasted into a shell where .venv was never activated."""
    import subprocess

    from trainer.cli.main import main

    demo = _demo_module()
    run = tmp_path / "run"
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=40)
    argv = [f"output_dir={run}", f"model.name_or_path={tiny_llama}", f"data.path={data}", "data.seq_len=128"]
    assert main(["train", *argv, "train.max_steps=2", "metrics.progress=false"]) == 0
    scored = demo.score(str(tiny_llama), adapter=run / "final")
    prompt, _ = scored.cases[0]
    assert scored.answers[0], "a reply to compare (not an end of turn at once)"
    held = builtin_assets.held_out_examples()[0]
    assert prompt == f"{held['instruction']}\n\n{held['input']}" and held["input"], "the asked text, input included"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as after `make demo`: .venv never activated
    command = demo.chat_command(run, prompt)
    assert f" chat {run} --prompt $'" in command and "\n" not in command
    # The words bash makes of it, then the command itself, in this process.
    words = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True).stdout
    args = words.decode().split("\0")[:-1]
    assert args[args.index("--prompt") + 1] == prompt
    # Pasted into a shell that never activated the environment (`make demo` does not), the program runs.
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    found = subprocess.run(["bash", "-c", f"command -v {args[0]}"], env=bare, capture_output=True, text=True)
    assert found.returncode == 0 and args[0] != "spotune", (args[0], found)
    help_text = subprocess.run([args[0], "chat", "--help"], env={**os.environ, **bare}, capture_output=True, text=True)
    assert help_text.returncode == 0 and "--prompt" in help_text.stdout, help_text.stderr[-2000:]
    args = ["spotune", *args[1:]]
    capsys.readouterr()
    assert main(args[1:]) == 0
    assert capsys.readouterr().out.strip() == scored.answers[0]
