"""`spotune export RUN_DIR [--merge] [--out DIR]`.

Without --merge: copy the adapter (adapter_model.safetensors, adapter_config.json and the
tokenizer files) to DIR. With --merge: load the base model unquantised in the recipe's
dtype, apply the adapter and `merge_and_unload()` into a plain transformers model that
serving stacks load with `AutoModelForCausalLM.from_pretrained(DIR)`.

The source is `RUN_DIR/final/`, or the newest checkpoint that verifies when the run has not
finished (a preempted or budget-stopped run still exports what it has).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer.config import ConfigError, DataConfig, ModelConfig, load
from trainer.data.tokenizer import revision_of
from trainer.serve.final import GENERATION_CONFIG, save_tokenizer, served_generation_config

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def adapter_source(run_dir: Path) -> Path:
    """`final/` when it exists, else the newest verified checkpoint; raises naming what is missing."""
    final = run_dir / "final"
    if all((final / f).is_file() for f in ADAPTER_FILES):
        return final
    from trainer.restart.checkpoint import CheckpointError, CheckpointManager

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
    if not merge:
        for name in (*ADAPTER_FILES, *TOKENIZER_FILES, GENERATION_CONFIG):
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        return out
    model_cfg, data_cfg = _run_config(run_dir)
    merge_adapter(src, out, model_cfg, data_cfg)
    return out


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
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trainer.model.load import download_bar_kwargs, peft_wrapping, quiet_hf_progress

    base_path = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_path:
        raise ConfigError(
            [
                f"{adapter_dir / 'adapter_config.json'}: no base_model_name_or_path to merge into; "
                "set it to the base model's path or id"
            ],
            "export --merge",
        )
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
    d = data_cfg or DataConfig()
    if (adapter_dir / "tokenizer_config.json").is_file():  # final/ carries the trained tokenizer and template
        tok = save_tokenizer(adapter_dir, out, d.chat_template)
    else:  # a checkpoint carries none: the run's tokenizer, at the weights' revision, gets the template here
        revision = revision_of(d.tokenizer, d.tokenizer_revision, base_path, model_cfg.revision)
        tok = save_tokenizer(d.tokenizer or base_path, out, d.chat_template, revision)
    if (adapter_dir / GENERATION_CONFIG).is_file():
        merged.generation_config = GenerationConfig.from_pretrained(str(adapter_dir))
    else:
        merged.generation_config = served_generation_config(merged.generation_config, tok, None, d.format)
    with quiet_hf_progress():
        merged.save_pretrained(str(out), safe_serialization=True)
