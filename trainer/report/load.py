"""Read a run directory (a local path or an fsspec URL) into typed records, without writing to it.

The report only reads: `config.yaml`, `metrics.jsonl`, `ledger.jsonl`, `ledger.current.json`
(the heartbeat of an attempt that has not closed: running, or killed and not yet recovered),
and, when present, `pilot/pilot.json` and `estimate.json`. Everything goes through
`fsspec.open`, so `s3://bucket/run`, `gs://...` or `file:///...` read the same files that
`checkpoint.remote` mirrors. A run being written is fine: a torn last line is skipped.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import fsspec
import yaml

from trainer.config import ConfigError, RunConfig, from_dict
from trainer.exit_codes import EXIT_BAD_INPUT
from trainer.report.example import Example, training_example
from trainer.report.trained import Trained, load_trained
from trainer.restart.books.ledger import (
    HEARTBEAT_FILE,
    LEDGER_FILE,
    attempt_key,
    chronological,
    row_from_progress,
    row_time,
)
from trainer.restart.store.generations import read_run_file
from trainer.urls import redact

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
PILOT_FILE = "pilot/pilot.json"  # where `spotune pilot` writes (trainer/plan/pilot.py: pilot_dir)
REPORT_FILE = "report.html"
ESTIMATE_FILE = "estimate.json"  # `spotune estimate --json > RUN_DIR/estimate.json`, if the user kept one
RUNNING = "running"
"""Exit reason of the attempt described by the heartbeat: it has not written its ledger row."""


class ReportError(Exception):
    """A run directory the report cannot read; the message names the path and what to do."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True)
class Attempt:
    """One process of the run: a `ledger.jsonl` row, or the heartbeat of the one still open."""

    attempt: int
    start: float  # Unix seconds (the ledger keeps whole seconds)
    end: float
    world_size: int
    exit_reason: str
    device_seconds: float
    startup_seconds: float
    productive_seconds: float
    checkpoint_seconds: float
    lost_seconds: float
    cost: float | None
    last_step: int | None
    device: str | None = None
    """What it ran on (`NVIDIA H100 80GB HBM3`, `cpu`); rows written before the ledger kept it have none."""
    resumed_from: int | None = None
    """The step its training started from (the checkpoint's, 0 without one); None: it never started
    training, or its row predates the field."""
    end_is_last_heartbeat: bool = False
    """Booked by a later attempt from its heartbeat (it was killed): `end` is its last sign of life, so its
    hours are a lower bound."""

    @property
    def running(self) -> bool:
        return self.exit_reason == RUNNING

    @property
    def price_per_device_second(self) -> float | None:
        if self.cost is None or self.device_seconds <= 0:
            return None
        return self.cost / self.device_seconds

    @classmethod
    def from_row(cls, row: dict[str, Any], exit_reason: str | None = None) -> Attempt:
        return cls(
            attempt=int(row["attempt"]),
            start=row_time(row["start"]),
            end=row_time(row["end"]),
            world_size=int(row.get("world_size", 1)),
            exit_reason=exit_reason or str(row.get("exit_reason", "unknown")),
            device_seconds=float(row["device_seconds"]),
            startup_seconds=float(row.get("startup_seconds", 0.0)),
            productive_seconds=float(row.get("productive_seconds", 0.0)),
            checkpoint_seconds=float(row.get("checkpoint_seconds", 0.0)),
            lost_seconds=float(row.get("lost_seconds", 0.0)),
            cost=float(row["cost"]) if row.get("cost") is not None else None,
            last_step=int(row["last_step"]) if row.get("last_step") is not None else None,
            device=str(row["device"]) if row.get("device") else None,
            resumed_from=int(row["resumed_from"]) if row.get("resumed_from") is not None else None,
            end_is_last_heartbeat=bool(row.get("end_is_last_heartbeat")),
        )


@dataclass
class RunData:
    """Everything the report shows, as read."""

    source: str
    """The run directory as shown to people (credentials and query strings removed)."""
    config: RunConfig | None
    """The run's config.yaml, loaded as the run loaded it (None when missing or unreadable)."""
    train_rows: list[dict[str, Any]]
    """metrics rows of optimizer steps (they have `loss`), in file order; redone steps repeat."""
    eval_rows: list[dict[str, Any]]
    attempts: list[Attempt]
    pilot: dict[str, Any] | None = None
    estimate: dict[str, Any] | None = None
    heartbeat_time: float | None = None
    trained: Trained = field(default_factory=Trained)
    """Adapter config, checkpoint state and data manifest: what the header says was trained."""
    example: Example | None = None
    """The first document of the first packed row, trained tokens marked (local runs)."""
    notes: list[str] = field(default_factory=list)
    """Lines skipped and why (a torn last line while the run writes)."""

    @property
    def price_per_hour(self) -> float | None:
        price = self.config.metrics.price_per_hour if self.config is not None else None
        return float(price) if price is not None else None

    @property
    def total_steps(self) -> int | None:
        """`train.max_steps`: the newest checkpoint's (a resume may extend the run), else config.yaml's."""
        steps = self.config.train.max_steps if self.config is not None else None
        steps = self.trained.max_steps or steps
        return int(steps) if steps is not None else None


def load_run(run_dir: str, *, example: bool = True) -> RunData:
    """Read `run_dir`; ReportError when it holds neither metrics.jsonl nor a ledger. `example`: decode the
    training example the report page shows (a tokenizer: transformers and torch, 3 s of CPU `status` skips)."""
    base = run_dir.rstrip("/")
    where = redact(base)
    texts = {name: _read(f"{base}/{name}") for name in (METRICS_FILE, LEDGER_FILE, HEARTBEAT_FILE)}
    if all(t is None for t in texts.values()):
        fs, path = fsspec.core.url_to_fs(base)
        what = "exists but holds" if fs.isdir(path) else "does not exist, so it has"
        raise ReportError(
            f"{where} {what} no {METRICS_FILE}, {LEDGER_FILE} or {HEARTBEAT_FILE}: give the output_dir of a run "
            "(the recipe's `output_dir`, e.g. runs/tiny-cpu), or its checkpoint.remote URL"
        )
    notes: list[str] = []
    metrics = _jsonl(texts[METRICS_FILE], f"{where}/{METRICS_FILE}", notes)
    rows = chronological(_jsonl(texts[LEDGER_FILE], f"{where}/{LEDGER_FILE}", notes))
    attempts = [Attempt.from_row(r) for r in rows]  # in the order they ran; the open one (its heartbeat) last
    heartbeat_time = None
    if texts[HEARTBEAT_FILE]:
        try:
            progress = json.loads(texts[HEARTBEAT_FILE] or "")
            heartbeat_time = float(progress["heartbeat_time"])
            # keep_all: the open attempt's step time counts as productive so far (Ledger.totals does the same)
            # `ending`: training is over and the process is writing final/ or this report.
            live = Attempt.from_row(
                row_from_progress(progress, heartbeat_time, keep_all=True), progress.get("ending") or RUNNING
            )
            # Else closed between our two reads; told apart by id: diverged disks number attempts alike.
            if attempt_key(progress) not in {attempt_key(r) for r in rows}:
                attempts.append(live)
        except (ValueError, KeyError, TypeError) as e:
            notes.append(f"{where}/{HEARTBEAT_FILE} is unreadable ({e}); the open attempt is not shown")
    config = read_config(base, notes)
    trained = load_trained(base, config)
    notes.extend(trained.notes)
    local = "://" not in base or base.startswith("file://")
    tokenizers = [
        f"{base.removeprefix('file://')}/final",
        str((trained.manifest or {}).get("sources", {}).get("tokenizer")),
    ]
    return RunData(
        source=where,
        config=config,
        train_rows=[_floats(r) for r in metrics if "loss" in r and "step" in r],
        eval_rows=[_floats(r) for r in metrics if "eval_loss" in r and "step" in r],
        attempts=attempts,
        pilot=_json(f"{base}/{PILOT_FILE}", notes),
        estimate=_json(f"{base}/{ESTIMATE_FILE}", notes),
        heartbeat_time=heartbeat_time,
        trained=trained,
        example=training_example(trained.dataset_dir, tokenizers, notes) if local and example else None,
        notes=notes,
    )


# ---------------------------------------------------------------------------- readers


def read_config(run_dir: str, notes: list[str] | None = None) -> RunConfig | None:
    """The run's config.yaml (a local path or an fsspec URL) through the config loader; None when it has
    none, or it does not load (said in `notes`)."""
    base = run_dir.rstrip("/")
    return _config(_read(f"{base}/{CONFIG_FILE}"), f"{redact(base)}/{CONFIG_FILE}", [] if notes is None else notes)


def _config(text: str | None, where: str, notes: list[str]) -> RunConfig | None:
    """config.yaml through the config loader, so its defaults and types are the run's own."""
    if not text:
        return None
    try:
        raw = yaml.safe_load(text)
        return from_dict(raw if isinstance(raw, dict) else {}, source=where)
    except (yaml.YAMLError, ConfigError) as e:
        notes.append(f"{where} does not load ({str(e).splitlines()[0]}); price and total steps are not shown")
        return None


def _read(url: str) -> str | None:
    """A run file's text as readers see it: in a store, every lease generation's rows merged for the
    ledger and the metrics, the newest copy for the others (trainer/restart/store/generations.py)."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        body = read_run_file(fs, path)
        return None if body is None else body.decode("utf-8")
    except FileNotFoundError:
        return None


def _jsonl(text: str | None, where: str, notes: list[str]) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn line (a write in flight, or a kill) is skipped with a note."""
    rows: list[dict[str, Any]] = []
    for n, line in enumerate((text or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            notes.append(f"{where} line {n} is not complete JSON (a write in flight or a kill); skipped")
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _json(url: str, notes: list[str]) -> dict[str, Any] | None:
    text = _read(url)
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        notes.append(f"{redact(url)} is not valid JSON ({e}); not shown")
        return None
    return doc if isinstance(doc, dict) else None


def _floats(row: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl writes a non-finite float as a string ("nan", "inf"): read it back as a float."""
    out = dict(row)
    for k, v in row.items():
        if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
            out[k] = float(v)
    return out


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
