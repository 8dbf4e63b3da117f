"""`final/`: what `train` leaves for serving, written once at the end of a run (`write_final`).

The PEFT adapter, the tokenizer carrying the chat template the data was rendered with, and a
generation config that stops where training ended a turn; `spotune export` copies or merges it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from trainer.atomic import fsync_tree, publish_dir, remove_temp_siblings, temp_sibling
from trainer.config import DataConfig
from trainer.data.template import end_of_turn_ids
from trainer.model import distributed
from trainer.model.wrappers import unwrap_peft
from trainer.restart.local.state import adapter_state

GENERATION_CONFIG = "generation_config.json"


def save_tokenizer(tokenizer: str | Path, out: Path, chat_template: str | None, revision: str | None = None) -> Any:
    """The tokenizer at `tokenizer` (a hub id at `revision`), carrying the chat template the run trained
    with (`data.chat_template` resolved as the data pipeline resolves it), saved to `out`:
    tokenizer_config.json / chat_template.jinja. Returns it, as saved."""
    from transformers import AutoTokenizer

    from trainer.data.chat_templates import apply_to_saved

    tok = AutoTokenizer.from_pretrained(str(tokenizer), revision=revision)
    apply_to_saved(tok, chat_template)
    tok.save_pretrained(str(out))
    return tok


def served_generation_config(base: Any, tokenizer: Any, chat_template: str | None, data_format: str) -> Any:
    """`base` (the base model's GenerationConfig, or None) with every token the run trained as the end of
    a turn among its EOS ids, so generation stops where training ended a turn: a base model trained on
    `chatml` stops at `<|im_end|>`, not only at its own `<|endoftext|>` (in `spotune chat`, vLLM, TGI)."""
    from transformers import GenerationConfig

    served = copy.deepcopy(base) if base is not None else GenerationConfig()
    have = served.eos_token_id
    eos = [] if have is None else [int(have)] if isinstance(have, int) else [int(t) for t in have]
    eos += [t for t in end_of_turn_ids(tokenizer, chat_template, data_format) if t not in eos]
    served.eos_token_id = eos[0] if len(eos) == 1 else eos
    served._from_model_config = False  # edited: transformers must not rebuild it from the model's config
    return served


def write_served(out: Path, tokenizer: str | Path, data: DataConfig, base: Any, revision: str | None = None) -> Any:
    """What a server needs to render and stop as the run trained, into `out`: the tokenizer at `tokenizer`
    (a hub id at `revision`) carrying the run's chat template, and `base` (the base model's generation
    config, or None) with the run's end of turn among its EOS ids. Returns that generation config."""
    tok = save_tokenizer(tokenizer, out, data.chat_template, revision)
    served = served_generation_config(base, tok, None, data.format)  # tok carries the template
    served.save_pretrained(str(out))
    return served


def write_final(
    directory: Path,
    model: torch.nn.Module,
    tokenizer: str,
    is_main: bool = True,
    data: DataConfig | None = None,
) -> None:
    """`final/`: the PEFT adapter (adapter_model.safetensors + adapter_config.json), the tokenizer,
    carrying the chat template the data was rendered with (`data.chat_template`), and the base model's
    generation config with what the run trained as the end of a turn (per `data.format`) among its EOS ids.

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
    write_served(tmp, tokenizer, data or DataConfig(), getattr(peft_model.get_base_model(), "generation_config", None))
    fsync_tree(tmp)
    publish_dir(tmp, directory)
