"""Where each setting of a run came from: a recipe's YAML read with its line marks, and the
command line's `key.sub=value` overrides, so that every config problem can name the file and
line (`recipes/x.yaml:12: train.lr: ...`) or the override (`override train.lr=-1: ...`).

PyYAML's composer keeps a start mark on every node; the values themselves are built by the
same SafeLoader constructor that `yaml.safe_load` uses, so a recipe reads exactly as before.
Beside each plain (unquoted) scalar we keep the text as typed: YAML 1.1 reads `on`, `off`,
`yes` and `no` as booleans, and a field whose type wants a string (`model.activation_offload`'s
`on`) takes the text instead (rules.build).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.urls import redact


@dataclass(frozen=True)
class Mark:
    """Where a dotted key was set, and its value as typed when that was a plain scalar."""

    where: str
    """`recipes/x.yaml:12` or `override train.lr=-1`."""
    text: str | None = None
    """The scalar as typed, unquoted (None: quoted, a list or a mapping: YAML's reading stands)."""


Marks = dict[str, Mark]
"""Dotted key (`train.lr`, `output_dir`) -> where it was set."""


class SourceError(ValueError):
    """The recipe cannot be read at all (missing file, invalid YAML, not a mapping)."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else problems
        super().__init__("; ".join(self.problems))


def read_recipe(path: Path) -> tuple[dict[str, Any], Marks]:
    """The recipe's mapping as `yaml.safe_load` reads it, with the mark of every key at every depth."""
    if not path.is_file():
        raise SourceError(f"recipe file not found: {path} (give the path to a YAML recipe)")
    text = path.read_text()
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = (
            f"{path}:{mark.line + 1}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        )
        raise SourceError(f"{where or f'{path}: invalid YAML'}: {getattr(e, 'problem', e)}") from None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict) or not isinstance(node, yaml.MappingNode):
        raise SourceError(f"{path}:1: the recipe must be a YAML mapping of keys to values")
    marks: Marks = {}
    twice: list[str] = []
    _walk(node, "", str(path), marks, twice)
    if twice:  # YAML keeps the last silently: a second `train:` would drop the first one's keys
        raise SourceError(twice)
    return data, marks


def _walk(node: yaml.MappingNode, prefix: str, path: str, marks: Marks, twice: list[str]) -> None:
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue
        dotted = f"{prefix}{key_node.value}"
        if dotted in marks:
            line = key_node.start_mark.line + 1
            twice.append(f"{path}:{line}: {dotted}: given twice (also {marks[dotted].where}); keep one")
        plain = isinstance(value_node, yaml.ScalarNode) and value_node.style is None
        marks[dotted] = Mark(f"{path}:{key_node.start_mark.line + 1}", value_node.value if plain else None)
        if isinstance(value_node, yaml.MappingNode):
            _walk(value_node, f"{dotted}.", path, marks, twice)
        elif isinstance(value_node, yaml.SequenceNode):  # a list of sections (data.sources): `key[i].sub`
            for i, item in enumerate(value_node.value):
                marks[f"{dotted}[{i}]"] = Mark(f"{path}:{item.start_mark.line + 1}")
                if isinstance(item, yaml.MappingNode):
                    _walk(item, f"{dotted}[{i}].", path, marks, twice)


def read_overrides(overrides: Sequence[str]) -> tuple[dict[str, Any], Marks, list[str]]:
    """`key.sub=value` items -> (dotted key -> value read as YAML, their marks, problems)."""
    pairs: dict[str, Any] = {}
    marks: Marks = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"override {item!r} is not of the form key.sub=value")
            continue
        try:
            pairs[key] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            pairs[key] = value
        quoted = value.strip()[:1] in ("'", '"')
        marks[key] = Mark(
            f"override {key}={_shown(key, value)}", None if quoted or not value.strip() else value.strip()
        )
    return pairs, marks, problems


def _shown(key: str, value: str) -> str:
    """The override's value as messages and the log may show it: never storage options (they sit next
    to credentials), a URL without user, password or query (signed URLs: trainer/urls.py)."""
    if "storage_options" in key:
        return "..."
    try:
        return redact(value) if "://" in value else value
    except ValueError:  # not a URL after all (urlsplit refuses it): nothing of it is shown
        return "..."


_KEY = re.compile(r"^([A-Za-z_][\w.\[\]]*):")
_LAST = re.compile(r"(\.[^.\[]+|\[\d+\])$")
"""The last part of a dotted key: `.sub` or a list index `[i]`."""


def locate(problem: str, marks: Mapping[str, Mark]) -> str:
    """`train.lr: must be ...` -> `recipes/x.yaml:12: train.lr: must be ...` when the key was set
    somewhere. A key below a set mapping (`checkpoint.storage_options.x`) takes the mapping's mark;
    a default the recipe never set gets none (its section's line would point at other keys)."""
    found = _KEY.match(problem)
    if not found:
        return problem
    key = found.group(1)
    while key:
        if key in marks:
            return f"{marks[key].where}: {problem}"
        parent = _LAST.sub("", key)
        key = parent if "." in parent or "[" in parent else ""  # never a section's line alone
    return problem
