"""`auto` memory settings decided together: every rank takes the smallest free memory of all ranks;
an `auto` choice that runs out of memory is retried once with the next smaller setting, then exits 5."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from test_autofit import _cfg as autofit_cfg
from test_autofit import _shape

from trainer import config
from trainer.exit_codes import EXIT_OUT_OF_MEMORY, EXIT_PREEMPTED
from trainer.model import flops
from trainer.plan.memory import GIB
from trainer.training import autofit, shutdown

REPO = Path(__file__).resolve().parents[1]


def _cfg(**dotted: object) -> config.RunConfig:
    return autofit_cfg(**({"adapter.method": "qlora"} | dotted))


def _setting(cfg: config.RunConfig) -> autofit.Setting:
    m, t = cfg.model, cfg.train
    return autofit.Setting(int(t.micro_batch_size), bool(m.gradient_checkpointing), m.activation_offload == "on")


def test_after_a_setting_ran_out_only_smaller_slower_ones_are_taken() -> None:
    first, _, auto = autofit.resolve_auto(_cfg(), _shape(), 24 * GIB, 24 * GIB, world=1)
    assert auto is not None and auto.chosen == _setting(first) == autofit.Setting(4, True, False)
    assert not auto.retried and auto.next_setting() is not None
    smaller = auto.next_setting()
    again, lines, retry = autofit.resolve_auto(_cfg(), _shape(), 24 * GIB, 24 * GIB, world=1, ran_out=auto.chosen)
    assert retry is not None and retry.retried and retry.next_setting() is None  # one retry only
    assert _setting(again) == retry.chosen == smaller
    est = {s: autofit.estimate(_cfg(), _shape(), s).reserved for s in (auto.chosen, retry.chosen)}
    assert est[retry.chosen] < est[auto.chosen]
    assert "ran out of memory in an earlier attempt" in lines[0] and autofit.RAN_OUT_FILE in lines[0]


class _Accelerator:
    def __init__(self, world: int) -> None:
        self.device = torch.device("cpu")
        self.process_index, self.num_processes = 0, world


def test_out_of_memory_exits_5_for_a_fixed_setting_and_after_the_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = transformers.LlamaConfig.from_pretrained(REPO / "benchmarks" / "configs" / "llama-3.1-8b.json")
    err = shutdown.OutOfMemory(6, 0, 4, 4, 4096)
    resolved, _, auto = autofit.resolve_auto(_cfg(), _shape(), 24 * GIB, 24 * GIB, world=1)
    assert auto is not None
    # An `auto` choice: recorded, retried now when this is the only rank, by a restart (143) otherwise.
    assert autofit.after_out_of_memory(err, resolved, hf, _Accelerator(1), auto, tmp_path) == (EXIT_PREEMPTED, True)
    assert autofit.read_ran_out(tmp_path) == auto.chosen
    assert json.loads((tmp_path / autofit.RAN_OUT_FILE).read_text())["step"] == 6
    assert "retrying with" in capsys.readouterr().err
    assert autofit.after_out_of_memory(err, resolved, hf, _Accelerator(2), auto, tmp_path) == (EXIT_PREEMPTED, False)
    # The retry ran out too: 5, saying so.
    again, _, retry = autofit.resolve_auto(_cfg(), _shape(), 24 * GIB, 24 * GIB, world=1, ran_out=auto.chosen)
    assert autofit.after_out_of_memory(err, again, hf, _Accelerator(1), retry, tmp_path) == (EXIT_OUT_OF_MEMORY, False)
    assert "already ran out once" in capsys.readouterr().err
    # A setting the recipe fixed: 5, as before.
    assert autofit.after_out_of_memory(err, resolved, hf, _Accelerator(1), None, tmp_path) == (
        EXIT_OUT_OF_MEMORY,
        False,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(
    rank: int, port: int, model: str, free: list[float], run_dir: str, out: str, ran_out: autofit.Setting
) -> None:
    """Each rank chooses (`chosen<rank>.json`); then rank 1 records `ran_out` in the run directory as
    an attempt that ran out of memory does, and each rank chooses again (`later<rank>.json`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        autofit.device_memory = lambda device: (free[rank], 64 * GIB)  # type: ignore[assignment]
        cfg = _cfg(**{"model.name_or_path": model, "data.seq_len": 256})
        for name in ("chosen", "later"):
            resolved, lines, _ = autofit.resolve_for_device(cfg, model, torch.device("cpu"), 2, True, Path(run_dir))
            Path(out, f"{name}{rank}.json").write_text(json.dumps([_setting(resolved).describe(), lines]))
            torch.distributed.barrier()  # both chose before the record below
            if name == "chosen" and rank == 1:
                autofit.record_ran_out(Path(run_dir), ran_out, step=3, rank=1)
            torch.distributed.barrier()  # ... and both choose again after it
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_see_different_free_memory_choose_the_same(tmp_path: Path, tiny_llama: Path) -> None:
    shape = flops.model_shape(transformers.AutoConfig.from_pretrained(tiny_llama))
    cfg = _cfg(**{"model.name_or_path": str(tiny_llama), "data.seq_len": 256})
    order = autofit.candidates("auto", "auto", "auto", 8)
    need = {s: autofit.estimate(cfg, shape, s, 2).reserved for s in order}
    headroom = autofit.HEADROOM_SHARE * 64 * GIB
    # Rank 0 has room for the fastest setting; rank 1 only for a smaller micro-batch.
    free = [need[order[0]] + headroom + GIB, need[order[2]] + headroom + 1]
    alone = [autofit.resolve(cfg, shape, f, 64 * GIB, world=2, shards=2)[0] for f in free]
    assert _setting(alone[0]) != _setting(alone[1])  # control: each rank alone would differ
    (tmp_path / "run").mkdir()
    # One pair of processes for both choices (each spawned rank imports torch and transformers anew).
    ran_out = _setting(alone[1])  # what the ranks choose together: then recorded as out of memory
    run_dir = str(tmp_path / "run")
    mp.spawn(_rank, args=(_free_port(), str(tiny_llama), free, run_dir, str(tmp_path), ran_out), nprocs=2)
    got = [json.loads((tmp_path / f"chosen{r}.json").read_text()) for r in (0, 1)]
    assert got[0][0] == got[1][0] == _setting(alone[1]).describe()  # the smallest free memory decides
    # And what ran out on one rank's machine in an earlier attempt is skipped by both.
    assert autofit.read_ran_out(tmp_path / "run") == ran_out
    later = [json.loads((tmp_path / f"later{r}.json").read_text()) for r in (0, 1)]
    assert later[0][0] == later[1][0] != got[0][0]


def _auto_run(out: Path, model: Path, data: Path) -> dict[str, Any]:
    """Two steps of the tiny model with an `auto` micro-batch of a global batch of 4 rows."""
    return {
        "output_dir": str(out),
        "model.name_or_path": str(model),
        "model.dtype": "float32",
        "data.path": str(data),
        "data.seq_len": 128,
        "train.micro_batch_size": "auto",
        "train.global_batch_size": 4,
        "train.max_steps": 2,
        "metrics.progress": False,
        "metrics.report": False,
        "checkpoint.every_minutes": None,
    }


def test_an_auto_choice_that_runs_out_is_retried_smaller_in_the_same_process(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from trainer.model import objective  # the loop's SFT objective calls the loss there
    from trainer.training import run

    real = objective.token_loss_sum

    def four_rows_do_not_fit(model: Any, micro: dict[str, Any]) -> Any:
        if micro["input_ids"].shape[0] == 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, micro)

    monkeypatch.setattr(objective, "token_loss_sum", four_rows_do_not_fit)
    overrides = _auto_run(tmp_path / "auto", tiny_llama, tiny_data) | {"model.gradient_checkpointing": "auto"}
    assert run.train(config.RunConfig().replace(**overrides)) == 0
    err = capsys.readouterr().err
    assert "the `auto` choice micro_batch_size=4" in err and "retrying with micro_batch_size=2" in err
    assert (tmp_path / "auto" / "final" / "adapter_model.safetensors").is_file()
    reasons = [json.loads(x)["exit_reason"] for x in (tmp_path / "auto" / "ledger.jsonl").read_text().splitlines()]
    assert reasons == ["out_of_memory", "finished"]
    # Control: the same micro-batch fixed by the recipe exits 5, as before.
    fixed = {**overrides, "output_dir": str(tmp_path / "fixed"), "train.micro_batch_size": 4}
    assert run.train(config.RunConfig().replace(**fixed)) == EXIT_OUT_OF_MEMORY


def test_the_setting_that_ran_out_reaches_the_store_for_a_replacement_machine(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-memory exit pushes the ledger row and the `auto` setting that ran out with the run
    files, so a new VM (an empty output_dir) skips that setting instead of running out again forever."""
    from trainer.model import objective  # the loop's SFT objective calls the loss there
    from trainer.restart.books.ledger import read_rows
    from trainer.restart.remote.run_files import fetch_run_files
    from trainer.restart.store.lifecycle import Store
    from trainer.training import run

    def nothing_fits(model: Any, micro: dict[str, Any]) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(objective, "token_loss_sum", nothing_fits)
    out = tmp_path / "vm1"
    overrides = _auto_run(out, tiny_llama, tiny_data) | {"checkpoint.remote": s3_remote}
    assert run.train(config.RunConfig().replace(**overrides)) == EXIT_OUT_OF_MEMORY  # 4 rows, then 2: both ran out
    first = autofit.read_ran_out(out)
    assert first is not None and first.micro_batch_size == 4
    vm2 = tmp_path / "vm2"  # the replacement machine's empty disk
    assert autofit.read_ran_out(vm2) is None  # the control: nothing local to go on
    fetched = fetch_run_files(Store(s3_remote), vm2)
    assert autofit.RAN_OUT_FILE in fetched and autofit.read_ran_out(vm2) == first
    assert [r["exit_reason"] for r in read_rows(vm2)] == ["out_of_memory", "out_of_memory"]
