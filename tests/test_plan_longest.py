"""`spotune estimate --longest`: the longest one-document row each GPU trains with a recipe's settings
(trainer/plan/longest.py), exact to the search unit, with its GPU and host memory and tokens/s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer import catalog as cat
from trainer import config as C
from trainer.cli.main import main
from trainer.cli.world import longest_for_run
from trainer.plan import memory as mem
from trainer.plan.longest import UNIT, bisect_longest, document_tokens_per_s, one_row

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "gpu" / "llama-3.1-8b-qlora.yaml"


def test_bisection_finds_the_last_multiple_that_fits() -> None:
    assert bisect_longest(lambda n: n <= 5000) == 4096
    assert bisect_longest(lambda n: n <= 555_008) == 555_008
    assert bisect_longest(lambda n: n <= 1000) == 0  # the control: not even one unit
    assert bisect_longest(lambda n: True, cap=8 * UNIT) == 8 * UNIT  # the cap holds


def test_an_8b_qlora_r32_document_of_512k_tokens_fits_an_80gb_gpu_with_tiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = C.load(RECIPE, ["adapter.r=32", "model.tiled_mlp=auto"])
    found = longest_for_run(cfg, gpu="H100-SXM")
    (row,) = found["rows"]
    seq = row["longest_seq_len"]
    assert seq >= 512 * 1024 and seq % UNIT == 0
    # Exact to the unit: the row fits, one unit more does not.
    from trainer.builtin_assets import resolve_model
    from trainer.cli.world import _job

    job, _ = _job(cfg, resolve_model(cfg.model.name_or_path))
    budget = cat.find_gpu("H100-SXM", cat.load_catalog(None)).memory_gib * mem.GIB
    assert one_row(job, seq).memory().total <= budget < one_row(job, seq + UNIT).memory().total
    assert row["host_gib"] == pytest.approx(one_row(job, seq).memory().offloaded / mem.GIB)
    # A long document is slower per token than a short one (attention grows with its square).
    assert (
        row["tokens_per_s"] < document_tokens_per_s(job.shape, job.lora_params, 4096, 989e12, found["assumed_mfu"]) / 2
    )
    # The control: untiled, the recipe's own default, reaches less than half of it; the table says both.
    untiled = longest_for_run(C.load(RECIPE, ["adapter.r=32"]), gpu="H100-SXM")["rows"][0]
    assert untiled["longest_seq_len"] < seq / 2 and untiled["longest_seq_len_tiled"] == seq
    assert main(["estimate", str(RECIPE), "adapter.r=32", "--longest", "--gpu", "H100-SXM"]) == 0
    out = capsys.readouterr().out
    assert f"{untiled['longest_seq_len']:,d}" in out and f"{seq:,d}" in out and "tiled_mlp=auto" in out
    assert main(["estimate", str(RECIPE), "adapter.r=32", "--longest", "--json"]) == 0
    assert {r["gpu"] for r in json.loads(capsys.readouterr().out)["rows"]} >= {"H100-SXM", "A100-80GB", "L4"}


def test_a_gpu_too_small_for_one_row_says_none_fits(capsys: pytest.CaptureFixture[str]) -> None:
    seventy = REPO / "recipes" / "gpu" / "llama-3.1-70b-fsdp-qlora.yaml"
    assert main(["estimate", str(seventy), "adapter.method=lora", "--longest", "--gpu", "H100-SXM"]) == 0
    assert "none fits" in capsys.readouterr().out  # 140 GB of bf16 weights on one 80 GB card
    assert main(["estimate", str(seventy), "adapter.method=lora", "--longest", "--gpu", "H100-SXM", "--gpus", "8"]) == 0
    assert "none fits" not in capsys.readouterr().out  # the control: sharded over eight, it does
