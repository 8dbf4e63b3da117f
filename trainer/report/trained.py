"""What was trained: the page's header, from the files a run leaves (read-only, through fsspec).

- the model and adapter: config.yaml (through the config loader, in load.py) and the adapter's
  own adapter_config.json (final/, else the newest checkpoint), whose `target_modules` is the list
  peft resolved (`all-linear` in the recipe becomes the layer names);
- the data: the prepared dataset's manifest.json (sources, examples, rows, tokens, packing
  efficiency), found by the data fingerprint the newest checkpoint's trainer_state.json records,
  under `<run>/data/` or `data.cache_dir`;
- the global batch and library versions: trainer_state.json (the run's own, so a resume on
  another device count shows what it kept);
- the devices: each attempt's ledger row (`device`, `world_size`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec

from trainer.config import ConfigError, RunConfig, batch_split, lora_dropout

ADAPTER_CONFIG = "adapter_config.json"
STATE_FILE = "trainer_state.json"
DATA_MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)$")


@dataclass
class Trained:
    """The raw documents the header is drawn from (each None when the run does not have it)."""

    adapter_config: dict[str, Any] | None = None
    state: dict[str, Any] | None = None
    """The newest checkpoint's trainer_state.json, without its embedded config."""
    manifest: dict[str, Any] | None = None
    dataset_dir: str | None = None
    """URL of the prepared dataset's directory (holds manifest.json and train/)."""
    max_steps: int | None = None
    """`train.max_steps` of the newest checkpoint's config: a resume may have extended the run
    beyond what config.yaml (written at the first start) says."""
    notes: list[str] = field(default_factory=list)


def _json(url: str) -> dict[str, Any] | None:
    try:
        with fsspec.open(url, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def _newest_checkpoint(base: str) -> str | None:
    """URL of the newest committed step directory (a `.tmp-` one is still being written)."""
    fs, path = fsspec.core.url_to_fs(base)
    try:
        found = fs.glob(f"{path}/checkpoints/step-*/{STATE_FILE}")
    except FileNotFoundError:
        return None
    steps = [(int(m.group(1)), p) for p in found if (m := _STEP_DIR.search(p.rsplit("/", 2)[-2]))]
    if not steps:
        return None
    newest = max(steps)[1].rsplit("/", 1)[0]
    return fs.unstrip_protocol(newest) if "://" in base else newest


def load_trained(base: str, config: RunConfig | None) -> Trained:
    out = Trained()
    checkpoint = _newest_checkpoint(base)
    if checkpoint is not None:
        state = _json(f"{checkpoint}/{STATE_FILE}")
        out.state = {k: v for k, v in state.items() if k != "config"} if state else None
        steps = ((state or {}).get("config") or {}).get("train", {}).get("max_steps")
        out.max_steps = int(steps) if isinstance(steps, int) else None
    out.adapter_config = _json(f"{base}/final/{ADAPTER_CONFIG}") or (
        _json(f"{checkpoint}/{ADAPTER_CONFIG}") if checkpoint else None
    )
    fingerprint = (out.state or {}).get("data_fingerprint")
    roots = [f"{base}/data"] + ([config.data.cache_dir] if config is not None and config.data.cache_dir else [])
    for root in roots:
        if fingerprint:
            named = _json(f"{root}/{fingerprint}/{DATA_MANIFEST}")
            found = [(f"{root}/{fingerprint}", named)] if named is not None else []
        else:  # no checkpoint names it: the newest prepared dataset under `root`
            found = sorted(_manifests(root), key=lambda pair: str(pair[1].get("created_utc")), reverse=True)
        if found:
            out.dataset_dir, out.manifest = found[0]
            return out
    out.notes.append(
        "the prepared data's manifest.json was not found (under the run's data/ or data.cache_dir): "
        "rows, tokens and packing efficiency are not shown"
    )
    return out


def _manifests(root: str) -> list[tuple[str, dict[str, Any]]]:
    """(directory, manifest) of every prepared dataset under `root`."""
    fs, path = fsspec.core.url_to_fs(root)
    try:
        found = fs.glob(f"{path}/*/{DATA_MANIFEST}")
    except FileNotFoundError:
        return []
    dirs = [p.rsplit("/", 1)[0] for p in found]
    dirs = [fs.unstrip_protocol(d) if "://" in root else d for d in dirs]
    return [(d, m) for d in dirs if (m := _json(f"{d}/{DATA_MANIFEST}")) is not None]


# ---------------------------------------------------------------------------- the header's rows


@dataclass(frozen=True)
class Fact:
    key: str
    label: str
    text: str


def _int(x: Any) -> str:
    return f"{int(x):,}" if isinstance(x, (int, float)) else "n/a"


def facts(
    config: RunConfig | None,
    trained: Trained,
    attempts: list[tuple[str | None, int, str]],
    run_dir: str | None = None,
) -> list[Fact]:
    """The header, one row per question a reader asks of a run: which model, which adapter, on
    what data, with what batch and schedule, on what machines, in how many attempts.
    `attempts`: (device, device count, exit reason) of each, in order; `run_dir`: the run's directory,
    which local data paths are shown relative to (`shown_path`)."""
    devices = [(name, count) for name, count, _ in attempts]
    rows: list[Fact] = []
    if config is not None:
        m = config.model
        revision = f" @ {m.revision}" if m.revision else ""
        rows.append(Fact("model", "Model", f"{m.name_or_path}{revision} ({m.dtype})"))
        rows.append(Fact("adapter", "Adapter", _adapter_text(config, trained.adapter_config)))
    rows.extend(_data_facts(config, trained.manifest, run_dir))
    if config is not None:
        rows.append(Fact("batch", "Global batch", _batch_text(config, trained.state, devices)))
        t = config.train
        floor = f", down to {t.min_lr_ratio:g}× peak" if t.min_lr_ratio else ""
        rows.append(
            Fact(
                "lr_schedule",
                "Learning rate",
                f"{t.lr:g} peak, {t.schedule} after {t.warmup_steps} warm-up steps{floor}; "
                f"{t.optimizer}, weight decay {t.weight_decay:g}, clip {t.max_grad_norm:g}",
            )
        )
    rows.append(Fact("gpus", "Devices", _devices_text(devices)))
    if attempts:
        ends = ", ".join(reason for _, _, reason in attempts)
        rows.append(Fact("attempts", "Attempts", f"{len(attempts)}: {ends}"))
    versions = (trained.state or {}).get("versions") or {}
    if versions:
        shown = ("torch", "transformers", "peft")
        rows.append(Fact("versions", "Libraries", ", ".join(f"{k} {versions[k]}" for k in shown if k in versions)))
    return rows


def _adapter_text(config: RunConfig, adapter_config: dict[str, Any] | None) -> str:
    a = config.adapter
    kind = f"QLoRA ({a.quant_bits}-bit base)" if a.method == "qlora" else "LoRA"
    targets = (adapter_config or {}).get("target_modules") or list(a.target_modules)
    if isinstance(targets, str):
        targets = [targets]
    return f"{kind}, rank {a.r}, alpha {a.alpha:g}, dropout {lora_dropout(config):g}; targets: {', '.join(sorted(targets))}"


def shown_path(label: str, run_dir: str | None) -> str:
    """A data source as the report shows it: an absolute local path relative to a local run directory
    (a shared report keeps /home/<user>/... out of it), its file name alone beside a remote one (the
    path is another machine's); a hub id, a URL or a relative path as it is."""
    if run_dir is None or not os.path.isabs(label):
        return label
    base = run_dir.removeprefix("file://")
    if "://" in base:  # a bucket: the path was the training machine's
        return f".../{os.path.basename(label)}"
    return os.path.relpath(label, os.path.abspath(base))


def _data_facts(config: RunConfig | None, manifest: dict[str, Any] | None, run_dir: str | None = None) -> list[Fact]:
    seq = f"seq_len {config.data.seq_len}, packing {'on' if config.data.packing else 'off'}" if config else ""
    if manifest is None:
        where = shown_path(config.data.path, run_dir) if config is not None else "unknown"
        return [Fact("data", "Data", f"{where} ({config.data.format}); {seq}" if config else where)]
    sources = manifest.get("sources") or {}
    split = manifest.get("train")
    train: dict[str, Any] = split if isinstance(split, dict) else {}
    # The format prepare read (what `auto` chose) and the chat template it rendered with.
    how = str(train.get("format") or (manifest.get("settings") or {}).get("format"))
    if train.get("chat_template"):
        how = f"{how}, chat template: {train['chat_template']}"
    named = sources.get("train")
    labels = named if isinstance(named, list) else [named]  # a mix of sources, or one
    where = " + ".join(shown_path(str(label), run_dir) for label in labels)
    rows = [
        Fact(
            "data",
            "Data",
            f"{where} ({how})"
            + (f" + eval {shown_path(str(sources['eval']), run_dir)}" if sources.get("eval") else "")
            + f"; {seq}",
        )
    ]
    for split in ("train", "eval"):
        s = manifest.get(split)
        if not isinstance(s, dict):
            continue
        eff = s.get("packing_efficiency")
        base = (s.get("baseline") or {}).get("efficiency")
        lost = sum((s.get("dropped") or {}).values()) if isinstance(s.get("dropped"), dict) else 0
        rows.append(
            Fact(
                f"data_{split}",
                f"{split.capitalize()} split",
                f"{_int(s.get('examples_out'))} examples ({_int(s.get('truncated'))} truncated, {_int(lost)} dropped) "
                f"in {_int(s.get('rows'))} rows; {_int(s.get('real_tokens'))} tokens, {_int(s.get('trainable_tokens'))} "
                "trained"
                + (f"; packing efficiency {eff:.1%}" if isinstance(eff, float) else "")
                + (f" (padded batches: {base:.1%})" if isinstance(base, float) else ""),
            )
        )
    return rows


def _batch_text(config: RunConfig, state: dict[str, Any] | None, devices: list[tuple[str | None, int]]) -> str:
    saved = ((state or {}).get("structural") or {}).get("global_batch_rows")
    world = devices[-1][1] if devices else 1
    try:
        rows = int(saved) if saved else batch_split(config.train, world).global_rows
    except ConfigError:  # `auto` micro-batch without a checkpoint: the run chose it at start
        return f"micro-batch {config.train.micro_batch_size}, decided at start"
    return f"{rows:,} rows × {config.data.seq_len:,} tokens = {rows * config.data.seq_len:,} tokens per step"


def _devices_text(devices: list[tuple[str | None, int]]) -> str:
    if not devices:
        return "no ledger rows"
    seen: dict[tuple[str, int], int] = {}
    for name, count in devices:
        key = (name or "not recorded", count)
        seen[key] = seen.get(key, 0) + 1
    return "; ".join(f"{count} × {name}" + (f" ({n} attempts)" if n > 1 else "") for (name, count), n in seen.items())
