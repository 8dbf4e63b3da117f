"""RNG capture/restore, optimizer flattening, TrainState JSON and the whole-checkpoint write/restore."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.restart.local import rng
from trainer.restart.local import state as S


def _draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.randn(2).tolist(),
        torch.rand(4).tolist(),
        torch.randint(0, 1000, (3,)).tolist(),
    )


def test_rng_round_trip_through_safetensors(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.randn()  # leave cached gaussians behind: they are state too
    saved = rng.capture_rng()
    assert saved["torch.cpu"].dtype == torch.uint8
    assert all(v.dtype in (torch.int64, torch.float64, torch.uint8) for v in saved.values())
    save_file(saved, tmp_path / "rng.safetensors")
    expected = _draws()
    _draws()  # move every generator on
    assert _draws() != expected  # control: the streams really moved
    rng.restore_rng(load_file(tmp_path / "rng.safetensors"))
    assert _draws() == expected


def test_gather_rng_single_process_prefixes_rank0() -> None:
    got = rng.gather_rng(1)
    assert set(got) == {f"rank0.{k}" for k in rng.capture_rng()}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(300, 40, generator=g)), torch.nn.Parameter(torch.randn(40, generator=g))]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "adamw_8bit"])
def test_optimizer_round_trip_is_exact(kind: str, tmp_path: Path) -> None:
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adamw_8bit":
            import bitsandbytes as bnb  # a runtime dependency: its absence is a failure, not a skip

            return bnb.optim.AdamW8bit(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, min_8bit_size=100)
        return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=kind == "adamw_fused")

    a = _params(0)
    opt_a = make(a)
    _train(opt_a, a, 3, seed=1)
    tensors, meta = S.optimizer_to_tensors(opt_a)
    save_file(tensors, tmp_path / "o.safetensors")
    (tmp_path / "o.json").write_text(json.dumps(meta))
    if kind == "adamw_8bit":
        assert any(t.dtype == torch.uint8 for t in tensors.values())

    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = make(b)
    S.optimizer_from_tensors(
        opt_b, load_file(tmp_path / "o.safetensors"), json.loads((tmp_path / "o.json").read_text())
    )
    assert opt_b.param_groups[0]["betas"] == (0.9, 0.95)  # tuples come back as tuples
    c = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_c = make(c)  # control: same weights, no optimizer state

    for opt, ps in ((opt_a, a), (opt_b, b), (opt_c, c)):
        _train(opt, ps, 3, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=False))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=False))


def test_changed_optimizer_settings_take_effect_on_resume(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = _params(0)
    opt_a = torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    _train(opt_a, a, 3, seed=1)
    tensors, meta = S.optimizer_to_tensors(opt_a)

    def resumed(**settings: object) -> torch.optim.Optimizer:
        opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in a], lr=1e-2, **settings)
        S.optimizer_from_tensors(opt, tensors, json.loads(json.dumps(meta)))
        return opt

    changed = resumed(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    group = changed.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.1)
    assert "weight_decay changed on resume, 0.0 -> 0.1" in caplog.text
    # The moments are the checkpoint's all the same.
    assert all(
        torch.equal(changed.state[p]["exp_avg"], opt_a.state[q]["exp_avg"])
        for p, q in zip(changed.state, a, strict=True)
    )
    # Control: the same settings restore the checkpoint's values and log nothing.
    caplog.clear()
    same = resumed(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).param_groups[0]
    assert (same["betas"], same["weight_decay"]) == ((0.9, 0.999), 0.0)
    assert "changed on resume" not in caplog.text


def test_optimizer_mismatch_is_a_clear_error() -> None:
    a = _params(0)
    opt = torch.optim.AdamW(a)
    _train(opt, a, 1, seed=0)
    tensors, meta = S.optimizer_to_tensors(opt)
    other = torch.optim.AdamW(_params(0)[:1])
    with pytest.raises(ValueError, match="does not fit this run's optimizer"):
        S.optimizer_from_tensors(other, tensors, meta)


def test_train_state_json_round_trip() -> None:
    st = S.TrainState(
        step=7,
        epoch=1,
        cursor=16,
        tokens=900,
        ledger={"device_seconds": 1.5},
        structural={"adapter.r": 8, "adapter.target_modules": ["all-linear"]},
        scaler={"betas": (0.9, 0.99)},  # a tuple inside: encoded and decoded back
        world_size=2,
    )
    back = S.TrainState.from_json(st.to_json())
    assert back == st
    assert {"torch", "transformers", "peft", "accelerate", "python"} <= set(back.versions)
    with pytest.raises(ValueError, match="unknown fields"):
        S.TrainState.from_json(json.dumps({**json.loads(st.to_json()), "bogus": 1}))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _peft(lora_seed: int) -> torch.nn.Module:
    """The same frozen base every time; the LoRA init depends on `lora_seed`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _Net()
    torch.manual_seed(lora_seed)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["up", "down"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft zero-inits B; random B makes a missed restore visible in the weights
            torch.nn.init.normal_(p)
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()  # dropout > 0: the loss depends on the torch RNG
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_write_and_restore_training_state(tmp_path: Path) -> None:
    model = _peft(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        _step(model, opt)
    scaler_state = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 3,
    }

    class Scaler:
        def __init__(self, sd: dict) -> None:
            self.sd = dict(sd)

        def state_dict(self) -> dict:
            return dict(self.sd)

        def load_state_dict(self, sd: dict) -> None:
            self.sd = dict(sd)

    ts = S.TrainState(step=3, epoch=0, cursor=24, tokens=120, world_size=1)
    S.write_training_state(
        tmp_path, model=model, optimizer=opt, state=ts, rng=rng.gather_rng(1), scaler=Scaler(scaler_state)
    )
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
        "optimizer.json",
        "rng.safetensors",
        "trainer_state.json",
    }
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in tmp_path.iterdir())
    weights_at_save = {k: v.clone() for k, v in model.state_dict().items()}
    expected = [_step(model, opt) for _ in range(3)]
    expected_weights = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = _peft(1)  # different LoRA init: restore must overwrite it
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(99)
    scaler = Scaler({})
    back = S.restore_training_state(tmp_path, model=fresh, optimizer=fresh_opt, rank=0, scaler=scaler)
    assert (back.step, back.cursor, back.tokens) == (3, 24, 120)
    assert scaler.sd == scaler_state
    got = [_step(fresh, fresh_opt) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=False))
    assert all(torch.equal(expected_weights[k], v) for k, v in fresh.state_dict().items())

    # The checkpoint's adapter is a plain PEFT adapter.
    from peft import PeftModel

    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(_Net(), str(tmp_path))
    differ = [k for k, v in loaded.state_dict().items() if not torch.equal(v, weights_at_save[k])]
    assert differ == [], differ

    # Control: restoring everything but the RNG gives other dropout masks, other losses.
    again = _peft(1)
    again_opt = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=1e-2)
    S.restore_training_state(tmp_path, model=again, optimizer=again_opt, rank=0)
    torch.manual_seed(1234)
    assert not all(torch.equal(a, _step(again, again_opt)) for a in expected[:1])


def test_state_written_by_0_1_still_loads() -> None:
    """0.1 wrote `scheduler` (always null) and `config_fingerprint` (never read): both are ignored."""
    old = json.loads(S.TrainState(step=4, tokens=9).to_json())
    old.update(scheduler=None, config_fingerprint="abc")
    back = S.TrainState.from_json(json.dumps(old))
    assert (back.step, back.tokens) == (4, 9)
    old["surprise"] = 1  # control: a field nobody knows is still refused
    with pytest.raises(ValueError, match="unknown fields"):
        S.TrainState.from_json(json.dumps(old))


def test_changed_world_size_reseeds_distinct_streams(tmp_path: Path) -> None:
    model = _peft(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    S.write_training_state(
        tmp_path, model=model, optimizer=opt, state=S.TrainState(world_size=1), rng=rng.gather_rng(1)
    )
    draws = []
    for rank in range(2):
        S.restore_training_state(tmp_path, model=model, optimizer=opt, rank=rank, world_size=2)
        draws.append(torch.rand(3))
    assert not torch.equal(draws[0], draws[1])
