"""The run configuration: frozen typed dataclasses, YAML recipes, dotted overrides.

The dataclasses below are the whole schema. Defaults live here and nowhere else.
`load(recipe, overrides)` reads a YAML recipe, applies `key.sub=value` overrides,
checks every key and type, and raises one `ConfigError` that lists every problem,
each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

BUILTIN_TINY_MODEL = "builtin:tiny-llama"
BUILTIN_TINY_DATA = "builtin:tiny-instruct"


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = BUILTIN_TINY_MODEL
    """Local directory or hub model id of the base model (`builtin:tiny-llama` is built offline)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name_or_path` is a model id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the frozen base weights (and the compute dtype of 4-bit layers)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    """`auto`: flash_attention_2 when installed and on CUDA, else sdpa."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (non-reentrant) to save memory."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off unless you trust its source."""


@dataclass(frozen=True)
class AdapterConfig:
    method: Literal["lora", "qlora"] = "lora"
    """`lora` over a bf16/fp16/fp32 base, or `qlora` over a bitsandbytes-quantised base."""
    quant_bits: Literal[4, 8] = 4
    """For `qlora`: 4 (NF4 with double quantisation) or 8 (LLM.int8)."""
    r: int = 16
    """LoRA rank."""
    alpha: float = 32.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt; `all-linear` adapts every linear layer but the output head."""


@dataclass(frozen=True)
class DataConfig:
    path: str = BUILTIN_TINY_DATA
    """JSONL, JSON array, Parquet, CSV file, or a saved `datasets` directory."""
    format: Literal["alpaca", "chat", "text"] = "alpaca"
    """`alpaca` (instruction/input/output), `chat` (messages), `text` (every token trained)."""
    seq_len: int = 2048
    """Tokens per packed row."""
    packing: bool = True
    """Best-fit-decreasing packing; false pads each example to `seq_len`."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with examples longer than `seq_len`."""
    tokenizer: str | None = None
    """Tokenizer path or id; defaults to `model.name_or_path`."""
    chat_template: str | None = None
    """Jinja chat template for `chat` data when the tokenizer has none."""
    instruction_field: str = "instruction"
    """Field holding the alpaca instruction."""
    input_field: str = "input"
    """Field holding the optional alpaca input (may be missing or empty)."""
    output_field: str = "output"
    """Field holding the alpaca response (trained)."""
    messages_field: str = "messages"
    """Field holding chat messages (`role`/`content`); only assistant turns are trained."""
    text_field: str = "text"
    """Field holding raw text for `text` format."""
    cache_dir: str | None = None
    """Where packed datasets are cached; defaults to `<output_dir>/data`."""
    num_proc: int = 1
    """Processes for tokenisation (`datasets.map`)."""
    eval_fraction: float = 0.0
    """Share of examples held out for evaluation (ignored when `eval_path` is set)."""
    eval_path: str | None = None
    """A separate evaluation file, prepared like `path`."""
    shuffle: bool = True
    """Shuffle rows each epoch (order is a pure function of seed and epoch)."""


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run; when unset, `epochs` decides."""
    epochs: float = 1.0
    """Passes over the packed rows when `max_steps` is unset."""
    micro_batch_size: int = 1
    """Rows per forward pass per device."""
    grad_accum: int = 1
    """Micro-batches per optimizer step per device."""
    lr: float = 2e-4
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to `lr`."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a share of `lr` for cosine and linear schedules."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """`adamw` (fused on CUDA), or bitsandbytes 8-bit / paged 8-bit AdamW."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast for the trainable path; fp16 adds a gradient scaler."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm."""
    eval_every: int | None = None
    """Evaluate on the held-out split every N steps."""
    max_gpu_hours: float | None = None
    """Stop with a checkpoint once the whole run (all attempts) used this many device-hours."""
    max_cost: float | None = None
    """Stop with a checkpoint once the whole run cost this much (needs `metrics.price_per_hour`)."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int | None = None
    """Save every N optimizer steps."""
    every_minutes: float | None = 30.0
    """Save when this much wall time passed since the last save."""
    keep_last: int = 3
    """Committed checkpoints to keep (at least 2)."""
    resume: str = "auto"
    """`auto` (newest that verifies), `never`, or a checkpoint directory; `never` and a path set newer checkpoints aside."""
    allow_config_change: bool = False
    """Resume even if the dataset or a structural setting changed."""
    notice_seconds: float = 30.0
    """Preemption notice window: warn when a save takes longer; with checkpoint.remote, the time allowed to flush the last upload before exit."""
    remote: str | None = None
    """fsspec URL (`s3://bucket/prefix`, `gs://`, `az://`, `file://`) that every checkpoint is uploaded to in the background; resume also looks there. Credentials come from the cloud's standard chain."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra fsspec options for `checkpoint.remote` (e.g. `{client_kwargs: {region_name: eu-west-1}}`); never credentials."""


@dataclass(frozen=True)
class MetricsConfig:
    log_every: int = 1
    """Write a metrics row every N optimizer steps."""
    warmup_steps: int = 2
    """Steps excluded from sustained throughput."""
    price_per_hour: float | None = None
    """Price of one device-hour, for the cost ledger."""
    gpu: str | None = None
    """GPU name for the peak FLOP/s table (detected when unset)."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device; overrides the table."""
    trackers: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Extra trackers through accelerate."""
    progress: bool = True
    """Show a progress bar on the console."""


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    """Run directory: checkpoints, metrics, ledger, final adapter."""
    seed: int = 0
    """Seed for initialisation, LoRA dropout and the data order."""
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    def replace(self, **dotted: Any) -> RunConfig:
        """A copy with dotted keys changed, validated like overrides: `cfg.replace(**{"train.max_steps": 5})`."""
        return from_dict(_apply_overrides(self.to_dict(), dotted, source="replace()"))


class ConfigError(ValueError):
    """Every problem found in a config, one per line, each naming the key and the fix."""

    def __init__(self, problems: Sequence[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


# ---------------------------------------------------------------------------- loading


def load(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML recipe (or the defaults when None) and apply `key.sub=value` overrides."""
    source = str(recipe) if recipe is not None else "defaults"
    raw: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError([f"recipe file not found: {path} (give the path to a YAML recipe)"], source)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError([f"invalid YAML{where}: {getattr(e, 'problem', e)}"], source) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(["the recipe must be a YAML mapping of keys to values"], source)
        raw = loaded
    pairs: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"override {item!r} is not of the form key.sub=value")
            continue
        try:
            pairs[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            pairs[key.strip()] = value
    if problems:
        raise ConfigError(problems, "command line")
    return from_dict(_apply_overrides(raw, pairs, source="command line"), source=source)


def from_dict(raw: Mapping[str, Any], source: str = "config") -> RunConfig:
    """Build a RunConfig from nested plain data, collecting every problem before raising."""
    problems: list[str] = []
    cfg = _build(RunConfig, raw, "", problems)
    problems.extend(_cross_checks(cfg))  # fields that failed their type check hold valid defaults here
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _apply_overrides(raw: Mapping[str, Any], pairs: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = json.loads(json.dumps(raw, default=list))  # deep copy of plain data
    problems: list[str] = []
    for dotted, value in pairs.items():
        parts = dotted.split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                problems.append(f"{dotted}: {part!r} is a value, not a section")
                break
            node = nxt
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, source)
    return out


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
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
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value if value is not None else {}, f"{name}.", problems)
            continue
        ok, coerced, expected = _check(hint, value)
        if ok:
            kwargs[key] = coerced
        else:
            problems.append(f"{name}: expected {expected}, got {value!r}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # only reachable if a problem was already recorded
        problems.append(f"{prefix or 'recipe'}: {e}")
        return cls()


def _suggest(key: str, prefix: str, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    return f"; valid keys here: {', '.join(prefix + f for f in fields)}"


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


def _cross_checks(cfg: RunConfig) -> list[str]:
    p: list[str] = []
    positive = {
        "data.seq_len": cfg.data.seq_len,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.grad_accum": cfg.train.grad_accum,
        "adapter.r": cfg.adapter.r,
        "data.num_proc": cfg.data.num_proc,
        "metrics.log_every": cfg.metrics.log_every,
        "train.max_bad_steps": cfg.train.max_bad_steps,
    }
    for key, value in positive.items():
        if value < 1:
            p.append(f"{key}: must be at least 1, got {value}")
    for key, value in {
        "train.max_steps": cfg.train.max_steps,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "train.eval_every": cfg.train.eval_every,
    }.items():
        if value is not None and value < 1:
            p.append(f"{key}: must be at least 1 or null, got {value}")
    if cfg.train.max_steps is None and cfg.train.epochs <= 0:
        p.append(f"train.epochs: must be above 0 when train.max_steps is unset, got {cfg.train.epochs}")
    if cfg.train.lr <= 0:
        p.append(f"train.lr: must be above 0, got {cfg.train.lr}")
    if cfg.train.warmup_steps < 0:
        p.append(f"train.warmup_steps: must be 0 or more, got {cfg.train.warmup_steps}")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        p.append(f"train.min_lr_ratio: must be within [0, 1], got {cfg.train.min_lr_ratio}")
    if not 0.0 <= cfg.adapter.dropout < 1.0:
        p.append(f"adapter.dropout: must be within [0, 1), got {cfg.adapter.dropout}")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        p.append(f"data.eval_fraction: must be within [0, 1), got {cfg.data.eval_fraction}")
    if cfg.checkpoint.keep_last < 2:
        p.append(
            f"checkpoint.keep_last: must be at least 2 so a committed checkpoint always survives, got {cfg.checkpoint.keep_last}"
        )
    if cfg.checkpoint.every_minutes is not None and cfg.checkpoint.every_minutes <= 0:
        p.append(f"checkpoint.every_minutes: must be above 0 or null, got {cfg.checkpoint.every_minutes}")
    from trainer.restart.storage import remote_problems  # the URL rules live with the store

    p += remote_problems(cfg.checkpoint.remote, cfg.checkpoint.storage_options)
    if cfg.train.max_cost is not None and cfg.metrics.price_per_hour is None:
        p.append(
            "train.max_cost: needs metrics.price_per_hour to turn device-hours into cost; set metrics.price_per_hour"
        )
    if cfg.train.mixed_precision == "fp16" and cfg.model.dtype == "bfloat16":
        p.append(
            "train.mixed_precision: fp16 over a bfloat16 base mixes dtypes; use train.mixed_precision=bf16 or model.dtype=float16"
        )
    return p


# ---------------------------------------------------------------------------- output


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def structural_fields(cfg: RunConfig, world_size: int = 1) -> dict[str, Any]:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    a, d, t = cfg.adapter, cfg.data, cfg.train
    return {
        "model.name_or_path": cfg.model.name_or_path,
        "model.revision": cfg.model.revision,
        "model.dtype": cfg.model.dtype,
        "adapter.method": a.method,
        "adapter.quant_bits": a.quant_bits if a.method == "qlora" else None,
        "adapter.r": a.r,
        "adapter.alpha": a.alpha,
        "adapter.target_modules": list(a.target_modules),
        "data.path": d.path,
        "data.format": d.format,
        "data.seq_len": d.seq_len,
        "data.packing": d.packing,
        "global_batch_rows": t.micro_batch_size * t.grad_accum * world_size,
        "train.optimizer": t.optimizer,  # its saved state only loads into the same optimizer
    }


def fingerprint(cfg: RunConfig, world_size: int = 1) -> str:
    """sha256 over the structural fields; equal fingerprints mean a checkpoint fits this run."""
    blob = json.dumps(structural_fields(cfg, world_size), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def diff_structural(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Readable lines `key: old -> new` for every structural field that differs."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def field_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every key, for the README reference and `spotune config`."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(__import__(__name__, fromlist=["x"])))
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                        docs[(node.name, stmt.target.id)] = str(nxt.value.value)
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((prefix + f.name, json.dumps(_plain(default)), docs.get((cls.__name__, f.name), "")))

    walk(RunConfig, "")
    return rows
