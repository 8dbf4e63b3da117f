"""`final/`: what `train` leaves for serving, written once at the end of a run (`write_final`).

The PEFT adapter, the tokenizer carrying the chat template the data was rendered with, and a
generation config that stops where training ended a turn; `spotune export` copies or merges it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.atomic import fsync_tree, publish_dir, remove_temp_siblings, temp_sibling
from trainer.model import distributed
from trainer.model.wrappers import unwrap_peft
from trainer.restart.state import adapter_state


def save_tokenizer(tokenizer: str | Path, out: Path, chat_template: str | None) -> None:
    """The tokenizer at `tokenizer`, carrying the chat template the run trained with (`data.chat_template`
    resolved as the data pipeline resolves it), saved to `out`: tokenizer_config.json / chat_template.jinja."""
    from transformers import AutoTokenizer

    from trainer.data.chat_templates import apply_to_saved

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    apply_to_saved(tok, chat_template)
    tok.save_pretrained(str(out))


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
    peft_model.save_pretrained(str(tmp), safe_serialization=True, state_dict=whole)
    save_tokenizer(tokenizer, tmp, chat_template)
    fsync_tree(tmp)
    publish_dir(tmp, directory)
