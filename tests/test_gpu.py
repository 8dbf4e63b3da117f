"""What only a CUDA machine can show (`pytest -m gpu`, part of `make gpu-check`); skipped elsewhere.

The CPU suite runs the same code paths with CPU kernels; these check the CUDA kernels and the
CUDA-only settings: Liger's fused linear cross-entropy in bf16, a QLoRA (bitsandbytes NF4)
step, NVML utilisation, and SIGTERM -> save -> resume with the loader worker CUDA uses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from trainer import exit_codes as E
from trainer.training import metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
REPO = Path(__file__).resolve().parents[1]


def test_fused_linear_cross_entropy_equals_the_plain_computation_in_bf16() -> None:
    from trainer.model import loss

    if loss._liger() is None:
        pytest.skip("liger-kernel is not installed (pip install 'spotune[gpu]')")
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(3000, 512, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(32000, 512, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, 32000, (3000,), device="cuda", generator=g)
    targets[::7] = -100
    fused = loss.linear_cross_entropy(hidden, weight, targets)
    (fused_grad,) = torch.autograd.grad(fused, hidden)
    plain = torch.nn.functional.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    (plain_grad,) = torch.autograd.grad(plain, hidden)
    torch.testing.assert_close(fused, plain, rtol=2e-3, atol=1e-2)
    torch.testing.assert_close(fused_grad.float(), plain_grad.float(), rtol=2e-2, atol=2e-3)
    shifted = loss.linear_cross_entropy(hidden, weight, targets.roll(1))  # control: other targets differ
    assert not torch.allclose(shifted, plain, rtol=1e-2)


def test_a_qlora_step_trains_and_the_base_stays_4_bit(tiny_llama: Path) -> None:
    pytest.importorskip("bitsandbytes")
    from trainer.config import AdapterConfig, ModelConfig
    from trainer.model.load import build
    from trainer.model.loss import token_loss_sum
    from trainer.training import batches

    model = build(
        ModelConfig(dtype="bfloat16"),
        AdapterConfig(method="qlora", r=8, alpha=16),
        name_or_path=str(tiny_llama),
        device=torch.device("cuda"),
        autocast=True,
    )
    assert any("4bit" in type(m).__name__ for m in model.modules())
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(4, model.config.vocab_size, (2, 64))
    micro = batches.to_device(batches.micro_batch(ids, ids.clone(), torch.arange(64).expand(2, 64)), "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = token_loss_sum(model, micro)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_nvml_utilisation_is_reported() -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (pip install 'spotune[gpu]')")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        x = x @ x.T / 4096
    torch.cuda.synchronize()
    util = metrics.gpu_utilisation()
    assert util is not None and 0.0 <= util <= 100.0


def test_sigterm_saves_and_the_same_command_resumes_on_cuda(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    """With `data.loader_workers: auto` (one worker on CUDA): 143 after a save, then the same command ends 0."""
    recipe = tmp_path / "recipe.yaml"
    out = tmp_path / "run"
    recipe.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(out),
                "model": {"name_or_path": str(tiny_llama), "dtype": "bfloat16"},
                "data": {"path": str(tiny_data), "seq_len": 256},
                "train": {"max_steps": 300, "micro_batch_size": 2, "mixed_precision": "bf16"},
                "checkpoint": {"every_steps": 50, "every_minutes": None},
                "metrics": {"progress": False, "log_every": 1},
            }
        )
    )
    cmd = [sys.executable, "-m", "trainer", "train", str(recipe)]
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or '"loss"' not in (out / "metrics.jsonl").read_text():
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == E.EXIT_PREEMPTED, (tmp_path / "first.log").read_text()
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=os.environ)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout + second.stderr
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["exit_reason"] for r in rows] == ["preempted", "finished"]
    assert (out / "final" / "adapter_model.safetensors").is_file()
