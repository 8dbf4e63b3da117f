"""Where a run's adapter starts (`adapter.init_from`), and the DPO reference, which costs no second model.

The reference of `train.objective: dpo` is the run's starting point: the base with adapters disabled
(peft's `disable_adapter()`) for a fresh adapter, whose LoRA B is zero, so policy == reference until the
first update; or, when the adapter starts from an earlier one (usually the SFT run), that adapter frozen
as a second peft adapter, `reference`, beside the trained `default` (a copy of it at step 0).
`reference_forward` switches the model to it for one forward under no_grad, in the same step, and back.

What must stay true: outside `reference_forward` the active adapter is `default`, the only one with
trainable parameters, the one every checkpoint and `final/` save (restart/local/state.py and export.py read
the active adapter). The reference adapter has dropout 0 and is loaded from `init_from` on every start,
never from a checkpoint: its content is part of the run's structural fingerprint (run.py), so a resume
against another starting adapter is refused.

The starting adapter is the run's own: on its first start it is copied into the run directory
(`INIT_DIR`, with `SOURCE_FILE` saying where from and on which base) and into `checkpoint.remote`, and every
restart reads that copy (trainer/training/inputs.py), so a fresh machine resumes a run whose `init_from`
path it cannot reach, or that has since changed. An adapter trained on another base model or revision
than `model.*` is refused, both named: the same shape does not make it the same function.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from trainer.atomic import fsync_tree, publish_dir, temp_sibling
from trainer.config import AdapterConfig, ConfigError
from trainer.model.wrappers import unwrap_peft

REFERENCE = "reference"
"""The frozen starting adapter's name beside peft's trained `default`."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
INIT_DIR = "init_adapter"
"""The run's copy of `adapter.init_from`, in its directory and under `checkpoint.remote`."""
SOURCE_FILE = "source.json"
"""Beside the copy: the `init_from` it was copied from and the base model (and revision) it was trained on."""
INIT_FILES = tuple(f"{INIT_DIR}/{name}" for name in (CONFIG_FILE, WEIGHTS_FILE, SOURCE_FILE))
"""The copy's files, as the run directory and the store name them (the source last: it marks a whole copy)."""


@dataclass(frozen=True)
class InitAdapter:
    """An adapter folder to start from, and whether it is also the (frozen) DPO reference."""

    path: Path
    reference: bool = False

    @property
    def digest(self) -> str:
        """sha256 of its weights file: what a resume must find again."""
        h = hashlib.sha256()
        with open(self.path / WEIGHTS_FILE, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()


def locate(init_from: str) -> Path:
    """The adapter folder `adapter.init_from` names: the folder itself (an adapter, or a run's checkpoint
    step), or a run directory's `final/`."""
    path = Path(init_from).expanduser()
    for candidate in (path, path / "final"):
        if (candidate / CONFIG_FILE).is_file() and (candidate / WEIGHTS_FILE).is_file():
            return candidate
    hint = (
        f"; the run has not finished: point at one of its checkpoints, e.g. {path / 'checkpoints' / 'step-000100'}"
        if (path / "checkpoints").is_dir()
        else ""
    )
    raise ConfigError(
        [
            f"adapter.init_from: no adapter ({CONFIG_FILE} + {WEIGHTS_FILE}) in {path} or {path / 'final'}{hint}; "
            "give a finished run's directory or an adapter folder"
        ]
    )


def kept_from(kept: Path) -> str | None:
    """The `init_from` a whole copy at `kept` was made from; None when there is none (or a torn one)."""
    try:
        source = json.loads((kept / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    whole = (kept / CONFIG_FILE).is_file() and (kept / WEIGHTS_FILE).is_file()
    return source.get("init_from") if whole and isinstance(source, dict) else None


def keep_copy(init_from: str, kept: Path) -> Path:
    """Copy the adapter `init_from` names into `kept` (atomically: a kill leaves the old copy or the new
    one), with where it came from and the base it was trained on (`trained_on`); returns `kept`."""
    located = locate(init_from)
    tmp = temp_sibling(kept, "copy")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(located / name, tmp / name)
    source = {"init_from": init_from, "copied_from": str(located), **trained_on(located)}
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
    fsync_tree(tmp)
    publish_dir(tmp, kept)
    return kept


def trained_on(adapter: Path) -> dict[str, Any]:
    """The base model and revision `adapter` was trained on, and what says so: the spotune run's config
    (a checkpoint's trainer_state.json, or config.yaml of the run whose final/ or checkpoint it is), else
    peft's adapter_config.json (`base_model_name_or_path`, `revision`: a revision it does not record is
    not checked)."""
    state, run_yaml = adapter / "trainer_state.json", adapter.parent / "config.yaml"
    model: Any = None
    try:
        if state.is_file():  # a checkpoint: the config it was written under
            model, said_by = json.loads(state.read_text())["config"]["model"], state
        elif run_yaml.is_file():  # a run's final/
            model, said_by = (yaml.safe_load(run_yaml.read_text()) or {}).get("model"), run_yaml
    except (ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        model = None  # unreadable: peft's record below
    if isinstance(model, dict) and model.get("name_or_path"):
        return {"base_model": model["name_or_path"], "revision": model.get("revision"), "said_by": str(said_by)}
    saved = json.loads((adapter / CONFIG_FILE).read_text())
    return {
        "base_model": saved.get("base_model_name_or_path"),
        "revision": saved.get("revision"),
        "revision_known": saved.get("revision") is not None,
        "said_by": str(adapter / CONFIG_FILE),
    }


def check_base(source: dict[str, Any], name_or_path: str, resolved: str, revision: str | None) -> None:
    """Refuse a starting adapter trained on another base than `model.name_or_path` (`resolved`: where it
    loads from) at `model.revision`, naming both: LoRA weights of one base are noise on another of the
    same shape."""
    theirs = source.get("base_model")
    where = source.get("said_by", SOURCE_FILE)
    problems = []
    if theirs and not _same_model(str(theirs), name_or_path, resolved):
        problems.append(
            f"adapter.init_from: the adapter was trained on {theirs!r} ({where}), this run's model.name_or_path is "
            f"{name_or_path!r}; set model.name_or_path={theirs} or start from an adapter trained on {name_or_path}"
        )
    elif source.get("revision_known", True) and (source.get("revision") or "main") != (revision or "main"):
        problems.append(
            f"adapter.init_from: the adapter was trained on {theirs!r} at revision {source.get('revision') or 'main'!r} "
            f"({where}), this run's model.revision is {revision or 'main'!r}; set model.revision="
            f"{source.get('revision') or 'main'} or start from an adapter trained on that revision"
        )
    if problems:
        raise ConfigError(problems)


def _same_model(theirs: str, name_or_path: str, resolved: str) -> bool:
    """The same model named two ways: the same id (or built-in name), the folder it resolves to, or two
    spellings of one local folder."""
    if theirs in (name_or_path, resolved):
        return True
    mine, other = Path(resolved).expanduser(), Path(theirs).expanduser()
    return mine.exists() and other.exists() and mine.resolve() == other.resolve()


def load_init(model: torch.nn.Module, init: InitAdapter, adapter: AdapterConfig) -> None:
    """Copy `init`'s weights into the trained `default` adapter of `model` (a fresh PeftModel of the
    recipe's LoRA shape) and, with `init.reference`, add them again as the frozen `reference` adapter."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = json.loads((init.path / CONFIG_FILE).read_text())
    _check_config(saved, adapter, init.path)
    weights = load_file(init.path / WEIGHTS_FILE)
    peft_model = unwrap_peft(model)
    live = get_peft_model_state_dict(peft_model, adapter_name="default")
    _check_weights(weights, live, init.path)
    set_peft_model_state_dict(peft_model, weights, adapter_name="default")
    if not init.reference:
        return
    default = peft_model.peft_config["default"]
    frozen = LoraConfig(
        r=default.r,
        lora_alpha=default.lora_alpha,
        lora_dropout=0.0,  # the reference is a function of the input alone
        target_modules=default.target_modules,
        target_parameters=default.target_parameters,  # a mixture of experts' expert Parameters (peft: the same set)
        exclude_modules=default.exclude_modules,
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=True,
    )
    peft_model.add_adapter(REFERENCE, frozen)
    set_peft_model_state_dict(peft_model, weights, adapter_name=REFERENCE)
    peft_model.set_adapter("default")  # default active and trainable, the reference frozen
    frozen_params = [p for n, p in peft_model.named_parameters() if f".{REFERENCE}." in n]
    assert frozen_params and not any(p.requires_grad for p in frozen_params)


def _check_config(saved: dict[str, Any], adapter: AdapterConfig, where: Path) -> None:
    """The starting adapter must be the recipe's shape (the fingerprint and every checkpoint assume it)."""
    problems = []
    if saved.get("peft_type", "LORA") != "LORA":
        problems.append(f"it is a {saved.get('peft_type')} adapter; spotune trains LoRA")
    if saved.get("r") != adapter.r:
        problems.append(f"its rank is {saved.get('r')}: set adapter.r={saved.get('r')}")
    if float(saved.get("lora_alpha", 0)) != adapter.alpha:
        problems.append(f"its alpha is {saved.get('lora_alpha')}: set adapter.alpha={saved.get('lora_alpha')}")
    for flag in ("use_dora", "use_rslora"):
        if saved.get(flag):
            problems.append(f"it sets {flag}, which spotune does not train")
    if problems:
        raise ConfigError([f"adapter.init_from: {where}: {p}" for p in problems])


def _check_weights(weights: dict[str, torch.Tensor], live: dict[str, torch.Tensor], where: Path) -> None:
    missing, extra = sorted(set(live) - set(weights)), sorted(set(weights) - set(live))
    shapes = [k for k in set(live) & set(weights) if weights[k].shape != live[k].shape]
    if missing or extra or shapes:
        detail = (
            f"{len(missing)} of this recipe's LoRA weights are not in it (e.g. {missing[0]})"
            if missing
            else f"it has {len(extra)} weights this recipe's adapter lacks (e.g. {extra[0]})"
            if extra
            else f"{shapes[0]} has shape {tuple(weights[shapes[0]].shape)}, this recipe's {tuple(live[shapes[0]].shape)}"
        )
        raise ConfigError(
            [
                f"adapter.init_from: {where}: {detail}; set adapter.target_modules (and adapter.r) to those the "
                "starting adapter was trained with"
            ]
        )


@contextlib.contextmanager
def reference_forward(model: torch.nn.Module) -> Iterator[None]:
    """The model as the DPO reference for the block (call it under no_grad): the frozen starting adapter
    when there is one, else the base with adapters disabled; `default` active again after it."""
    peft_model = unwrap_peft(model)
    if REFERENCE not in peft_model.peft_config:
        with peft_model.disable_adapter():
            yield
        return
    peft_model.set_adapter(REFERENCE, inference_mode=True)
    try:
        yield
    finally:
        peft_model.set_adapter("default")
