"""Every second of an attempt that is not an optimizer step, itemised, each with its source.

A `spotune train` process pays, in order: interpreter start and imports; the base model's
download (only where it is not on disk yet); loading it and wrapping the adapter; preparing
the data (or a cache hit, when the target directory already holds the data's fingerprint); the
rest of the set-up; the slower first steps (warm-up; with `model.compile`, compiling, an item of
its own); then the steps, evaluations and
checkpoint saves (estimate.py counts those: they scale with the run); then writing final/,
flushing the last upload, the report, and interpreter exit.

A spot interruption costs a new machine, the same start-up on an empty disk (download, load,
prepare), the checkpoint's download and restore, the warm-up again, compiling again (with the
compiled artifacts the checkpoint carries: a fraction of the first time, docs/compile.md), and the work redone since
the last checkpoint (forecast.py adds that). Where the run's own ledger has measured restarts,
they replace the itemised guess.

Every item names its source: `pilot` (measured by `spotune pilot` on this device), `manifest`
(recorded when the data was prepared), `ledger` (this run's earlier attempts), or `assumed`
with the assumption and the flag that replaces it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.restart.local.checkpoint import save_step_due, save_time_due

DEFAULT_DOWNLOAD_MB_S = 200.0
"""A cloud VM pulling from the Hugging Face Hub or an object store in its region (measure
yours: `--download-mb-s`)."""
DEFAULT_VM_START_S = 180.0
"""Requesting, booting and pulling the image of a replacement GPU VM (`--vm-start-seconds`)."""
COMPILE_FIRST = "torch.compile from scratch (model.compile)"
COMPILE_RESUMED = "torch.compile with the saved artifacts"
DEFAULT_STARTUP_S = 30.0
"""Start-up and teardown of one process without a pilot to measure them, besides loading the weights:
interpreter, torch and transformers imports, CUDA context, the optimizer and loader set-up, exit."""
DEFAULT_LOAD_MB_S = 1000.0
"""Loading the base model's weights from a local disk onto the device (safetensors, memory-mapped)."""


@dataclass(frozen=True)
class Item:
    name: str
    seconds: float
    source: str


@dataclass(frozen=True)
class Target:
    """What the machine and directory the run will use already hold (read by trainer/cli/world.py)."""

    data_cached: bool = False
    """The target's data cache holds this data's fingerprint: a cache hit, no preparation."""
    prepare_seconds: float | None = None
    """The preparation time a manifest of this data recorded (None: never prepared)."""
    model_local: bool = True
    """model.name_or_path is a local directory (on a new machine too: its image or volume)."""
    model_cached: bool = False
    """A hub id already in this machine's Hugging Face cache (a new machine downloads it)."""
    model_bytes: float = 0.0
    """What a download of the base model fetches."""
    download_bytes_per_s: float = DEFAULT_DOWNLOAD_MB_S * 1e6
    download_given: bool = False
    vm_start_seconds: float = DEFAULT_VM_START_S
    vm_start_given: bool = False
    remote: bool = False
    """checkpoint.remote is set: a new machine downloads the checkpoint from the store."""
    restarts: Sequence[float] = field(default_factory=tuple)
    """Start-up seconds of this run's attempts that resumed (its ledger), for measured restarts."""
    restart_compiles: Sequence[float] = field(default_factory=tuple)
    """Compile seconds of this run's resumed attempts (their ledger's `compile` phase), for measured restarts."""
    gaps: Sequence[float] = field(default_factory=tuple)
    """Seconds between an attempt's end and the next one's start (its ledger): machine replacement."""

    def download_source(self) -> str:
        mb_s = self.download_bytes_per_s / 1e6
        return f"--download-mb-s {mb_s:g}" if self.download_given else f"assumed {mb_s:g} MB/s (--download-mb-s)"


def attempt_items(pilot: dict[str, Any] | None, target: Target) -> list[Item]:
    """The fixed costs of one fresh `spotune train` process on the pilot's device."""
    items = [_fetch(target, "base model download")]
    if pilot is None:
        load = target.model_bytes / (DEFAULT_LOAD_MB_S * 1e6)
        items.append(
            Item(
                "start-up and teardown",
                DEFAULT_STARTUP_S + load,
                f"assumed: {DEFAULT_STARTUP_S:g} s of imports, set-up and exit + {target.model_bytes / 1e9:.3g} GB of "
                f"weights loaded at {DEFAULT_LOAD_MB_S:g} MB/s (no pilot; `spotune pilot` measures)",
            )
        )
        items.append(_data(None, target))
        return [i for i in items if i.seconds or i.source.startswith("assumed")]
    f = pilot["fixed"]
    measured = _measured(f)
    items = [measured("imports", "interpreter start and imports"), *items]
    if target.remote or (f.get("store") or 0) > 0.01:
        items.append(measured("store", "checkpoint store connect"))
    items += [
        measured("model", "model load and adapter"),
        _data(f, target),
        measured("setup", "other set-up (optimizer, sampler, loader)"),
        measured("warmup_extra", "warm-up steps beyond the sustained rate"),
        *([measured("compile", COMPILE_FIRST)] if f.get("compile") is not None else []),
        measured("final", "write final/ (adapter + tokenizer)"),
        measured("flush", "last upload flush"),
        measured("report", "report page"),
        measured("exit", "interpreter exit"),
    ]
    return items


def restart_items(pilot: dict[str, Any] | None, target: Target, checkpoint_bytes: float | None) -> list[Item]:
    """What one spot interruption costs before training goes on (redone work not included)."""
    if target.gaps:
        vm = Item(
            "replacement machine", statistics.median(target.gaps), f"ledger: {len(target.gaps)} gap(s) between attempts"
        )
    else:
        how = (
            f"--vm-start-seconds {target.vm_start_seconds:g}"
            if target.vm_start_given
            else "assumed (--vm-start-seconds)"
        )
        vm = Item("replacement machine", target.vm_start_seconds, how)
    if target.restarts:
        n = len(target.restarts)
        measured = [
            vm,
            Item("start-up with resume", statistics.median(target.restarts), f"ledger: {n} measured restart(s)"),
        ]
        if c := target.restart_compiles:  # model.compile: in the first steps, after the start-up
            measured.append(Item(COMPILE_RESUMED, statistics.median(c), f"ledger: {len(c)} resumed attempt(s)"))
        return measured
    fresh_disk = Target(**{**asdict(target), "data_cached": False, "model_cached": False})
    items = [vm, _fetch(fresh_disk, "base model download (empty disk)")]
    restart = (pilot or {}).get("restart")
    if pilot is None or restart is None:
        start = sum(i.seconds for i in attempt_items(pilot, fresh_disk) if "download" not in i.name)
        items.append(Item("start-up (as a fresh process)", start, "pilot" if pilot else "assumed (no pilot)"))
    else:
        data_hit = (pilot["fixed"].get("data_cache_hit") or 0.0) if restart.get("data_reused") else 0.0
        items += [
            Item("start-up with resume (imports, load, restore)", restart["startup_seconds"] - data_hit, "pilot"),
            _cold_item(restart),
            _data(pilot["fixed"], fresh_disk),
            Item("warm-up steps beyond the sustained rate", restart["warmup_extra_seconds"], "pilot"),
            *_compile_item(restart),
        ]
    if target.remote and checkpoint_bytes:
        items.append(
            Item("checkpoint download", checkpoint_bytes / target.download_bytes_per_s, target.download_source())
        )
    return items


def _compile_item(restart: dict[str, Any]) -> list[Item]:
    """model.compile in a resumed attempt: the pilot's second process, which loaded the first
    one's compiled artifacts (or says why not)."""
    seconds = restart.get("compile_seconds")
    if seconds is None:
        return []
    outcome = str(restart.get("compile_cache") or "not recorded")
    return [Item(COMPILE_RESUMED, float(seconds), f"pilot: compiled artifacts {outcome.split(':')[0]}")]


def _cold_item(restart: dict[str, Any]) -> Item:
    """What a cold page cache added to the pilot's first process: a replacement machine pays it."""
    name = "cold page cache (a new machine's first process)"
    extra = restart.get("cold_start_extra_seconds")
    if extra is None:
        return Item(name, 0.0, "not measured (a pilot.json from before spotune measured it)")
    if extra:
        return Item(name, extra, "pilot: its first process over its second")
    return Item(name, 0.0, "pilot: its first process loaded warm (a machine that ran spotune before)")


def total(items: Sequence[Item]) -> float:
    return sum(i.seconds for i in items)


def as_dicts(items: Sequence[Item]) -> list[dict[str, Any]]:
    return [asdict(i) for i in items]


def save_count(steps: int, every_steps: int | None, every_minutes: float | None, step_seconds: float) -> int:
    """Checkpoints the loop writes: at each `every_steps` step, when `every_minutes` passed since
    the last save, and at the end: the loop's own rules (restart.local.checkpoint.save_step_due / save_time_due)."""
    saves, since = 0, 0.0
    for step in range(1, steps + 1):
        since += step_seconds
        if save_step_due(step, every_steps, steps) or save_time_due(since, every_minutes):
            saves, since = saves + 1, 0.0
    return saves


# ---------------------------------------------------------------------------- pieces


def _measured(fixed: dict[str, Any]) -> Any:
    def item(key: str, name: str) -> Item:
        value = fixed.get(key)
        if value is None:
            return Item(name, 0.0, "not measured (pilot run in-process)" if key == "exit" else "not measured")
        return Item(name, float(value), "pilot")

    return item


def _fetch(target: Target, name: str) -> Item:
    if target.model_local:
        return Item(name, 0.0, "local path")
    if target.model_cached:
        return Item(name, 0.0, "in this machine's Hugging Face cache")
    return Item(name, target.model_bytes / target.download_bytes_per_s, target.download_source())


def _data(fixed: dict[str, Any] | None, target: Target) -> Item:
    """A cache hit or a preparation, whichever the target directory will see."""
    fixed = fixed or {}
    hit, prepare = fixed.get("data_cache_hit"), fixed.get("data_prepare")
    if target.data_cached:
        if hit is not None:
            return Item("data: cache hit", hit, "pilot")
        if prepare is not None and target.prepare_seconds is not None:
            # The pilot prepared; a hit is that phase without the preparation the manifest timed.
            return Item("data: cache hit", max(0.0, prepare - target.prepare_seconds), "pilot less manifest")
        return Item("data: cache hit", 0.0, "not measured")
    if prepare is not None:
        return Item("data: prepare (no cache in the target directory)", prepare, "pilot")
    if target.prepare_seconds is not None:
        return Item(
            "data: prepare (no cache in the target directory)",
            (hit or 0.0) + target.prepare_seconds,
            "manifest (recorded when the cache was built)",
        )
    return Item("data: prepare", 0.0, "unknown (`spotune prepare` records it)")
