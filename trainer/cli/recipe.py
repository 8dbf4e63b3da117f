"""What the commands that take a recipe share: its arguments, and loading it into a RunConfig."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from trainer import config as C
from trainer.config.source import read_overrides, read_recipe
from trainer.data.hub import looks_local


def add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="YAML recipe (omit to use the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 data.seq_len=1024")


def split(recipe: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """`spotune train a.b=1` has no recipe: the first positional is then an override."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    return recipe, list(overrides)


def load(args: argparse.Namespace) -> C.RunConfig:
    """The RunConfig of the recipe and overrides on the command line."""
    return C.load(*split(args.recipe, args.overrides))


def names_data(recipe: str | None, overrides: Sequence[str]) -> bool:
    """Whether the recipe file or the overrides name the data (`data.path` or `data.sources`): the
    default, the built-in demo set, is no one's data to price. Call after `C.load` of the same
    arguments, which reports a recipe or override that does not read."""
    named = set(read_overrides(overrides)[0])
    if recipe is not None:
        named |= set(read_recipe(Path(recipe))[1])
    return bool(named & {"data.path", "data.sources"})


OFFLINE_VALUES = ("1", "ON", "YES", "TRUE")
"""How huggingface_hub reads HF_HUB_OFFLINE (its `_is_true`)."""


def check_model(cfg: C.RunConfig, download: bool = True) -> None:
    """model.name_or_path and data.tokenizer name a built-in, a local folder or a hub id, at once, before
    anything loads (a path that does not exist otherwise surfaces as a tokenizer's repo-id error). With
    `download` (the model will load) and HF_HUB_OFFLINE set, a hub id must be in the Hugging Face cache:
    offline, the hub's client would only fail later, after its retries."""
    wanted: list[tuple[str, str, str | None, tuple[str, ...]]] = [
        ("model.name_or_path", cfg.model.name_or_path, cfg.model.revision, ("config.json",))
    ]
    if cfg.data.tokenizer is not None:
        wanted.append(("data.tokenizer", cfg.data.tokenizer, None, ("tokenizer_config.json", "tokenizer.json")))
    problems = [f"{key}: {p}" for key, name, rev, files in wanted if (p := _model_problem(name, rev, files, download))]
    if problems:
        raise C.ConfigError(problems, "model")


def _model_problem(name: str, revision: str | None, files: Sequence[str], download: bool) -> str | None:
    import os

    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = Path(name).expanduser()
    if name.startswith("builtin:") or path.is_dir():
        return None
    if path.exists():
        return f"{name} is a file; give the folder that holds the model's config.json and weights, or a hub id"
    try:
        validate_repo_id(name)
    except HFValidationError:
        return (
            f"{name} is neither a local folder (no such directory) nor a hub model id (org/name, e.g. "
            "Qwen/Qwen2.5-1.5B-Instruct); check the path, or give a hub id"
        )
    if looks_local(name):  # decided here, without the hub: a typo must not wait on a hub that does not answer
        return (
            f"{name} is not a local folder (no such directory: {path.absolute()}), and looks like a path rather "
            f"than a hub model id ({name.split('/')[0]}/ is a folder here); check the path"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in OFFLINE_VALUES
    if not download or not offline:
        return None
    if any(isinstance(try_to_load_from_cache(name, f, revision=revision), str) for f in files):
        return None
    return (
        f"{name} is not a local folder, and as a hub id it is not in this machine's Hugging Face cache "
        f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']} forbids downloading it: "
        f"check the spelling; download it where there is a network (`hf download {name}`) and copy the cache "
        "here; or unset HF_HUB_OFFLINE"
    )
