"""FSDP2 (`train.distributed=fsdp`): sharded training equals one process, and its checkpoints
keep the one on-disk contract, so a run moves between FSDP and DDP on any world size. With
`model.activation_offload=on` it ends bit-identical to the same FSDP run without it
(offloading moves values, never changes them).

On CPU, two gloo ranks started by torchrun run the very path a GPU run takes (spotune calls
`fully_shard` itself; trainer/model/distributed.py). What needs CUDA (bitsandbytes 4-bit weights
stored in bf16 shards, CPU offload beside NCCL) is marked `gpu` and skips without one.
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import warm_start
from safetensors.torch import load_file

from trainer import config as C
from trainer.model import distributed
from trainer.model.load import peft_wrapping, quantization_config
from trainer.training import run

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # of the largest weight: tests/test_elastic.py's bound for fp32 summation order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _overrides(model: Path, data: Path, cache: Path, out: Path, steps: int, **extra: Any) -> dict[str, Any]:
    o: dict[str, Any] = {
        "output_dir": str(out),
        "model.name_or_path": str(model),
        "model.dtype": "float32",
        "adapter.dropout": 0.0,  # dropout masks are drawn per rank: no match across world sizes
        "data.path": str(data),
        "data.seq_len": 128,
        "data.cache_dir": str(cache),
        "train.max_steps": steps,
        "train.global_batch_size": 4,  # two micro-batches per rank on two ranks: no_sync is exercised
        "train.micro_batch_size": 1,
        "train.lr": 1e-3,
        "train.schedule": "constant",  # a run stopped at max_steps=2 and resumed to 6 sees the same lr
        "train.adam_eps": 1e-6,  # as tests/test_ddp.py: no +/-lr steps out of gradients that are rounding noise
        "metrics.progress": False,
        "metrics.report": False,
        "checkpoint.every_steps": 1,
        "checkpoint.every_minutes": None,
        "checkpoint.keep_last": 10,
    }
    o.update(extra)
    return o


def _one_process(overrides: dict[str, Any]) -> None:
    assert run.train(C.RunConfig().replace(**overrides)) == 0


def _torchrun(overrides: dict[str, Any], log: Path, ranks: int = 2, first_on_path: Path | None = None) -> str:
    """`first_on_path`: a folder put before the repository on PYTHONPATH (a test's sitecustomize.py)."""
    args = [f"{k}={'null' if v is None else v}" for k, v in overrides.items()]
    # Extends PYTHONPATH: packages installed with --target (the GPU check's carried wheels) stay importable.
    front = [str(first_on_path)] if first_on_path is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if front:  # else the ranks find the repository as their working directory
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*front, str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [
        "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        "-m", "trainer", "train", *args,
    ]  # fmt: skip
    # The launcher and its ranks forked from the warm forkserver (tests/warm_start.py).
    done = warm_start.start(cmd, log, env=env, module="torch.distributed.run").wait(timeout=300)
    said = log.read_text()
    assert done == 0, said[-4000:]
    return said


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:06d}"


def _relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the largest weight (the elastic tests' measure)."""
    assert a.keys() == b.keys()
    scale = max(float(t.abs().max()) for t in b.values())
    return max(float((a[k] - b[k]).abs().max()) for k in b) / scale


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "adapter_model.safetensors")


def _rows(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


SHARDED = {"train.distributed": "fsdp", "model.gradient_checkpointing": True}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, tiny_data: Path) -> tuple[Path, str]:
    """Two FSDP ranks (activation checkpointing on), 2 steps, a checkpoint each: (its directory, its log).
    Shared: the first leg of the move across DDP, and the run activation offloading must equal. Only its
    checkpoints of steps 1-2 and rows of steps 1-2 are read, which the move's later legs leave as they are."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out = tmp / "moved"
    log = _torchrun(_overrides(tiny_llama, tiny_data, tmp / "cache", out, 2, **SHARDED), tmp / "fsdp-a.log")
    return out, log


@pytest.mark.slow
def test_fsdp_matches_one_process_and_resumes_across_ddp(
    tmp_path: Path,
    tiny_llama: Path,
    tiny_data: Path,
    fsdp_run: tuple[Path, str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FSDP on 2 ranks (activation checkpointing on) -> one process (DDP's path) -> FSDP on 2 ranks
    (CPU offload on) against one uninterrupted process: the same steps, the same adapter."""
    out, log = fsdp_run
    cache = out.parent / "cache"  # prepared by the FSDP ranks: the reference reads the same rows
    ref = tmp_path / "reference"
    _one_process(_overrides(tiny_llama, tiny_data, cache, ref, 6))
    assert "FSDP: sharding over 2 processes" in log

    # 1. Two FSDP ranks train the steps one process trains (checkpoint of step 2 against step 2).
    gap = _relative_gap(_adapter(_step(out, 2)), _adapter(_step(ref, 2)))
    control = _relative_gap(_adapter(_step(ref, 1)), _adapter(_step(ref, 2)))  # one step less: must fail
    with capsys.disabled():  # the measured numbers, for the record (pytest -s)
        print(f"\nfsdp(2) vs one process at step 2: {gap:.3g}; control (step 1 vs 2): {control:.3g}")
    assert gap <= TOLERANCE < control
    for step in (1, 2):
        a, b = _rows(out)[step], _rows(ref)[step]
        assert a["sample_digest"] == b["sample_digest"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"]

    # 2. The FSDP checkpoint holds whole tensors in DDP's format: plain peft loads the adapter,
    # and the optimizer files match the unsharded run's key for key, shape for shape.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ck, ref_ck = _step(out, 2), _step(ref, 2)
    with peft_wrapping():  # peft's own FutureWarning about transformers' renamed attribute
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), str(ck))
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(lora) == len(_adapter(ck)) > 0
    assert {k: v.shape for k, v in _adapter(ck).items()} == {k: v.shape for k, v in _adapter(ref_ck).items()}
    opt, ref_opt = load_file(ck / "optimizer.safetensors"), load_file(ref_ck / "optimizer.safetensors")
    assert {k: v.shape for k, v in opt.items()} == {k: v.shape for k, v in ref_opt.items()}
    assert json.loads((ck / "optimizer.json").read_text()) == json.loads((ref_ck / "optimizer.json").read_text())
    assert _relative_gap(opt, ref_opt) <= TOLERANCE

    # 3. One process resumes the FSDP checkpoint, then two FSDP ranks resume that one.
    capsys.readouterr()
    _one_process(_overrides(tiny_llama, tiny_data, cache, out, 4))
    assert f"resuming from {_step(out, 2)}" in capsys.readouterr().err
    log = _torchrun(
        _overrides(
            tiny_llama, tiny_data, cache, out, 6, **{"train.distributed": "fsdp", "train.fsdp_cpu_offload": True}
        ),
        tmp_path / "fsdp-b.log",
    )
    assert f"resuming from {_step(out, 4)}" in log and "shards kept in CPU memory" in log
    assert {s: r["sample_digest"] for s, r in _rows(out).items()} == {
        s: r["sample_digest"] for s, r in _rows(ref).items()
    }
    gap = _relative_gap(_adapter(out / "final"), _adapter(ref / "final"))
    control = _relative_gap(_adapter(_step(ref, 5)), _adapter(ref / "final"))
    with capsys.disabled():
        print(f"\nfsdp(2) -> 1 -> fsdp(2) vs one process at step 6: {gap:.3g}; control (step 5 vs 6): {control:.3g}")
    assert gap <= TOLERANCE < control


# Test-only: every rank appends the bytes each forward moved to host memory, so the test knows
# that offloading happened under FSDP (an equality of two runs that both skipped it proves nothing).
SITECUSTOMIZE = """
import os
from trainer.model import offload

_exit = offload.ActivationOffload.exit

def exit(self):
    if self._hooks is not None:
        with open(os.path.join(os.environ["OFFLOAD_LOG"], "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(f"{self.offloaded_bytes}\\n")
    _exit(self)

offload.ActivationOffload.exit = exit
"""


@pytest.mark.slow
def test_fsdp_with_activation_offload_matches_fsdp_without(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, fsdp_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, _ = fsdp_run  # the same settings, without offloading
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    (tmp_path / "moved").mkdir()
    monkeypatch.setenv("OFFLOAD_LOG", str(tmp_path / "moved"))
    offloaded = tmp_path / "offloaded"
    log = _torchrun(
        # quoted: YAML reads a bare `on` as true
        _overrides(
            tiny_llama,
            tiny_data,
            plain.parent / "cache",
            offloaded,
            2,
            **SHARDED,
            **{"model.activation_offload": "'on'"},
        ),
        tmp_path / "offloaded.log",
        first_on_path=tmp_path / "inject",
    )
    assert "activation offloading on" in log and "FSDP: sharding over 2 processes" in log
    for rank in ("rank0", "rank1"):  # every training forward of every rank moved its layer inputs
        moved = [int(x) for x in (tmp_path / "moved" / rank).read_text().split()]
        assert len(moved) >= 4 and min(moved) > 0, moved
    assert sorted(_rows(offloaded)) == [1, 2]
    assert [r["loss"] for r in _rows(offloaded).values()] == [_rows(plain)[s]["loss"] for s in (1, 2)]
    a, b = _adapter(_step(offloaded, 2)), _adapter(_step(plain, 2))  # the last step of both
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Control: the comparison sees one step's difference.
    one = _adapter(_step(plain, 1))
    assert not all(torch.equal(one[k], b[k]) for k in b)


def test_the_gathered_adapter_is_what_peft_saves(tmp_path: Path, tiny_llama: Path) -> None:
    """Checkpoints and final/ pick the adapter's tensors through peft's own selection (gathered
    whole under FSDP): exactly the trainable LoRA tensors, none of the frozen base."""
    from peft.utils import get_peft_model_state_dict

    from trainer.model.load import build
    from trainer.restart.local.state import adapter_state

    model = build(C.ModelConfig(dtype="float32"), C.AdapterConfig(), name_or_path=str(tiny_llama))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in trainable:
            p.normal_()  # lora_B starts at zero; any value will do
    picked = adapter_state(model)
    assert len(picked) == len(trainable) and all("lora_" in k for k in picked)
    model.save_pretrained(str(tmp_path / "peft"), safe_serialization=True)
    saved = _adapter(tmp_path / "peft")
    ours = get_peft_model_state_dict(model, state_dict=picked)
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)


# ---------------------------------------------------------------------------- configuration


def _cfg(**dotted: Any) -> C.RunConfig:
    return C.RunConfig().replace(**dotted)


@pytest.mark.parametrize(
    ("dotted", "names"),
    [
        ({"adapter.method": "qlora", "adapter.quant_bits": 8}, ["adapter.quant_bits", "adapter.quant_bits=4"]),
        ({"train.optimizer": "paged_adamw_8bit"}, ["train.optimizer", "train.optimizer=adamw"]),
        ({"train.mixed_precision": "fp16", "model.dtype": "float16"}, ["train.mixed_precision", "=bf16"]),
    ],
)
def test_fsdp_refuses_what_it_cannot_shard(dotted: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(C.ConfigError) as e:
        _cfg(**{"train.distributed": "fsdp", **dotted})
    assert all(n in str(e.value) for n in names) and "train.distributed=ddp" in str(e.value)
    _cfg(**dotted)  # control: the same settings are fine under DDP


def test_cpu_offload_needs_fsdp() -> None:
    with pytest.raises(C.ConfigError, match=r"train.fsdp_cpu_offload: .* set train.distributed=fsdp"):
        _cfg(**{"train.fsdp_cpu_offload": True})
    assert _cfg(**{"train.distributed": "fsdp", "train.fsdp_cpu_offload": True}).train.fsdp_cpu_offload
    with pytest.raises(C.ConfigError, match="one of 'ddp', 'fsdp'"):
        _cfg(**{"train.distributed": "deepspeed"})


def test_fsdp_names_the_torch_it_needs() -> None:
    with pytest.raises(C.ConfigError, match=r"torch>=2\.6 .* this is torch 2\.5\.1.* train\.distributed=ddp"):
        distributed.require_fsdp_torch("2.5.1")
    for fine in ("2.6.0", "2.13.0+cpu", "3.0.0a0"):
        distributed.require_fsdp_torch(fine)


def test_qlora_under_fsdp_stores_4bit_weights_in_the_compute_dtype() -> None:
    adapter = C.AdapterConfig(method="qlora", quant_bits=4)
    sharded = quantization_config(adapter, torch.bfloat16, sharded=True)
    assert sharded.load_in_4bit and sharded.bnb_4bit_quant_storage == torch.bfloat16
    assert sharded.bnb_4bit_compute_dtype == torch.bfloat16 and sharded.bnb_4bit_quant_type == "nf4"
    assert quantization_config(adapter, torch.bfloat16, sharded=False).bnb_4bit_quant_storage == torch.uint8
    assert quantization_config(
        C.AdapterConfig(method="qlora", quant_bits=8), torch.bfloat16, sharded=False
    ).load_in_8bit


def _accelerator(kind: Any, plugin: Any = None) -> Any:
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))


def test_an_accelerate_fsdp_config_selects_fsdp(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = SimpleNamespace(cpu_offload=CPUOffloadPolicy(), activation_checkpointing=True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    got = distributed.choose("ddp", False, _accelerator(DistributedType.FSDP, plugin))
    assert (got.fsdp, got.cpu_offload, got.activation_checkpointing) == (True, True, True)
    assert any("accelerate is configured for FSDP" in n for n in got.notes)
    assert distributed.choose("ddp", False, _accelerator(DistributedType.MULTI_GPU)) == distributed.Sharding()
    with pytest.raises(C.ConfigError, match="DEEPSPEED"):
        distributed.choose("ddp", False, _accelerator(DistributedType.DEEPSPEED))


def test_fsdp_on_one_process_without_a_group_trains_unsharded(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.utils import DistributedType

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    got = distributed.choose("fsdp", True, _accelerator(DistributedType.NO))
    assert not got.fsdp and "nothing to shard" in got.notes[0]
    assert distributed.process_group_backend("fsdp", True, cuda=True) == "cuda:nccl,cpu:gloo"
    assert distributed.process_group_backend("fsdp", False, cuda=True) is None


# ---------------------------------------------------------------------------- on a CUDA machine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qlora_under_fsdp_on_cuda(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4-bit base sharded in bf16 storage (with CPU offload), resumed by an unsharded QLoRA run:
    the checkpoint is whole, plain peft loads it, and both runs train (finite losses)."""
    ranks = min(2, torch.cuda.device_count())
    qlora = {"adapter.method": "qlora", "model.dtype": "bfloat16", "train.mixed_precision": "bf16"}
    out = tmp_path / "qlora"
    sharded = {**qlora, "train.distributed": "fsdp", "train.fsdp_cpu_offload": True}
    log = _torchrun(_overrides(tiny_llama, tiny_data, tmp_path / "c", out, 2, **sharded), tmp_path / "a.log", ranks)
    assert f"FSDP: sharding over {ranks} process" in log
    capsys.readouterr()
    _one_process(_overrides(tiny_llama, tiny_data, tmp_path / "c", out, 3, **qlora))
    assert f"resuming from {_step(out, 2)}" in capsys.readouterr().err
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with peft_wrapping():
        PeftModel.from_pretrained(base, str(_step(out, 2)))  # whole shapes, or peft refuses the sizes
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in _rows(out).values())
    assert sorted(_rows(out)) == [1, 2, 3]
