"""`spotune export RUN_DIR [--merge] [--out DIR]`.

Without --merge: copy the adapter (adapter_model.safetensors, adapter_config.json) to DIR with
the tokenizer (and chat template) and generation config the run serves with. With --merge: load the base model unquantised in the recipe's
dtype, apply the adapter and `merge_and_unload()` into a plain transformers model that
serving stacks load with `AutoModelForCausalLM.from_pretrained(DIR)`.

The source is `RUN_DIR/final/`, or the newest checkpoint that verifies when the run has not
finished (a preempted or budget-stopped run still exports what it has).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, DataConfig, ModelConfig, load
from trainer.data.tokenizer import file_names, revision_of
from trainer.serve.final import GENERATION_CONFIG, write_served

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def adapter_source(run_dir: Path) -> Path:
    """`final/` when it exists, else the newest verified checkpoint; raises naming what is missing."""
    final = run_dir / "final"
    if all((final / f).is_file() for f in ADAPTER_FILES):
        return final
    from trainer.restart.local.checkpoint import CheckpointError, CheckpointManager

    path, _ = CheckpointManager(run_dir / "checkpoints", keep_last=2).latest_verified()
    if path is None:
        raise CheckpointError(
            f"{run_dir}: no final/ adapter and no verified checkpoint under {run_dir / 'checkpoints'}; "
            "give the output_dir of a run that trained at least one checkpoint"
        )
    return path


def export(run_dir: Path | str, out_dir: Path | str | None = None, merge: bool = False) -> Path:
    """Write the adapter (or, with `merge`, a merged full model) to `out_dir`; returns it."""
    run_dir = Path(run_dir)
    src = adapter_source(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / ("merged" if merge else "export")
    if out.resolve() == src.resolve():
        raise ConfigError([f"--out {out} is the adapter's own directory; choose another"], "command line")
    out.mkdir(parents=True, exist_ok=True)
    model_cfg, data_cfg = _run_config(run_dir)
    if not merge:
        for name in ADAPTER_FILES:
            shutil.copy2(src / name, out / name)
        serving_files(src, out, model_cfg, data_cfg, _base_generation(_base_path(src), model_cfg))
        return out
    merge_adapter(src, out, model_cfg, data_cfg)
    return out


def serving_files(src: Path, out: Path, model_cfg: ModelConfig, data_cfg: DataConfig, base: Any) -> Any:
    """The tokenizer and generation config a server loads beside the weights, into `out`: `src`'s own
    (final/ carries both) or, where `src` is a checkpoint (which carries neither), the run's tokenizer at
    the weights' revision with its chat template and `base` (the base model's generation config, or None)
    with the run's end of turn among its EOS ids, as final/ would have had them. Returns that config."""
    from transformers import GenerationConfig

    if (src / "tokenizer_config.json").is_file() and (src / GENERATION_CONFIG).is_file():
        for f in [*file_names(src), src / GENERATION_CONFIG]:
            shutil.copy2(f, out / f.name)
        return GenerationConfig.from_pretrained(str(src))
    base_path = _base_path(src)
    revision = revision_of(data_cfg.tokenizer, data_cfg.tokenizer_revision, base_path, model_cfg.revision)
    return write_served(out, data_cfg.tokenizer or base_path, data_cfg, base, revision)


def _base_path(adapter_dir: Path) -> str:
    """The base model the adapter was trained on (its adapter_config.json's base_model_name_or_path)."""
    base_path = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_path:
        raise ConfigError(
            [
                f"{adapter_dir / 'adapter_config.json'}: no base_model_name_or_path to serve with; "
                "set it to the base model's path or id"
            ],
            "export",
        )
    return str(base_path)


def _base_generation(base_path: str, model_cfg: ModelConfig) -> Any:
    """The base model's generation config at the weights' revision, or None where it ships none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(base_path, revision=model_cfg.revision or "main")
    except OSError:
        return None


def _run_config(run_dir: Path) -> tuple[ModelConfig, DataConfig]:
    """The run's `model` and `data` sections through the config loader, so defaults are the schema's
    (a config.yaml that omits `model.dtype` means the schema default, not some export default)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return ModelConfig(), DataConfig()
    cfg = load(path)
    return cfg.model, cfg.data


def merge_adapter(adapter_dir: Path, out: Path, model_cfg: ModelConfig, data_cfg: DataConfig | None = None) -> None:
    """The base model with the adapter merged in, saved to `out` with the run's tokenizer and chat
    template and a generation config that stops where training ended a turn (final/'s when it has one)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.model.load import download_bar_kwargs, peft_wrapping, quiet_hf_progress

    base_path = _base_path(adapter_dir)
    dtype = getattr(torch, model_cfg.dtype)
    # A QLoRA adapter is merged into the unquantised base: merging into 4-bit weights would
    # round the update away, and serving stacks want plain weights anyway.
    # The base's download shows (a bar, or lines in a log file); the libraries' loading bars do not.
    with quiet_hf_progress(downloads=True), peft_wrapping():
        base = AutoModelForCausalLM.from_pretrained(
            base_path,
            dtype=dtype,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            **download_bar_kwargs(),
        )
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.generation_config = serving_files(
        adapter_dir, out, model_cfg, data_cfg or DataConfig(), merged.generation_config
    )
    with quiet_hf_progress():
        merged.save_pretrained(str(out), safe_serialization=True)
