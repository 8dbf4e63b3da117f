"""`final/` at the end of `train` (`write_final`), and `spotune export RUN_DIR [--merge] [--out DIR]`.

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

import torch

from trainer.atomic import fsync_tree, publish_dir, remove_temp_siblings, temp_sibling
from trainer.config import ConfigError, ModelConfig, load
from trainer.model import distributed
from trainer.model.wrappers import unwrap_peft
from trainer.restart.state import adapter_state

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
        for name in ADAPTER_FILES + TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
        return out
    model_cfg, chat_template = _run_config(run_dir)
    merge_adapter(src, out, model_cfg, chat_template)
    return out


def _run_config(run_dir: Path) -> tuple[ModelConfig, str | None]:
    """The run's `model` section and `data.chat_template` through the config loader, so defaults are the
    schema's (a config.yaml that omits `model.dtype` means the schema default, not some export default)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return ModelConfig(), None
    cfg = load(path)
    return cfg.model, cfg.data.chat_template


def save_tokenizer(tokenizer: str | Path, out: Path, chat_template: str | None) -> None:
    """The tokenizer at `tokenizer`, carrying the chat template the run trained with (`data.chat_template`
    resolved as the data pipeline resolves it), saved to `out`: tokenizer_config.json / chat_template.jinja."""
    from transformers import AutoTokenizer

    from trainer.data.chat_templates import apply_to_saved

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    apply_to_saved(tok, chat_template)
    tok.save_pretrained(str(out))


def merge_adapter(adapter_dir: Path, out: Path, model_cfg: ModelConfig, chat_template: str | None = None) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

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
        merged.save_pretrained(str(out), safe_serialization=True)
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_path
    # final/ already carries the trained template; a checkpoint has no tokenizer, so the base's gets it here
    save_tokenizer(tok_dir, out, chat_template)


def write_final(
    directory: Path, model: torch.nn.Module, tokenizer: str, is_main: bool = True, chat_template: str | None = None
) -> None:
    """`final/`: the PEFT adapter (adapter_model.safetensors + adapter_config.json) and the tokenizer,
    carrying the chat template the data was rendered with (`chat_template` is data.chat_template).

    Every rank calls it (under FSDP the adapter is gathered from the shards); the main rank
    writes. Written into a temp directory, fsynced and renamed into place like a checkpoint, so
    a kill mid-write never leaves a torn adapter that `export` or a server would pick up.
    """
    whole = adapter_state(model) if is_main or distributed.is_sharded(model) else None
    if not is_main:
        return
    peft_model = unwrap_peft(model)
    remove_temp_siblings(directory)
    tmp = temp_sibling(directory)
    # The trained adapter only: a DPO run's frozen reference (trainer/model/reference.py) stays behind.
    active = [peft_model.active_adapter]
    peft_model.save_pretrained(str(tmp), safe_serialization=True, state_dict=whole, selected_adapters=active)
    save_tokenizer(tokenizer, tmp, chat_template)
    fsync_tree(tmp)
    publish_dir(tmp, directory)
