"""`spotune estimate`: token counts, throughput sources, memory fit, recommendation, --json schema."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from pilot_fixture import FIXED, RESTART

from trainer import config
from trainer.cli import world
from trainer.cli.main import main as spotune
from trainer.plan import PlanError, estimate, table
from trainer.training import inputs

OPTION_KEYS = {
    "gpu",
    "gpus",
    "pricing",
    "price_per_gpu_hour",
    "compute_hours",
    "eval_hours",
    "checkpoint_hours",
    "startup_hours",
    "interruptions",
    "restart_hours",
    "checkpoint_interval_hours",
    "wall_hours",
    "gpu_hours",
    "cost",
    "fits",
    "memory_gib",
    "throughput_basis",
    "tokens_per_s",
    "recommended_checkpoint_minutes",
    "fixed_spread_hours",
    "saves",
    "fsdp_gpus",
    "mtbi_hours",
    "setting",
    "fit_changes",
}
TOP_KEYS = {
    "schema",
    "model",
    "data",
    "run",
    "memory_gib",
    "throughput",
    "checkpoint",
    "timeline",
    "constraints",
    "options",
    "recommendation",
    "cheapest",
    "assumptions",
}


@pytest.fixture()
def cfg(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> config.RunConfig:
    return config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
            "data": {"path": str(tiny_data), "seq_len": 256},
            "train": {"epochs": 2, "micro_batch_size": 4, "grad_accum": 2},
            "checkpoint": {"every_minutes": 30},
            "metrics": {"progress": False},
        }
    )


def _pilot(tmp_path: Path, device: str, tokens_per_s: float = 10_000.0) -> Path:
    path = tmp_path / "pilot.json"
    path.write_text(
        json.dumps(
            {
                "schema": "spotune.pilot/2",
                "device": device,
                "world_size": 1,
                "sustained_tokens_per_s": tokens_per_s,
                "sustained_mfu": 0.4,
                "step_time_s": {
                    "mean": 1.0,
                    "sd": 0.1,
                    "n": 16,
                    "between_sd": 0.02,
                    "p10": 0.9,
                    "p50": 1.0,
                    "p90": 1.2,
                },
                "warmup_extra_seconds": 5.0,
                "fixed": FIXED,
                "restart": RESTART,
                "save_seconds": 12.0,
                "checkpoint_bytes": 1e8,
                "eval_seconds": None,
            }
        )
    )
    return path


def test_sampled_counts_match_the_manifest_and_extrapolate(cfg: config.RunConfig) -> None:
    # 400 examples: a sample of 2000 holds them all, so the "estimate" must equal the exact counts.
    sampled = world.estimate_for_run(cfg, throughput=1000.0)
    assert sampled["data"]["source"] == "sample" and not sampled["data"]["exact"]
    prepared = inputs.prepare_data(cfg, progress=False)
    exact = world.estimate_for_run(cfg, throughput=1000.0)
    train = prepared.manifest["train"]
    assert exact["data"]["source"] == "manifest" and exact["data"]["exact"]
    assert exact["data"]["rows_per_epoch"] == train["rows"]
    assert exact["data"]["real_tokens_per_epoch"] == train["real_tokens"]
    assert exact["data"]["trainable_tokens_per_epoch"] == train["trainable_tokens"]
    for key in ("rows_per_epoch", "real_tokens_per_epoch", "trainable_tokens_per_epoch"):
        assert sampled["data"][key] == exact["data"][key]
    # A quarter of the examples, scaled up: close to the exact counts, but not identical.
    cfg_other = cfg.replace(**{"data.cache_dir": str(Path(cfg.output_dir) / "elsewhere")})
    quarter = world.estimate_for_run(cfg_other, throughput=1000.0, sample_size=100)
    assert quarter["data"]["sampled_examples"] == 100
    assert quarter["data"]["real_tokens_per_epoch"] == pytest.approx(train["real_tokens"], rel=0.15)
    # Steps follow the sampler's rule: whole steps per epoch, times epochs.
    assert exact["run"]["steps"] == 2 * (train["rows"] // 8)
    assert exact["run"]["real_tokens"] == pytest.approx(
        exact["run"]["steps"] * 8 * train["real_tokens"] / train["rows"]
    )


def test_given_throughput_sets_the_hours(cfg: config.RunConfig) -> None:
    r = world.estimate_for_run(cfg, throughput=500.0, gpu="L4")
    assert {o["gpu"] for o in r["options"]} == {"L4"} and len(r["options"]) == 2
    od = next(o for o in r["options"] if o["pricing"] == "on-demand")
    assert od["compute_hours"]["expected"] == pytest.approx(r["run"]["real_tokens"] / 500.0 / 3600)
    assert od["compute_hours"]["low"] < od["compute_hours"]["expected"] < od["compute_hours"]["high"]
    assert od["cost"]["expected"] == pytest.approx(od["wall_hours"]["expected"] * od["price_per_gpu_hour"])
    # Four GPUs: 4 x 500 tokens/s at 90% data-parallel efficiency, a quarter of the steps.
    r4 = world.estimate_for_run(cfg, throughput=500.0, gpu="L4", gpus=4)
    od4 = next(o for o in r4["options"] if o["pricing"] == "on-demand")
    assert od4["tokens_per_s"] == pytest.approx(4 * 500.0 * estimate.MULTI_GPU_EFFICIENCY)
    assert r4["run"]["global_batch_rows"] == 32 and r4["run"]["steps"] == 2 * (r4["data"]["rows_per_epoch"] // 32)


def test_evaluation_overhead(cfg: config.RunConfig) -> None:
    with_eval = cfg.replace(**{"data.eval_fraction": 0.1, "train.eval_every": 10})
    r = world.estimate_for_run(with_eval, throughput=500.0, gpu="L4")
    prepared = inputs.prepare_data(with_eval, progress=False)
    eval_tokens = prepared.manifest["eval"]["real_tokens"]
    od = next(o for o in r["options"] if o["pricing"] == "on-demand")
    evals = r["run"]["steps"] // 10
    assert evals >= 1
    # Each evaluation is a forward pass over the eval split: a third of a training token's cost.
    assert od["eval_hours"] == pytest.approx(evals * eval_tokens / 3 / 500.0 / 3600, rel=0.02)  # sampled vs exact
    assert world.estimate_for_run(cfg, throughput=500.0, gpu="L4")["options"][0]["eval_hours"] == 0.0


def test_pilot_on_a_catalogue_gpu_scales_to_the_others(cfg: config.RunConfig, tmp_path: Path) -> None:
    r = world.estimate_for_run(cfg, pilot_json=_pilot(tmp_path, "NVIDIA H100 80GB HBM3"))
    by = {(o["gpu"], o["pricing"]): o for o in r["options"]}
    h100, a100 = by[("H100-SXM", "on-demand")], by[("A100-80GB", "on-demand")]
    assert h100["tokens_per_s"] == 10_000.0 and h100["throughput_basis"] == "measured"
    assert a100["tokens_per_s"] == pytest.approx(10_000.0 * 312 / 989)
    assert a100["throughput_basis"] == "scaled from H100-SXM"
    # Where the pilot ran: +/- 2 sd of the measured variation: the step-time spread whole (the
    # machine's speed drifts slowly), the error of the pilot's mean of 16 steps, the spread between processes.
    c = h100["compute_hours"]
    rel = 2 * math.sqrt(0.1**2 + 0.1**2 / 16 + 0.02**2)
    assert c["high"] == pytest.approx(c["expected"] * (1 + rel)) and c["low"] == pytest.approx(
        c["expected"] / (1 + rel)
    )
    # Carried to another GPU: the step-time p10/p90 (mean/p10 faster, mean/p90 slower).
    a = a100["compute_hours"]
    assert a["low"] == pytest.approx(a["expected"] * 0.9) and a["high"] == pytest.approx(a["expected"] * 1.2)
    # Fixed costs, itemised: a fresh directory prepares the data; the model is a local path.
    items = {i["name"]: i for i in r["timeline"]["attempt"]}
    assert items["data: prepare (no cache in the target directory)"]["seconds"] == 30.0
    assert items["base model download"] == {"name": "base model download", "seconds": 0.0, "source": "local path"}
    assert all(i["source"] == "pilot" for i in r["timeline"]["attempt"] if i["name"] != "base model download")
    assert h100["startup_hours"] == pytest.approx((20 + 40 + 30 + 3 + 5 + 2 + 0 + 1 + 1) / 3600)
    # A restart: a replacement VM (assumed), start-up with resume less its cache hit, preparing on the empty disk.
    assert r["timeline"]["restart_seconds"] == pytest.approx(180 + (70 - 1) + 30 + 5)
    # The wall range adds the fixed costs' spread (2 sd) in quadrature: between the pilot's
    # processes (2 s) and the machine's 10% on the 102 s.
    w = h100["wall_hours"]
    fixed_sd = math.hypot(2.0, 0.1 * 102)
    assert r["timeline"]["fixed_sd_seconds"] == pytest.approx(fixed_sd)
    assert w["high"] - w["expected"] == pytest.approx(math.hypot(c["high"] - c["expected"], 2 * fixed_sd / 3600))
    assert r["checkpoint"]["save_seconds"] == 12.0
    spot = by[("H100-SXM", "spot")]
    assert spot["interruptions"] > 0 and spot["recommended_checkpoint_minutes"] == pytest.approx(
        math.sqrt(2 * 12.0 * 10 * 3600) / 60
    )  # Young/Daly with the catalogue's 10 h MTBI


def test_memory_fit_and_constraints_drive_the_recommendation(cfg: config.RunConfig, tmp_path: Path) -> None:
    small = tmp_path / "gpus.yaml"
    small.write_text(
        "gpus:\n  - name: Tiny\n    memory_gib: 0.5\n    peak_bf16_flops: 1.0e15\n    on_demand_price: 0.01\n"
    )
    r = world.estimate_for_run(cfg, catalog_path=small)
    tiny = next(o for o in r["options"] if o["gpu"] == "Tiny")
    assert not tiny["fits"]  # 1 GiB of CUDA context alone does not fit in 0.5 GiB
    rec = r["recommendation"]
    assert rec is not None and rec["gpu"] != "Tiny"
    fitting = [o for o in r["options"] if o["fits"]]
    assert rec["cost"] == min(o["cost"]["expected"] for o in fitting)
    assert world.estimate_for_run(cfg, deadline_hours=1e-6)["recommendation"] is None
    fast = world.estimate_for_run(cfg, budget=1e6)["recommendation"]
    assert fast["wall_hours"] == min(o["wall_hours"]["expected"] for o in fitting)


def test_json_schema_via_the_cli(cfg: config.RunConfig, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(config.to_yaml(cfg))
    assert spotune(["estimate", str(recipe), "--json", "--gpus", "2", "--deadline-hours", "100"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert set(doc) == TOP_KEYS and doc["schema"] == estimate.SCHEMA
    assert doc["run"]["gpus"] == 2 and doc["run"]["global_batch_rows"] == 16
    assert doc["throughput"]["source"] == "mfu"
    assert doc["options"] and all(set(o) == OPTION_KEYS for o in doc["options"])
    for o in doc["options"]:
        for key in ("compute_hours", "wall_hours", "gpu_hours", "cost"):
            assert set(o[key]) == {"low", "expected", "high"}
            assert o[key]["low"] <= o[key]["expected"] <= o[key]["high"]
        assert o["gpu_hours"]["expected"] == pytest.approx(2 * o["wall_hours"]["expected"])
    assert set(doc["memory_gib"]) >= {"weights", "activations", "logits", "total", "pilot_measured_peak"}
    rec = doc["recommendation"]
    assert doc["options"][rec["index"]]["gpu"] == rec["gpu"]
    # The readable table renders the same document.
    text = table.format_estimate(doc)
    assert "recommended: " + rec["gpu"] in text and "H100-SXM" in text


def test_bad_flags_name_the_fix(cfg: config.RunConfig) -> None:
    with pytest.raises(PlanError, match="--mfu"):
        world.estimate_for_run(cfg, mfu=1.5)
    with pytest.raises(PlanError, match="--gpus"):
        world.estimate_for_run(cfg, gpus=0)
    with pytest.raises(PlanError, match="not in the catalogue"):
        world.estimate_for_run(cfg, gpu="Voodoo5")


def test_fsdp_memory_is_per_device_and_names_the_smallest_count(cfg: config.RunConfig) -> None:
    big = cfg.replace(
        **{
            "model.name_or_path": "meta-llama/Llama-3.1-70B",
            "data.tokenizer": cfg.model.name_or_path,  # counted with the tiny tokenizer: no download
            "model.dtype": "bfloat16",
            "adapter.method": "qlora",
            "data.seq_len": 4096,
            "train.micro_batch_size": 1,
            "model.gradient_checkpointing": True,
        }
    )
    ddp = world.estimate_for_run(big, throughput=100.0)
    by = {o["gpu"]: o for o in ddp["options"] if o["pricing"] == "on-demand"}
    assert by["H100-SXM"]["fits"] and by["H100-SXM"]["fsdp_gpus"] is None
    assert (by["A100-40GB"]["fits"], by["A100-40GB"]["fsdp_gpus"]) == (False, 2)
    assert (by["RTX-4090"]["fits"], by["RTX-4090"]["fsdp_gpus"]) == (False, 4)  # the fused head: a chunk of logits
    assert "train.distributed=fsdp (--gpus N) on: A100-40GB x2" in table.format_estimate(ddp)
    # Under DDP every GPU holds a whole copy: more GPUs do not lower the per-device peak (control).
    assert world.estimate_for_run(big, throughput=100.0, gpus=2)["memory_gib"]["total"] == ddp["memory_gib"]["total"]
    sharded = world.estimate_for_run(big.replace(**{"train.distributed": "fsdp"}), throughput=100.0, gpus=2)
    assert sharded["memory_gib"]["sharded_over"] == 2 and sharded["memory_gib"]["total"] < ddp["memory_gib"]["total"]
    fits = {o["gpu"]: o["fits"] for o in sharded["options"]}
    assert fits["A100-40GB"] and not fits["RTX-4090"]


def test_estimate_of_a_model_without_data_prices_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spotune estimate MODEL` names no data: the memory fit per GPU and what time and cost need, as
    --help says, never a figure from the built-in demo set (its default data.path)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # output_dir runs/default: a fresh directory, no pilot.json
    assert spotune(["estimate", "meta-llama/Llama-3.1-8B"]) == 0
    out = capsys.readouterr().out
    # Catalogue prices per GPU-hour only: no cost, hours or recommendation from the demo set.
    assert "~$" not in out and " h," not in out and "recommended" not in out and "real tokens/epoch" not in out
    assert "data: none given (data.path is unset; its default, the built-in demo set" in out
    assert "give data.path=FILE" in out and "--tokens N" in out
    assert "memory  GiB per GPU" in out and "H100-SXM" in out
    assert spotune(["estimate", "meta-llama/Llama-3.1-8B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["source"] == "none"
    with pytest.raises(SystemExit):
        spotune(["estimate", "--help"])
    assert "without it, the memory fit alone" in " ".join(capsys.readouterr().out.split())
    # A recipe file that does not name its data is the same; --tokens and a named data.path price it (control).
    recipe = tmp_path / "model-only.yaml"
    recipe.write_text("model:\n  name_or_path: meta-llama/Llama-3.1-8B\n")
    assert spotune(["estimate", str(recipe), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["source"] == "none"
    assert spotune(["estimate", str(recipe), "--tokens", "1e6", "--gpu", "H100-SXM"]) == 0
    assert "~$" in capsys.readouterr().out  # a cost, now the size is known


def test_every_figure_names_its_source_and_unit(
    cfg: config.RunConfig, tmp_path: Path, tiny_data: Path, tiny_llama: Path
) -> None:
    """The data's counts and the truncation: sampled, then exact; the throughput: assumed MFU, then a
    pilot's; memory in GiB per GPU; costs in $; the recommended row's `*` explained."""
    short = cfg.replace(**{"data.seq_len": 64})
    sampled = world.estimate_for_run(short, gpu="H100-SXM")
    text = table.format_estimate(sampled)
    assert "extrapolated from 400 sampled rows (data not prepared yet)" in text
    assert "at seq_len 64 (in use): " in text and "(in 400 sampled rows)" in text and "WARNING: " in text
    assert "throughput: assumed, not measured: each GPU's peak bf16 FLOP/s x MFU 0.35" in text
    assert "memory  GiB per GPU, estimated from the model's shape and the recipe: weights " in text
    assert "recommended: H100-SXM" in text and "; the row marked *)" in text and text.count(" *\n") == 1
    assert "cost = GPU-h x price, in $" in text
    rows = [line for line in text.splitlines() if line.startswith("H100-SXM")]
    assert len(rows) == 2 and all(line.count("$") == 4 for line in rows)  # $/GPU-h and low-expected-high
    prepared = inputs.prepare_data(short, progress=False)
    exact = world.estimate_for_run(short, gpu="H100-SXM", pilot_json=_pilot(tmp_path, "NVIDIA H100 80GB HBM3"))
    tr = prepared.manifest["train"]["truncation"]
    assert exact["data"]["truncation"] == {**tr, "p99": prepared.manifest["train"]["lengths"]["p99"]}
    assert sampled["data"]["truncation"] == exact["data"]["truncation"]  # the sample held every row
    text = table.format_estimate(exact)
    assert "exact, counted when the data was prepared" in text and "sampled rows" not in text
    assert "throughput: measured by a pilot (`spotune pilot`) on NVIDIA H100 80GB HBM3" in text
    assert "the pilot measured a peak of" not in text  # the fixture's pilot.json has no peak memory


def _offline_8b(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # output_dir runs/default: a fresh directory, no pilot.json


def test_a_bare_model_id_is_priced_as_a_run_would_train_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spotune estimate MODEL` prices the GPU recipes' `auto` memory settings, not checkpointing off: an
    8B LoRA at seq 2048 fits every 24 GB GPU, each GPU names the setting it would train with, and the
    cheapest GPU that fits comes first."""
    _offline_8b(monkeypatch, tmp_path)
    assert spotune(["estimate", "meta-llama/Llama-3.1-8B-Instruct", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {o["gpu"]: o for o in doc["options"]}
    assert doc["memory_gib"]["total"] < 20 and "gradient_checkpointing=true (auto)" in doc["memory_gib"]["settings"]
    for gpu in ("L4", "A10G", "RTX-4090", "RTX-3090"):
        assert by[gpu]["fits"] and by[gpu]["setting"]["fits"], gpu
        assert "gradient_checkpointing=true" in by[gpu]["setting"]["setting"] and by[gpu]["setting"]["gib"] <= 22.1
    # Where it fits without checkpointing, the run would not pay for it.
    assert "gradient_checkpointing=false" in by["H100-SXM"]["setting"]["setting"]
    # The cheapest is what trains a token for the least money, not the lowest price per hour: the RTX-3090
    # ($0.25/h) is the cheapest hour, the RTX-4090 ($0.40/h, 2.3x its bf16 FLOP/s) the cheapest token.
    per = {g: o["per_million_tokens"] for g, o in by.items()}
    for pricing, key in (("on-demand", "on_demand_price"), ("spot", "spot_price")):
        fitting = [g for g, o in by.items() if o["fits"] and o[key] is not None]
        assert doc["cheapest"][pricing]["gpu"] == min(fitting, key=lambda g: per[g][pricing]) == "RTX-4090"
        assert min(fitting, key=lambda g: by[g][key]) == "RTX-3090"  # control: by the hour, another GPU
        o = by["RTX-4090"]
        assert per["RTX-4090"][pricing] == pytest.approx(o[key] / (o["tokens_per_s"] * 3600) * 1e6)
    assert by["H100-SXM"]["tokens_per_s"] / by["RTX-4090"]["tokens_per_s"] == pytest.approx(989 / 165.2, rel=1e-6)
    assert spotune(["estimate", "meta-llama/Llama-3.1-8B-Instruct"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        "cheapest GPU that fits (by cost per million trained tokens; throughput assumed, not measured: each GPU's "
        "peak bf16 FLOP/s x MFU 0.35 (model FLOPs utilisation)): on-demand RTX-4090 $0.0"
    )
    assert "$/1M tok" in text
    # Control: the user's own setting wins over the defaults; checkpointing off does not fit a 24 GB GPU,
    # and the answer names the smallest change that does, with its memory.
    off_overrides = ["model.gradient_checkpointing=false", "model.activation_offload=off"]
    assert spotune(["estimate", "meta-llama/Llama-3.1-8B-Instruct", *off_overrides, "--json"]) == 0
    off = {o["gpu"]: o for o in json.loads(capsys.readouterr().out)["options"]}
    assert not off["L4"]["fits"] and off["L4"]["fit_changes"][0]["change"] == "model.gradient_checkpointing=true"
    assert off["L4"]["fit_changes"][0]["fits"] and off["L4"]["fit_changes"][0]["gib"] < 22.0


def test_what_makes_a_run_fit_is_the_smallest_change_first_with_its_memory(
    cfg: config.RunConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpointing, then offloading, then QLoRA, then the longest seq_len that fits, then FSDP over N:
    each priced by the same memory model as the run (exact), the seq_len the longest that fits (control: one
    step longer does not)."""
    from trainer.plan import changes
    from trainer.plan import memory as mem

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    big = cfg.replace(
        **{
            "model.name_or_path": "meta-llama/Llama-3.1-8B",
            "data.tokenizer": cfg.model.name_or_path,
            "model.dtype": "bfloat16",
            "data.seq_len": 16384,
            "train.micro_batch_size": 1,
        }
    )
    doc = world.estimate_for_run(big, data_given=False)
    l4 = next(o for o in doc["options"] if o["gpu"] == "L4")
    assert not l4["fits"] and l4["setting"] is None  # nothing is `auto`: the recipe's settings as they are
    assert [c["change"].split("=")[0] for c in l4["fit_changes"]] == [
        "model.gradient_checkpointing",
        "model.gradient_checkpointing",
        "adapter.method",
        "data.seq_len",
        "train.distributed",
    ]
    job, _ = world._job(big, big.model.name_or_path)
    lean, overrides = changes.frugal(job)
    assert overrides == ["model.gradient_checkpointing=true", "model.activation_offload=on"]
    assert l4["fit_changes"][1]["gib"] == lean.memory().total / mem.GIB
    seq = int(next(c for c in l4["fit_changes"] if c["change"].startswith("data.seq_len="))["change"].split()[0][13:])
    assert seq % changes.SEQ_STEP == 0 and seq < 16384
    room = 22.0 * mem.GIB
    import dataclasses

    assert dataclasses.replace(lean, seq_len=seq).memory().total <= room
    assert dataclasses.replace(lean, seq_len=seq + changes.SEQ_STEP).memory().total > room  # control
    fsdp = l4["fit_changes"][-1]
    assert fsdp["fits"] and fsdp["gpus"] == lean.fsdp_devices(22.0) and f"--gpus {fsdp['gpus']} " in fsdp["change"]
    assert fsdp["gib"] == lean.memory(fsdp["gpus"], fsdp=True).total / mem.GIB
    first = changes.smallest(l4["fit_changes"])
    assert first is not None and all(not c["fits"] for c in l4["fit_changes"][: l4["fit_changes"].index(first)])
    text = table.format_estimate(doc)
    assert "does not fit as set" not in text  # the memory-fit table puts the answer on the GPU's own row
    assert "L4                22  NO   " in text and f"fits with {first['change']} ({first['gib']:.1f} GiB)" in text


def test_the_interruption_rate_behind_spot_figures_is_shown_and_settable(
    cfg: config.RunConfig, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """mtbi_hours: on every spot row, in the assumptions and the text, in the docs; `--mtbi-hours H` sets
    every GPU's, `GPU=H` one GPU's, and the expected interruptions follow it."""
    default = world.estimate_for_run(cfg, throughput=1000.0)
    spot = {o["gpu"]: o for o in default["options"] if o["pricing"] == "spot"}
    assert spot["L4"]["mtbi_hours"] == 24 and spot["A10G"]["mtbi_hours"] == 24
    assert any("L4 24 h" in a and "--mtbi-hours" in a for a in default["assumptions"])
    one = world.estimate_for_run(cfg, throughput=1000.0, mtbi_hours=["L4=3"])
    spot1 = {o["gpu"]: o for o in one["options"] if o["pricing"] == "spot"}
    assert (spot1["L4"]["mtbi_hours"], spot1["A10G"]["mtbi_hours"]) == (3.0, 24)
    assert spot1["L4"]["interruptions"] == pytest.approx(spot["L4"]["interruptions"] * 8)
    every = world.estimate_for_run(cfg, throughput=1000.0, mtbi_hours=["6"])
    assert {o["mtbi_hours"] for o in every["options"] if o["pricing"] == "spot"} == {6.0}
    assert all(o["mtbi_hours"] is None for o in every["options"] if o["pricing"] == "on-demand")
    for bad, said in (("L4=0", "give hours above 0"), ("Voodoo5=3", "not in the catalogue"), ("x", "above 0")):
        with pytest.raises(PlanError, match=f"--mtbi-hours '{bad}'.*{said}"):
            world.estimate_for_run(cfg, throughput=1000.0, mtbi_hours=[bad])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(config.to_yaml(cfg))
    assert spotune(["estimate", str(recipe), "--gpu", "L4", "--mtbi-hours", "5"]) == 0
    assert "spot interruptions: one every (mean time between interruptions) L4 5 h" in capsys.readouterr().out
    docs = (Path(__file__).parents[1] / "docs" / "planning.md").read_text()
    assert "--mtbi-hours" in docs and "mtbi_hours" in docs


def test_a_wide_measured_spread_never_makes_the_fast_end_zero(cfg: config.RunConfig, tmp_path: Path) -> None:
    """A pilot on a busy machine (step-time sd 1.5x the mean) once printed `0-3m-11m`: the fast end is the
    rate 1 + r faster, expected / (1 + r), never 0; the slow end stays expected x (1 + r)."""
    path = _pilot(tmp_path, "NVIDIA H100 80GB HBM3")
    doc = json.loads(path.read_text())
    doc["step_time_s"] = {**doc["step_time_s"], "sd": 1.5, "between_sd": 0.0}
    path.write_text(json.dumps(doc))
    r = world.estimate_for_run(cfg, pilot_json=path, gpu="H100-SXM")
    c = r["options"][0]["compute_hours"]
    rel = 2 * math.sqrt(1.5**2 + 1.5**2 / 16)
    assert rel > 1  # -/+ 2 sd would reach below zero
    assert c["low"] == pytest.approx(c["expected"] / (1 + rel)) and c["high"] == pytest.approx(
        c["expected"] * (1 + rel)
    )
    assert r["options"][0]["wall_hours"]["low"] > 0


def test_the_run_line_adds_up_and_names_the_device(cfg: config.RunConfig, tmp_path: Path) -> None:
    """`steps x rows x seq_len` are token slots (their product printed); the real tokens are fewer and named
    apart; a pilot on this CPU says CPU, not `1 GPU(s)`."""
    r = world.estimate_for_run(cfg, pilot_json=_pilot(tmp_path, "cpu"))
    run = r["run"]
    slots = run["steps"] * run["global_batch_rows"] * run["seq_len"]
    assert run["real_tokens"] < slots
    line = next(x for x in table.format_estimate(r).splitlines() if x.startswith("run "))
    assert (
        f"{run['steps']:,} steps x {run['global_batch_rows']} rows x {run['seq_len']} token slots = {slots:,} token "
        f"slots, of which {run['real_tokens']:,.0f} real (non-padding) tokens, on 1 x CPU (where the pilot ran), "
        "or 1 GPU (the catalogue's rows)" in line
    )
    assert "GPU(s)" not in line
    gpu_only = next(x for x in table.format_estimate(world.estimate_for_run(cfg)).splitlines() if x.startswith("run "))
    assert ", on 1 GPU, " in gpu_only  # control: no pilot elsewhere, the catalogue's GPUs only
