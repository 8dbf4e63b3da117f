"""Model configs for planning without a download: shipped config.json files, then the hub, then a clear fix.

`spotune estimate` needs only a model's architecture (hidden size, layers, heads, vocab...),
never its weights. The config.json of the models people fine-tune most ships in
`trainer/plan/models/` (file `<org>--<name>.json`, the published file), so those ids answer
offline and without a token, gated or not. Any other id is read from the hub, config.json
only. Lookup is case-insensitive and forgives the usual variants of one architecture:
`Meta-Llama-3.1-8B` for `Llama-3.1-8B`, and the `-Instruct`, `-it`, `-pt`, `-Base`, `-chat`,
`-hf` suffixes of a fine-tuned or base twin (same shapes, different weights).
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from trainer.plan import PlanError

_SUFFIXES = ("-instruct", "-it", "-pt", "-base", "-chat", "-hf")
# Same architecture under another name that the suffix rule does not reach.
_ALIASES = {
    "mistral-7b-instruct-v0.3": "mistral-7b-v0.3",
    "mistral-nemo-instruct-2407": "mistral-nemo-base-2407",
    "mistral-nemo-12b": "mistral-nemo-base-2407",
    "phi-3-mini-128k": "phi-3-mini-4k",
}


def _key(name: str) -> str:
    """'meta-llama/Meta-Llama-3.1-8B-Instruct' -> 'llama-3.1-8b' (the org is compared apart)."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")  # Meta-Llama-3.1-8B is the older spelling of Llama-3.1-8B
    changed = True
    while changed:
        changed = False
        for suffix in _SUFFIXES:
            if key.endswith(suffix):
                key, changed = key[: -len(suffix)], True
    return _ALIASES.get(key, key)


@cache
def _index() -> dict[str, tuple[str, str]]:
    """Normalised name -> (org, shipped file name)."""
    out: dict[str, tuple[str, str]] = {}
    for entry in (resources.files("trainer.plan") / "models").iterdir():
        if entry.name.endswith(".json"):
            org, name = entry.name.removesuffix(".json").split("--", 1)
            out[_key(name)] = (org.lower(), entry.name)
    return out


def shipped_ids() -> list[str]:
    """The hub ids whose config.json ships with spotune."""
    return sorted(f.removesuffix(".json").replace("--", "/") for _, f in _index().values())


def shipped_config(model_id: str) -> dict[str, Any] | None:
    """The shipped config.json of `model_id` as a dict, or None when spotune does not ship it.

    An org, when given, must be the publisher's (a fine-tune under another org may change shapes).
    """
    found = _index().get(_key(model_id))
    if found is None:
        return None
    org, filename = found
    if "/" in model_id and model_id.split("/", 1)[0].strip().lower() != org:
        return None
    text = (resources.files("trainer.plan") / "models" / filename).read_text()
    return dict(json.loads(text))


def looks_like_model_id(text: str) -> bool:
    """`org/name` with no YAML suffix and no such local path: a hub id rather than a recipe."""
    return (
        re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None
        and not text.endswith((".yaml", ".yml"))
        and not Path(text).exists()
    )


def load_config(name_or_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """A transformers config: local path, else shipped config.json, else config.json from the hub.

    Raises PlanError naming the fix when none of the three works.
    """
    from transformers import AutoConfig

    shipped = None if Path(name_or_path).exists() else shipped_config(name_or_path)
    if shipped is not None:
        return AutoConfig.for_model(shipped.pop("model_type"), **shipped)
    try:
        # Fetches config.json alone (no weights); honours HF_HUB_OFFLINE and HF_TOKEN.
        return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PlanError(
            f"model.name_or_path: cannot read the model config of {name_or_path!r}: {reason}\n"
            "Fix: give a local directory that holds its config.json; or, online, a hub id you can reach "
            "(for a gated model such as Llama or Gemma, accept its licence on huggingface.co and set HF_TOKEN). "
            f"Shipped, offline: {', '.join(shipped_ids())}."
        ) from None
