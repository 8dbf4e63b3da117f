"""The tokenizer a run renders its data with and ships in `final/`: one local folder, at one revision.

A hub id is fetched (its tokenizer files only) into the HF cache at the revision the weights load
at (`model.revision`, or `data.tokenizer_revision`), so the chat template comes from the same commit
as the model, not from `main`. Everything downstream reads that folder: `prepare` hashes its files'
bytes into the data fingerprint (a template changed upstream is new data, never the same cache
entry), renders with it, and `final/` saves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.data.hub import not_found
from trainer.data.read import DataError

PATTERNS = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
    "*.tiktoken",
    "*.model",  # SentencePiece (tokenizer.model, spiece.model)
    "config.json",  # AutoTokenizer reads the tokenizer class from it when tokenizer_config.json does not say
    "generation_config.json",  # the stop tokens `final/` starts from
]
"""The files of a hub model that make its tokenizer (not its weights)."""


def revision_of(
    tokenizer: str | None, tokenizer_revision: str | None, model: str, model_revision: str | None
) -> str | None:
    """The revision the tokenizer (and its chat template) loads at: `data.tokenizer_revision`, else the
    weights' `model.revision` when the tokenizer is the model's (`data.tokenizer` unset or the same id),
    so the two come from one commit."""
    if tokenizer_revision is not None:
        return tokenizer_revision
    return model_revision if tokenizer in (None, model) else None


def local_dir(name_or_path: str, revision: str | None, key: str = "data.tokenizer") -> str:
    """A folder holding the tokenizer `name_or_path` names: itself when it is a folder, else the hub
    model's tokenizer files at `revision` (None: its default branch) in the HF cache."""
    if Path(name_or_path).is_dir():
        return name_or_path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    at = f"{name_or_path}@{revision}" if revision else name_or_path
    try:
        return str(snapshot_download(name_or_path, revision=revision, allow_patterns=PATTERNS))
    except HFValidationError:
        raise DataError(
            f"{key}: {name_or_path!r} is neither a local folder nor a hub model id (org/name); "
            "point it at a folder holding tokenizer files."
        ) from None
    except RepositoryNotFoundError:
        raise DataError(not_found(key, name_or_path, "model")) from None
    except LocalEntryNotFoundError as e:
        raise DataError(
            f"{key}: the tokenizer of {at} is not in the local HF cache and the hub could not be reached "
            "(HF_HUB_OFFLINE, or no network): run once with the network, or point it at a local folder."
        ) from e  # the cause tells a hub that does not answer (exit 143) from offline mode (exit 2)


def load_tokenizer(path: str) -> Any:
    """The tokenizer in the folder `path` (remote code never runs); errors name the key to set."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot load a tokenizer from {path!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "set data.tokenizer (or model.name_or_path) to a directory holding tokenizer files."
        ) from e  # the cause tells a hub that does not answer (exit 143) from a wrong path (exit 2)


def file_names(folder: Path) -> list[Path]:
    """The files that define a tokenizer's behaviour and chat template (weights beside them are not)."""
    import fnmatch

    return sorted(
        f
        for f in folder.iterdir()
        if f.is_file()
        and f.name not in ("config.json", "generation_config.json")
        and any(fnmatch.fnmatch(f.name, p) for p in PATTERNS)
    )
