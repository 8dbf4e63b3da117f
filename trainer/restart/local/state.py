"""Everything a resumed run needs, written without pickle and restored by one function.

`TrainState` holds the counters (step, sampler position, tokens, bad-step counters,
ledger totals), the fingerprints a resume is checked against and the library versions.
`snapshot` gathers the adapter and optimizer state as whole tensors (a collective under FSDP:
every rank takes part); `write_training_state` is the `write` callback of `CheckpointManager.save`;
`restore_training_state` is the single restore function: adapter weights, optimizer,
grad scaler and this rank's RNG, every field, unconditionally (the learning rate needs no
state: it is a pure function of the step).

Formats (tensors in safetensors, the rest JSON):
- `adapter_model.safetensors` + `adapter_config.json`: the PEFT adapter, loadable by peft.
- `optimizer.safetensors` (`state.<param_idx>.<name>`) + `optimizer.json` (non-tensor
  state values, param groups).
  Tensors are always whole (gathered from FSDP shards, cut again on restore), so a checkpoint
  resumes on any world size, sharded or not.
- `rng.safetensors`: every rank's generators (see trainer/restart/local/rng.py).
- `trainer_state.json`: `TrainState.to_json()`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.config import diff_structural
from trainer.model.distributed import full_tensor, is_sharded, shard_like
from trainer.model.wrappers import unwrap_peft
from trainer.restart.local.checkpoint import ResumeMismatch
from trainer.restart.local.rng import rank_rng, reseed, restore_rng

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"


_RETIRED_FIELDS = ("scheduler", "config_fingerprint")
"""Written by spotune 0.1 and never read (the LR is a pure function of the step; `structural`
is what a resume compares): ignored when an older checkpoint is read."""


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "accelerate", "safetensors", "datasets", "bitsandbytes"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


@dataclass
class Counters:
    """What the training loop advances, saved and restored as one unit (inside TrainState)."""

    step: int = 0
    """Optimizer steps completed (the next step to run has this 0-based index)."""
    tokens: int = 0
    """Trained tokens so far (non-padding tokens that carry a label)."""
    real_tokens: int = 0
    """Non-padding tokens seen so far, labelled or not (for throughput)."""
    skipped_steps: int = 0
    """Steps whose update was refused (non-finite loss or gradient)."""
    consecutive_bad_steps: int = 0
    """Refused steps in a row up to now; `train.max_bad_steps` stops the run."""

    def counters(self) -> Counters:
        """A copy of just the counters (also of a TrainState, which embeds them)."""
        return Counters(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Counters)})


@dataclass
class TrainState(Counters):
    """The counters plus identity of a run at the end of optimizer step `step`.

    The counters come first in the JSON as top-level keys (the on-disk format predates the
    split). `epoch` and `cursor` are recorded for audit; a resume derives both from `step`.
    """

    epoch: int = 0
    cursor: int = 0
    """Sampler position of the next step: rows of `epoch`'s order already consumed."""
    ledger: dict[str, Any] = field(default_factory=dict)
    """`Ledger.totals()` at save time, carried into the next attempt."""
    structural: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    seed: int = 0
    scaler: dict[str, Any] | None = None
    versions: dict[str, str] = field(default_factory=library_versions)
    trackers: dict[str, str] = field(default_factory=dict)
    """The run's tracker ids (W&B, MLflow): a machine resuming from this checkpoint continues those runs."""

    def to_json(self) -> str:
        return json.dumps(_encode(dataclasses.asdict(self), "trainer_state"), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainState:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("trainer_state.json: expected a JSON object")
        for legacy in _RETIRED_FIELDS:
            raw.pop(legacy, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"trainer_state.json: unknown fields {unknown} (written by a newer spotune?)")
        return cls(**_decode(raw))


# ---------------------------------------------------------------------------- JSON values


def _encode(value: Any, where: str) -> Any:
    """Plain JSON data; tuples are tagged so they come back as tuples (AdamW's betas)."""
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v, f"{where}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"{where}: cannot store {type(value).__name__} as JSON in a checkpoint")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- optimizer


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten `optimizer.state_dict()`: tensors keyed `state.<param_idx>.<name>`, the rest JSON.

    Nested dicts (bitsandbytes 8-bit keeps its quantisation state in
    `__bnb_optimizer_quant_state__`) flatten to `state.<idx>.<name>.<sub>`. A tensor that
    shares storage with one already stored (bitsandbytes' shared quantisation maps) is
    copied, since safetensors refuses aliased tensors. FSDP-sharded state is gathered whole:
    then every rank must call this (the walk below takes the same order on every rank).
    """
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def flatten(value: Any, key: str) -> dict[str, Any]:
        if torch.is_tensor(value):
            t = full_tensor(value.detach()).to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen and t.numel():
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[key] = t
            return {"tensor": key}
        if isinstance(value, dict) and any(torch.is_tensor(v) or isinstance(v, dict) for v in value.values()):
            return {"dict": {str(k): flatten(v, f"{key}.{k}") for k, v in value.items()}}
        return {"value": _encode(value, f"optimizer {key}")}

    # Parameter-index order, the same on every rank: under FSDP each tensor is gathered by a collective.
    order = sorted(sd["state"].items(), key=lambda item: (0, item[0]) if isinstance(item[0], int) else (1, 0))
    state_meta = {str(idx): flatten(entries, f"state.{idx}")["dict"] if entries else {} for idx, entries in order}
    groups = [
        {name: flatten(v, f"group.{gi}.{name}") for name, v in group.items()}
        for gi, group in enumerate(sd["param_groups"])
    ]
    meta = {"format": 1, "class": type(optimizer).__name__, "state": state_meta, "param_groups": groups}
    return tensors, meta


def optimizer_from_tensors(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Load what `optimizer_to_tensors` produced; torch moves state to each parameter's device.
    The state of an FSDP-sharded parameter is cut to this rank's shard first."""

    def value(entry: dict[str, Any]) -> Any:
        if "tensor" in entry:
            return tensors[entry["tensor"]]
        if "dict" in entry:
            return {k: value(e) for k, e in entry["dict"].items()}
        return _decode(entry["value"])

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def like_param(idx: int | str, v: Any) -> Any:
        if isinstance(idx, int) and 0 <= idx < len(params) and torch.is_tensor(v) and v.dim() > 0:
            return shard_like(v, params[idx])
        return v

    state = {}
    for idx, slot in meta["state"].items():
        key = int(idx) if idx.lstrip("-").isdigit() else idx
        state[key] = {name: like_param(key, value(e)) for name, e in slot.items()}
    groups = [{name: value(e) for name, e in g.items()} for g in meta["param_groups"]]
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"the checkpoint's optimizer state ({meta.get('class')}) does not fit this run's optimizer "
            f"({type(optimizer).__name__}): {e}"
        ) from e
    _keep_configured_settings(optimizer, configured)


def _keep_configured_settings(optimizer: torch.optim.Optimizer, configured: list[dict[str, Any]]) -> None:
    """The run's own optimizer settings win over the checkpoint's.

    `load_state_dict` also restores each group's settings, so a recipe's new betas, eps or weight
    decay would be silently replaced by the values the checkpoint was trained with. The moments
    and step counts are state and stay; settings are the recipe's, like the lr the loop sets
    every step. Unchanged settings are equal values, so an unchanged resume stays bit-identical."""
    for gi, (group, mine) in enumerate(zip(optimizer.param_groups, configured, strict=True)):
        for key, v in mine.items():
            if key != "lr" and group.get(key) != v:
                log.warning(
                    "optimizer group %d: %s changed on resume, %r -> %r (the run's value is used)",
                    gi,
                    key,
                    group.get(key),
                    v,
                )
            group[key] = v


# ---------------------------------------------------------------------------- whole checkpoint


@dataclass
class Snapshot:
    """A checkpoint's tensors, whole and on the CPU, ready for rank 0 to write."""

    adapter: dict[str, torch.Tensor]
    """Keyed like `peft_model.state_dict()`: the tensors peft's own selection picks for the adapter."""
    optimizer: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors (those peft's `save_pretrained` writes), whole and on the CPU, keyed
    like `state_dict()`. Collective under FSDP: every rank calls it.

    peft picks its tensors out of a state dict without copying them, so the keys it picked are
    found by identity and only those are gathered, never the frozen base.
    """
    from peft.utils import get_peft_model_state_dict

    peft_model = unwrap_peft(model)
    sd = peft_model.state_dict()  # under FSDP: this rank's shards, no communication
    picked = get_peft_model_state_dict(peft_model, state_dict=sd, adapter_name=peft_model.active_adapter)
    picked_ids = {id(v) for v in picked.values()}
    keys = [k for k, v in sd.items() if id(v) in picked_ids]
    if len(keys) != len(picked):
        raise RuntimeError("peft copied the adapter tensors it selected; cannot tell which state_dict keys to save")
    return {k: full_tensor(sd[k]).to("cpu").contiguous() for k in keys}


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep: bool = True) -> Snapshot | None:
    """The adapter and optimizer state as whole CPU tensors. Under FSDP a collective: every rank
    calls it and the ranks that do not `keep` get None; unsharded, those ranks skip the work."""
    if not keep and not is_sharded(model):
        return None
    adapter = adapter_state(model)
    tensors, meta = optimizer_to_tensors(optimizer)
    return Snapshot(adapter, tensors, meta) if keep else None


def write_training_state(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    rng: dict[str, torch.Tensor],
    scaler: Any = None,
    tensors: Snapshot | None = None,
) -> None:
    """Write a complete checkpoint into `directory` (the temp dir of `CheckpointManager.save`).

    `tensors`: the `snapshot` every rank took together (FSDP); taken here when not given.
    """
    from peft.utils import get_peft_model_state_dict

    directory = Path(directory)
    peft_model = unwrap_peft(model)
    name = peft_model.active_adapter
    whole = tensors or snapshot(model, optimizer)
    assert whole is not None  # keep=True always returns one
    adapter = get_peft_model_state_dict(peft_model, state_dict=whole.adapter, adapter_name=name)
    save_file(adapter, directory / ADAPTER_FILE, metadata={"format": "pt"})
    peft_model.peft_config[name].save_pretrained(str(directory))  # adapter_config.json

    save_file(whole.optimizer, directory / OPTIMIZER_FILE)
    (directory / OPTIMIZER_META).write_text(json.dumps(whole.optimizer_meta, indent=1))
    save_file({k: v.contiguous() for k, v in rng.items()}, directory / RNG_FILE)

    state.scaler = _encode(scaler.state_dict(), "grad scaler") if scaler is not None else None
    (directory / STATE_FILE).write_text(state.to_json())


def restore_training_state(
    directory: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int | None = None,
    scaler: Any = None,
) -> TrainState:
    """Restore every piece of a checkpoint into the live objects and return its TrainState.

    Call after the model, optimizer and sampler exist and right before the first
    step: the RNG is restored last so nothing built afterwards shifts the random streams.
    """
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    directory = Path(directory)
    state = TrainState.from_json((directory / STATE_FILE).read_text())
    world = state.world_size if world_size is None else world_size

    peft_model = unwrap_peft(model)
    name = peft_model.active_adapter
    adapter = load_file(directory / ADAPTER_FILE)
    live = get_peft_model_state_dict(peft_model, adapter_name=name)  # under FSDP: shards to cut the file like
    adapter = {k: shard_like(v, live[k]) if k in live else v for k, v in adapter.items()}
    result = set_peft_model_state_dict(peft_model, adapter, adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []))  # peft types the result loosely
    if unexpected:
        raise ValueError(f"{directory / ADAPTER_FILE}: tensors this model does not have: {unexpected[:5]}")

    optimizer_from_tensors(
        optimizer, load_file(directory / OPTIMIZER_FILE), json.loads((directory / OPTIMIZER_META).read_text())
    )

    if scaler is not None and state.scaler:
        scaler.load_state_dict(_decode(state.scaler))
    elif state.scaler and scaler is None:
        log.warning("%s holds grad-scaler state but this run uses no scaler; ignored", directory)

    mine = rank_rng(load_file(directory / RNG_FILE), rank, state.world_size, world)
    if mine is None:
        log.warning(
            "checkpoint was written by %d processes, this run has %d: random streams are reseeded "
            "from (seed, step, rank), so this resume is not bitwise identical",
            state.world_size,
            world,
        )
        reseed(state.seed, state.step, rank)
    else:
        restore_rng(mine)
    return state


def check_compatible(
    saved_state: Any, current_structural: dict[str, Any], data_fingerprint: str, allow: bool
) -> list[str]:
    """Differences between the checkpoint's run and this one; raises ResumeMismatch unless `allow`.

    `saved_state` is a TrainState (or its dict). Run-length settings (max_steps, intervals,
    budgets) are not structural and may change freely.
    """
    get = saved_state.get if isinstance(saved_state, dict) else lambda k: getattr(saved_state, k)
    diff = diff_structural(get("structural") or {}, current_structural)
    if get("data_fingerprint") != data_fingerprint:
        diff.append(
            f"dataset fingerprint: {get('data_fingerprint')!r} -> {data_fingerprint!r} (the prepared data changed)"
        )
    if diff and not allow:
        raise ResumeMismatch(
            "the checkpoint was written by a different run:\n  " + "\n  ".join(diff) + "\nUndo the change, "
            "use a new output_dir (or checkpoint.resume=never) to start over, or set "
            "checkpoint.allow_config_change=true to resume anyway."
        )
    return diff
