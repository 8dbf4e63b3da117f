"""A command-line flag that looks like a setting (`--max-steps 10`, `--learning_rate=2e-4`): spotune
takes settings as `key=value` overrides, so such a flag is answered with the override to write
(`train.max_steps=10`), found by the schema's keys and the names of other tools (config/aliases.py).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence

from trainer import config as C
from trainer.config.aliases import ALIASES, ANSWERS


def answers(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """For each `--flag` in `argv` that the command does not take, what to write instead (empty: none)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    sub = _subparser(parser, command)
    if sub is None:
        return []
    known = set(sub._option_string_actions) | set(parser._option_string_actions)
    out = []
    rest = list(argv[argv.index(command) + 1 :]) if command in argv else []
    for i, token in enumerate(rest):
        flag, eq, value = token.partition("=")
        if not flag.startswith("--") or flag == "--" or any(k.startswith(flag) for k in known):
            continue  # an option of the command, or an abbreviation argparse resolves
        if not eq:
            nxt = rest[i + 1] if i + 1 < len(rest) else ""
            value = nxt if nxt and not nxt.startswith("-") and "=" not in nxt else "VALUE"
        out.append(f"{token if eq else f'{flag} {value}'.strip()}: {answer(flag.lstrip('-'), value)}")
    return out


def answer(name: str, value: str) -> str:
    """`train.max_steps=10`, with how the key was found, or the keys a misspelt name is close to."""
    leaf = name.replace("-", "_")
    keys = [key for key, _, _ in C.field_docs()]
    if leaf in keys:
        return f"settings are key=value overrides: write {leaf}={value}"
    owners = [key for key in keys if key.rsplit(".", 1)[-1] == leaf]
    if len(owners) == 1:
        return f"settings are key=value overrides: write {owners[0]}={value}"
    if leaf in ALIASES:
        return f"settings are key=value overrides: write {ALIASES[leaf].key}={value} ({leaf} is its name elsewhere)"
    if leaf in ANSWERS:
        return ANSWERS[leaf].format(value=value)
    close = difflib.get_close_matches(leaf, keys + [k.rsplit(".", 1)[-1] for k in keys], n=3, cutoff=0.6)
    # Best match first; a bare leaf shown as its dotted key.
    near = list(
        dict.fromkeys(k if "." in k or k in keys else next(o for o in keys if o.endswith("." + k)) for k in close)
    )
    hint = f"; the nearest keys: {', '.join(near)}" if near else "; `spotune config` lists every key"
    return f"not an option of this command, and no setting of that name{hint}"


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None
