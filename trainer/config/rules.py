"""How raw YAML becomes a RunConfig: building the dataclasses with type checks, the rules that
span fields, and the walk that documents every key. The sections are
trainer/config/schema.py; RunConfig and loading are trainer/config/__init__.py.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import difflib
import inspect
import json
import sys
import types
import typing
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal, Protocol, Union

from trainer.config.aliases import ALIASES
from trainer.config.schema import (
    CHAT_ROLES,
    AdapterConfig,
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    TrainConfig,
)
from trainer.config.source import Mark
from trainer.urls import remote_problems


class Sections(Protocol):
    """What the cross-field rules read: the sections of a RunConfig (which imports this module)."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def adapter(self) -> AdapterConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...
    @property
    def metrics(self) -> MetricsConfig: ...


def plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def build(cls: type, raw: Any, prefix: str, problems: list[str], marks: Mapping[str, Mark] | None = None) -> Any:
    """An instance of the dataclass `cls` from `raw`, type-checked; each problem appended, named by its
    dotted key. `marks` (trainer/config/source.py) hold each scalar as typed: a field whose type wants a
    string takes the text over YAML 1.1's reading (`on` is a choice of model.activation_offload, not true)."""
    marks = marks or {}
    if not isinstance(raw, Mapping):
        problems.append(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping of keys, got {raw!r}")
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"{name}: unknown key{_suggest(str(key), prefix, fields)}")
            continue
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[key] = build(hint, value if value is not None else {}, f"{name}.", problems, marks)
            continue
        item = _dataclass_items(hint)
        if item is not None:  # a list of sections (data.sources): each entry built and checked like one
            if not isinstance(value, (list, tuple)):
                problems.append(f"{name}: expected a list of mappings, got {value!r}")
                continue
            kwargs[key] = tuple(build(item, v, f"{name}[{i}].", problems, marks) for i, v in enumerate(value))
            continue
        ok, coerced, expected = _check(hint, value)
        typed = marks[name].text if name in marks else None
        if not ok and typed is not None and isinstance(value, (bool, int, float)):
            ok, coerced, _ = _check(hint, typed)  # YAML typed it (`on` -> true, `1.0` -> 1.0); the field wants the text
        if ok:
            kwargs[key] = coerced
        else:
            problems.append(f"{name}: expected {expected}, got {value!r}{_nearest_choice(hint, value)}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # only reachable if a problem was already recorded
        problems.append(f"{prefix or 'recipe'}: {e}")
        return cls()


def _dataclass_items(hint: Any) -> type | None:
    """The dataclass of a `tuple[Section, ...]` hint, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _suggest(key: str, prefix: str, fields: Mapping[str, Any]) -> str:
    """The nearest key of this section or known name of another tool (aliases.py: `learning_rat` is
    nearer `learning_rate`, read as train.lr, than the real key `min_lr_ratio`, which means another thing)."""
    names = {f: "" for f in fields}
    if "[" not in prefix:  # known names are read in a section or at the top, not in a list's entries
        # only a close spelling of one: a loose match to a name of another section would mislead
        aliases = [a for a in ALIASES if a not in fields and difflib.SequenceMatcher(None, key, a).ratio() >= 0.8]
        names.update({a: f" (read as {ALIASES[a].key})" for a in aliases})
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix}{close[0]}{names[close[0]]}?"
    return f"; valid keys here: {', '.join(prefix + f for f in fields)}"


def _nearest_choice(hint: Any, value: Any) -> str:
    """`; did you mean 'sharegpt'?` for a misspelt choice of a Literal field (`data.format=sharegtp`)."""
    choices = [str(a) for a in _literals(hint)]
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""


def _literals(hint: Any) -> list[Any]:
    """Every value a Literal (or a union holding Literals) allows."""
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [a for arg in typing.get_args(hint) for a in _literals(arg)]
    return []


def _check(hint: Any, value: Any) -> tuple[bool, Any, str]:
    """(ok, coerced value, description of the expected type)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        expected = []
        for arg in args:
            ok, coerced, desc = _check(arg, value)
            if ok:
                return True, coerced, desc
            expected.append(desc)
        return False, value, " or ".join(expected)
    if hint is type(None):
        return value is None, None, "null"
    if origin is Literal:
        return value in args, value, "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        items = [value] if isinstance(value, (str, int, float)) else value
        if not isinstance(items, (list, tuple)):
            return False, value, f"a list of {_check(args[0], None)[2]}"
        out = []
        for item in items:
            ok, coerced, desc = _check(args[0], item)
            if not ok:
                return False, value, f"a list of {desc}"
            out.append(coerced)
        return True, tuple(out), f"a list of {_check(args[0], None)[2]}"
    if origin is dict:
        ok = isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
        return ok, dict(value) if ok else value, "a mapping"
    if hint is bool:
        return isinstance(value, bool), value, "true or false"
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if hint is float:
        if isinstance(value, str):  # PyYAML reads `2e-4` (no dot) as a string: accept it
            try:
                return True, float(value), "a number"
            except ValueError:
                return False, value, "a number"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value, "a number"
    if hint is str:
        return isinstance(value, str), value, "a string"
    return isinstance(value, hint), value, getattr(hint, "__name__", str(hint))


def cross_checks(cfg: Sections) -> list[str]:
    p: list[str] = []
    positive = {
        "data.seq_len": cfg.data.seq_len,
        "train.micro_batch_size": 1 if cfg.train.micro_batch_size == "auto" else cfg.train.micro_batch_size,
        "adapter.r": cfg.adapter.r,
        "data.num_proc": cfg.data.num_proc,
        "metrics.log_every": cfg.metrics.log_every,
        "train.max_bad_steps": cfg.train.max_bad_steps,
        "model.tiled_mlp_tokens": cfg.model.tiled_mlp_tokens,
        "checkpoint.store_outage_seconds": cfg.checkpoint.store_outage_seconds,
    }
    for key, value in positive.items():
        if value < 1:
            p.append(f"{key}: must be at least 1, got {value}")
    if cfg.train.micro_batch_size == "auto" and (cfg.train.global_batch_size is None or cfg.train.grad_accum):
        p.append(  # the run must not depend on the GPU: accumulation absorbs the chosen micro-batch
            "train.micro_batch_size: `auto` needs train.global_batch_size (the rows per optimizer step) and no "
            "train.grad_accum; set train.global_batch_size, or give micro_batch_size a number"
        )
    optional: dict[str, int | None] = {
        "train.max_steps": cfg.train.max_steps,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "train.eval_every": cfg.train.eval_every,
        "train.grad_accum": cfg.train.grad_accum,
        "train.global_batch_size": cfg.train.global_batch_size,
    }
    for key, maybe in optional.items():
        if maybe is not None and maybe < 1:
            p.append(f"{key}: must be at least 1 or null, got {maybe}")
    if cfg.train.max_steps is None and cfg.train.epochs <= 0:
        p.append(f"train.epochs: must be above 0 when train.max_steps is unset, got {cfg.train.epochs}")
    if cfg.train.lr <= 0:
        p.append(f"train.lr: must be above 0, got {cfg.train.lr}")
    if cfg.data.loader_workers != "auto" and cfg.data.loader_workers < 0:
        p.append(f"data.loader_workers: must be auto or 0 or more, got {cfg.data.loader_workers}")
    if cfg.checkpoint.store_retry_seconds < 0:
        p.append(f"checkpoint.store_retry_seconds: must be 0 or more, got {cfg.checkpoint.store_retry_seconds}")
    if cfg.train.warmup_steps < 0:
        p.append(f"train.warmup_steps: must be 0 or more, got {cfg.train.warmup_steps}")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        p.append(f"train.min_lr_ratio: must be within [0, 1], got {cfg.train.min_lr_ratio}")
    if not 0.0 <= cfg.adapter.dropout < 1.0:
        p.append(f"adapter.dropout: must be within [0, 1), got {cfg.adapter.dropout}")
    if cfg.train.router_aux_loss_coef < 0:
        p.append(
            f"train.router_aux_loss_coef: must be >= 0 (0: no load-balancing loss), got {cfg.train.router_aux_loss_coef}"
        )
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        p.append(f"data.eval_fraction: must be within [0, 1), got {cfg.data.eval_fraction}")
    if cfg.train.deterministic and cfg.model.compile:  # trainer/training/determinism.py says what the mode sets
        p.append(
            "train.deterministic: model.compile=true cannot be deterministic (torch.compile chooses kernel "
            "configurations by timing them); set model.compile=false or train.deterministic=false"
        )
    timeout = cfg.train.collective_timeout_seconds
    if timeout is not None and timeout < 10:  # a step's slowest rank must fit in it, and a save's barrier
        p.append(f"train.collective_timeout_seconds: must be at least 10 (or null for torch's default), got {timeout}")
    if cfg.train.max_cost is not None and cfg.metrics.price_per_hour is None:
        p.append(
            "train.max_cost: needs metrics.price_per_hour to turn device-hours into cost; set metrics.price_per_hour"
        )
    if cfg.train.mixed_precision == "fp16" and cfg.model.dtype == "bfloat16":
        p.append(
            "train.mixed_precision: fp16 over a bfloat16 base mixes dtypes; use train.mixed_precision=bf16 or model.dtype=float16"
        )
    return (
        p + _checkpoint_checks(cfg.checkpoint) + _fsdp_checks(cfg) + _source_checks(cfg.data) + _objective_checks(cfg)
    )


def _checkpoint_checks(ck: CheckpointConfig) -> list[str]:
    p: list[str] = []
    if ck.keep_last < 2:
        p.append(
            f"checkpoint.keep_last: must be at least 2 so a committed checkpoint always survives, got {ck.keep_last}"
        )
    if ck.every_minutes is not None and ck.every_minutes <= 0:
        p.append(f"checkpoint.every_minutes: must be above 0 or null, got {ck.every_minutes}")
    p += remote_problems(ck.remote, ck.storage_options)
    if ck.notice_endpoint is not None:
        url = urllib.parse.urlsplit(ck.notice_endpoint)
        if url.scheme not in ("http", "https") or not url.hostname or url.username or url.query or url.fragment:
            shown = f"{url.scheme}://{url.hostname}/..." if url.username or url.query else ck.notice_endpoint
            p.append(  # the metadata service takes no credentials, and the endpoint is logged
                "checkpoint.notice_endpoint: must be a plain http(s)://host[:port][/path] URL without "
                f"user, password or query, got {shown!r}"
            )
    if ck.notice_poll_seconds <= 0:
        p.append(f"checkpoint.notice_poll_seconds: must be above 0, got {ck.notice_poll_seconds}")
    if ck.lease_seconds < 1:  # renewed every third of it: shorter would be all renewals
        p.append(f"checkpoint.lease_seconds: must be at least 1, got {ck.lease_seconds}")
    return p


def _source_checks(d: DataConfig) -> list[str]:
    """What `data.sources` entries must hold (their formats and fields are checked by prepare)."""
    p: list[str] = []
    if d.sources and d.path != DataConfig.path:
        p.append("data.sources: set either data.path (one source) or data.sources (a mix), not both; remove data.path")
    if d.template_date is not None:
        try:
            datetime.date.fromisoformat(d.template_date)
        except ValueError:
            p.append(f"data.template_date: expected a day as YYYY-MM-DD, got {d.template_date!r}")
    for speaker, role in d.sharegpt_roles.items():
        if role not in CHAT_ROLES:
            p.append(
                f"data.sharegpt_roles.{speaker}: {role!r} is not a role; map the speaker to one of {', '.join(CHAT_ROLES)}"
            )
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not s.path:
            p.append(f"{key}.path: every source needs a path (a local file or folder, or a hub dataset id)")
        if s.rows is not None and s.fraction is not None:
            p.append(f"{key}: set rows or fraction, not both")
        if s.rows is not None and s.rows < 1:
            p.append(f"{key}.rows: must be at least 1, got {s.rows}")
        if s.fraction is not None and not 0.0 < s.fraction <= 1.0:
            p.append(f"{key}.fraction: must be within (0, 1], got {s.fraction}")
    return p


def _objective_checks(cfg: Sections) -> list[str]:
    """What the preference objectives (trainer/model/preference.py) need of the data and their settings."""
    t, d = cfg.train, cfg.data
    formats = [("data.format", d.format)] + [(f"data.sources[{i}].format", s.format) for i, s in enumerate(d.sources)]
    lengths = {"data.max_prompt_length": d.max_prompt_length, "data.max_completion_length": d.max_completion_length}
    if t.objective == "sft":
        return (
            [
                f"{key}: preference pairs train with a preference objective; set train.objective to dpo, orpo or simpo"
                for key, fmt in formats
                if fmt == "preference"
            ]
            + [
                f"{key}: only the preference objectives read it (an SFT example's length is data.seq_len); remove it"
                for key, n in lengths.items()
                if n is not None
            ]
            + _kto_weight_checks(t)
        )
    if t.objective == "kto":  # TRL's unpaired rows: prompt/completion with a label (trainer/data/unpaired.py)
        p = [
            f"{key}: train.objective=kto trains on unpaired answers (prompt, completion and a bool label); set {key} "
            "to auto or prompt_completion"
            for key, fmt in formats
            if fmt not in (None, "auto", "prompt_completion")
        ]
    else:
        p = [
            f"{key}: train.objective={t.objective} trains on preference pairs; set {key} to auto or preference"
            for key, fmt in formats
            if fmt not in (None, "auto", "preference")
        ]
    p += _kto_weight_checks(t)
    if t.beta <= 0:
        p.append(f"train.beta: must be above 0, got {t.beta}")
    if not 0.0 <= t.label_smoothing < 0.5:
        p.append(f"train.label_smoothing: must be within [0, 0.5), got {t.label_smoothing}")
    elif t.label_smoothing and not (t.objective == "simpo" or (t.objective == "dpo" and t.dpo_loss == "robust")):
        p.append("train.label_smoothing: only train.dpo_loss=robust and train.objective=simpo read it; remove it")
    if t.sft_weight and t.objective == "kto":
        p.append("train.sft_weight: kto has no SFT term (TRL's KTOTrainer has none); remove it")
    elif t.sft_weight < 0:
        p.append(f"train.sft_weight: must be 0 or more, got {t.sft_weight}")
    elif t.sft_weight and t.objective == "orpo":
        p.append(
            "train.sft_weight: orpo has its own SFT term (weight 1, scaled against the odds ratio by train.beta); remove it"
        )
    if d.train_on_inputs:
        p.append("data.train_on_inputs: a preference objective scores the answers only; remove it")
    for key, n in {"data.max_length": d.max_length, **lengths}.items():
        if n is not None and n < 1:
            p.append(f"{key}: must be 1 or more, got {n}")
    return p


def _kto_weight_checks(t: Any) -> list[str]:
    """KTO's desirable/undesirable weights: read by kto only, never negative, not both 0."""
    weights = {"train.desirable_weight": t.desirable_weight, "train.undesirable_weight": t.undesirable_weight}
    if t.objective != "kto":
        return [f"{key}: only train.objective=kto reads it; remove it" for key, w in weights.items() if w != 1.0]
    p = [f"{key}: must be 0 or more, got {w}" for key, w in weights.items() if w < 0]
    if not any(weights.values()):
        p.append("train.desirable_weight, train.undesirable_weight: both are 0, so nothing is trained; raise one")
    return p


def _fsdp_checks(cfg: Sections) -> list[str]:
    """What FSDP sharding cannot take (trainer/model/distributed.py shards)."""
    t = cfg.train
    if t.distributed != "fsdp":
        if t.fsdp_cpu_offload:
            return [
                "train.fsdp_cpu_offload: only applies to sharded training; set train.distributed=fsdp, or remove it"
            ]
        return []
    p: list[str] = []
    if cfg.adapter.method == "qlora" and cfg.adapter.quant_bits == 8:
        p.append(
            "adapter.quant_bits: 8-bit (LLM.int8) weights cannot be sharded by FSDP; use adapter.quant_bits=4 "
            "(stored in the compute dtype under fsdp) or train.distributed=ddp"
        )
    if t.optimizer != "adamw":
        p.append(
            f"train.optimizer: {t.optimizer} (bitsandbytes) does not step sharded (DTensor) parameters; use "
            "train.optimizer=adamw (under fsdp its state is sharded over the devices too) or train.distributed=ddp"
        )
    if t.mixed_precision == "fp16":
        p.append(
            "train.mixed_precision: fp16 needs a gradient scaler that agrees across shards, which spotune does not "
            "run under fsdp; use train.mixed_precision=bf16 or train.distributed=ddp"
        )
    return p


def field_docs(root: type) -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every key under the dataclass `root`, read from the
    attribute docstrings of its module (docs/config-reference.md and `spotune config`)."""
    docs: dict[tuple[str, str], str] = {}
    for module in {root.__module__} | {_section_module(root)}:
        docs.update(_attribute_docs(module))
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            item = _dataclass_items(hints[f.name])
            if item is not None:
                rows.append((prefix + f.name, "[]", docs.get((cls.__name__, f.name), "")))
                walk(item, f"{prefix}{f.name}[].")
                continue
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, json.dumps(plain(default)), docs.get((cls.__name__, f.name), "")))

    walk(root, "")
    return rows


def _section_module(root: type) -> str:
    """The module the sections of `root` are defined in (the schema), read for their docstrings."""
    hints = typing.get_type_hints(root)
    nested = [hints[f.name] for f in dataclasses.fields(root) if dataclasses.is_dataclass(hints[f.name])]
    return nested[0].__module__ if nested else root.__module__


def _attribute_docs(module: str) -> dict[tuple[str, str], str]:
    """(class name, attribute) -> the docstring under that attribute, for every class of `module`."""
    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                        docs[(node.name, stmt.target.id)] = " ".join(str(nxt.value.value).split())
    return docs
