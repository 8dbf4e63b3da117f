"""Where planning meets the run: the estimate of a RunConfig (`estimate_for_run`, what
`spotune estimate` prints, trainer/cli/estimate.py).

The rest of trainer/plan/ takes numbers and config sections; this module is where the world is read for
it: the model's config.json, the data or its prepared manifest, pilot.json, the catalogue
file, and what the run's output_dir and this machine already hold (a data cache, the model in
the Hugging Face cache, the run's ledger of earlier attempts). trainer/cli/pilot_run.py starts
the pilot, which is a real training run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer import builtin_assets
from trainer import catalog as cat
from trainer.config import BUILTIN_TINY_DATA, BUILTIN_TINY_MODEL, RunConfig
from trainer.data import DataError
from trainer.data.cache import data_cache_root
from trainer.model import flops
from trainer.plan import PlanError, pilot
from trainer.plan import timeline as tl
from trainer.plan import workload as wl
from trainer.plan.estimate import estimate
from trainer.plan.fit import NO_DATA, memory_fit
from trainer.plan.job import Constraints, Job, Measured
from trainer.plan.throughput import choose
from trainer.restart.books.ledger import read_rows, row_time
from trainer.training.inputs import prepares_pairs, tokenizer_path


def estimate_for_run(
    cfg: RunConfig,
    *,
    throughput: float | None = None,
    pilot_json: Path | None = None,
    gpus: int = 1,
    deadline_hours: float | None = None,
    budget: float | None = None,
    catalog_path: Path | None = None,
    gpu: str | None = None,
    mfu: float | None = None,
    manifest: dict[str, Any] | None = None,
    sample_size: int = 2000,
    download_mb_s: float | None = None,
    vm_start_seconds: float | None = None,
    tokens: float | None = None,
    data_given: bool = True,
    mtbi_hours: list[str] | None = None,
) -> dict[str, Any]:
    """The estimate of the run `cfg` describes (schema `spotune.estimate/1`), for its own
    output_dir: what that directory and this machine already hold decides the fixed costs.
    `tokens`: the data's real tokens per epoch, in place of reading the data; without either (the
    data cannot be read, or `data_given` is false: the user named none), the memory fit alone
    (trainer/plan/fit.py), naming what the hours and the cost need. `mtbi_hours`: `--mtbi-hours` values
    (`H` for every GPU, `GPU=H` for one) over the catalogue's interruption rates."""
    constraints = Constraints(gpus=gpus, gpu=gpu, deadline_hours=deadline_hours, budget=budget)
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    try:
        catalog = cat.with_mtbi(cat.load_catalog(catalog_path), mtbi_hours or [])
    except cat.CatalogError as e:
        raise PlanError(str(e)) from None
    model = builtin_assets.resolve_model(cfg.model.name_or_path)
    job, bytes_per_param = _job(cfg, model)
    shape = job.shape
    how = _auto_choice(cfg, job, gpus)
    measured = _read_pilot(Path(pilot_json)) if pilot_json else None
    if manifest is None and measured is not None:
        manifest = _pilot_manifest(cfg, measured)  # the data the pilot prepared, when it is this run's
    if tokens is not None and tokens < 1:
        raise PlanError(f"--tokens must be at least 1, got {tokens:g}")
    rate = choose(cfg.adapter.method, measured, throughput, cfg.metrics.gpu, mfu)
    if not data_given and not tokens:
        return memory_fit(job, catalog, constraints, NO_DATA, rate, how)
    try:
        work = wl.from_tokens(tokens, cfg.data.seq_len) if tokens else _workload(cfg, manifest, sample_size)
    except DataError as e:
        if _data_at_hand(cfg):
            raise  # the data is there and has a problem: its message names the fix
        return memory_fit(job, catalog, constraints, str(e), rate, how)
    target = _target(cfg, model, shape.total_params() * bytes_per_param, work, download_mb_s, vm_start_seconds)
    return estimate(job, work, rate, catalog, constraints, Measured(measured), target, how)


def _auto_choice(cfg: RunConfig, job: Job, gpus: int) -> Any:
    """What the recipe's `auto` memory settings choose on a fresh GPU of a given size: the run's own rule
    (trainer/training/autofit.py), so the estimate names the setting each GPU would train with."""
    from trainer.plan.memory import GIB
    from trainer.training import autofit

    shards = gpus if job.fsdp else 1

    def how(memory_gib: float) -> dict[str, Any] | None:
        choice = autofit.choice_on(cfg, job.shape, memory_gib * GIB, gpus, shards)
        if choice is None:
            return None
        return {"setting": choice.setting.describe(), "gib": choice.estimate.total / GIB, "fits": choice.fits}

    return how


def longest_for_run(
    cfg: RunConfig, *, gpus: int = 1, gpu: str | None = None, catalog_path: Path | None = None, mfu: float | None = None
) -> dict[str, Any]:
    """The longest one-document row of `cfg`'s model and settings per catalogue GPU (trainer/plan/longest.py)."""
    from trainer.plan.longest import longest_rows

    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    try:
        catalog = cat.load_catalog(catalog_path)
        chosen = [cat.find_gpu(gpu, catalog)] if gpu is not None else catalog
    except cat.CatalogError as e:
        raise PlanError(str(e)) from None
    assumed = choose(cfg.adapter.method, None, None, None, mfu).assumed_mfu  # --mfu checked as the estimate does
    job, _ = _job(cfg, builtin_assets.resolve_model(cfg.model.name_or_path))
    return longest_rows(job, chosen, gpus, assumed)


def _job(cfg: RunConfig, model: str) -> tuple[Job, int]:
    """What the estimate is asked about, and the bytes per parameter of the model's published weights."""
    shape, hf_name, bytes_per_param = _shape(cfg, model)
    job = Job(
        name_or_path=cfg.model.name_or_path,
        shape=shape,
        hf_model_type=hf_name,
        model=cfg.model,
        adapter=cfg.adapter,
        train=cfg.train,
        checkpoint=cfg.checkpoint,
        seq_len=cfg.data.seq_len,
        price_per_hour=cfg.metrics.price_per_hour,
    )
    return job, bytes_per_param


def pilot_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output_dir) / "pilot"


# ---------------------------------------------------------------------------- reading the world


def _shape(cfg: RunConfig, path: str) -> tuple[flops.ModelShape, str, int]:
    """The model's shape from a local path, a shipped config.json (trainer/plan/models/), or the
    hub's config.json alone (no weights); with the bytes per parameter of its published weights."""
    from trainer.plan.models import load_config

    hf = load_config(path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    text = hf.get_text_config()  # a vision-language model (Gemma 3 4B+) is planned for its language model
    dtype = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "bfloat16")
    return flops.model_shape(text), str(getattr(hf, "model_type", "")), 4 if "float32" in dtype else 2


def _read_pilot(path: Path) -> dict[str, Any]:
    try:
        p = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--pilot {path}: cannot read it ({e}); run `spotune pilot` with the recipe") from None
    if p.get("schema") != pilot.PILOT_SCHEMA:
        raise PlanError(
            f"--pilot {path}: written by another spotune version (schema {p.get('schema')!r}, this one reads "
            f"{pilot.PILOT_SCHEMA!r}); run `spotune pilot` again"
        )
    return p


def _target(
    cfg: RunConfig,
    model: str,
    model_bytes: float,
    work: wl.Workload,
    download_mb_s: float | None,
    vm_start_seconds: float | None,
) -> tl.Target:
    """What `cfg.output_dir` and this machine already hold, and what this run's ledger measured."""
    for name, value in (("--download-mb-s", download_mb_s), ("--vm-start-seconds", vm_start_seconds)):
        if value is not None and value <= 0:
            raise PlanError(f"{name} must be above 0, got {value}")
    rows = read_rows(cfg.output_dir)
    resumed = [r for r in rows if "restore" in (r.get("phases") or {})]
    restarts = [float(r["startup_seconds"]) / int(r.get("world_size", 1)) for r in resumed]
    gaps = [
        row_time(b["start"]) - row_time(a["end"])
        for a, b in zip(rows, rows[1:], strict=False)
        if a.get("exit_reason") in ("preempted", "killed") and row_time(b["start"]) > row_time(a["end"])
    ]
    return tl.Target(
        data_cached=_data_cached(cfg),
        prepare_seconds=work.prepare_seconds,
        model_local=Path(model).is_dir(),
        model_cached=_in_hf_cache(model, cfg.model.revision),
        model_bytes=model_bytes,
        download_bytes_per_s=(download_mb_s or tl.DEFAULT_DOWNLOAD_MB_S) * 1e6,
        download_given=download_mb_s is not None,
        vm_start_seconds=vm_start_seconds or tl.DEFAULT_VM_START_S,
        vm_start_given=vm_start_seconds is not None,
        remote=cfg.checkpoint.remote is not None,
        restarts=restarts,
        restart_compiles=[float(r["phases"]["compile"]) for r in resumed if "compile" in r["phases"]],  # model.compile
        gaps=gaps,
    )


def fingerprint(cfg: RunConfig) -> str | None:
    """The content fingerprint `train` would look its prepared data up by (None: no data file)."""
    import dataclasses

    from trainer.data.prepare import data_fingerprint

    data = dataclasses.replace(cfg.data, path=builtin_assets.resolve_data(cfg.data.path))
    try:
        return data_fingerprint(data, tokenizer_path(cfg), cfg.seed, pairs=prepares_pairs(cfg))
    except Exception:  # the data is not there yet: nothing can be cached
        return None


def _data_cached(cfg: RunConfig) -> bool:
    """The target's cache holds this data's content fingerprint (what `train` would reuse)."""
    from trainer.data.cache import MANIFEST

    fp = fingerprint(cfg)
    return fp is not None and (data_cache_root(cfg.data.cache_dir, cfg.output_dir) / fp / MANIFEST).is_file()


def _pilot_manifest(cfg: RunConfig, measured: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of the data the pilot trained on, if this run's data has the same fingerprint:
    exact token counts for a run in a directory that has not prepared its data yet."""
    path = measured.get("data_manifest")
    if not path or not Path(path).is_file():
        return None
    m = json.loads(Path(path).read_text())
    return m if m.get("fingerprint") == fingerprint(cfg) else None


def _data_at_hand(cfg: RunConfig) -> bool:
    """The recipe's data is a local path that exists (a problem reading it is then the data's own)."""
    return Path(builtin_assets.resolve_data(cfg.data.path)).exists()


def _in_hf_cache(model: str, revision: str | None) -> bool:
    if Path(model).is_dir():
        return False
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached (or not a hub id)
        return False
    return any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def _workload(cfg: RunConfig, manifest: dict[str, Any] | None, sample_size: int) -> wl.Workload:
    if manifest is not None:
        return wl.from_manifest(manifest)
    data_path = builtin_assets.resolve_data(cfg.data.path)
    pairs = prepares_pairs(cfg)
    found = wl.find_manifest(cfg.data, data_path, data_cache_root(cfg.data.cache_dir, cfg.output_dir), pairs)
    if found is not None:
        return wl.from_manifest(*found)
    tok = cfg.data.tokenizer or builtin_assets.resolve_model(cfg.model.name_or_path)
    if cfg.data.tokenizer is None and cfg.data.path == BUILTIN_TINY_DATA and not Path(tok).exists():
        # `spotune estimate <hub id>` plans on the built-in demo data: count it with the demo
        # tokenizer it was made with, so planning needs no tokenizer download either.
        tok = builtin_assets.resolve_model(BUILTIN_TINY_MODEL)
    return wl.from_sample(cfg.data, data_path, tok, sample_size=sample_size, seed=cfg.seed, pairs=pairs)
