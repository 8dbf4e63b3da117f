"""What a run reads, resolved from its config: the base model's path, the tokenizer's, the packed data
(pairs for a preference objective), the adapter it starts from (`adapter.init_from`).

The built-in assets (`builtin:tiny-llama`, `builtin:tiny-instruct`) resolve to files built offline
(trainer/builtin_assets.py); data preparation is cached by content (trainer/data/cache.py). A hub
dataset is read at the commit the run's first start resolved it to (`pin_data`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer import builtin_assets
from trainer import config as C
from trainer.atomic import write_text
from trainer.data.cache import data_cache_root, in_turns

if TYPE_CHECKING:
    from trainer.model.reference import InitAdapter
    from trainer.training.process import Process


def model_path(cfg: C.RunConfig) -> str:
    return builtin_assets.resolve_model(cfg.model.name_or_path)


def tokenizer_path(cfg: C.RunConfig) -> str:
    """The tokenizer's local folder: `data.tokenizer` or the model's, a hub id's files fetched at the
    revision the weights load at (trainer/data/tokenizer.py, `revision_of`)."""
    from trainer.data.tokenizer import local_dir, revision_of

    d, m = cfg.data, cfg.model
    key = "data.tokenizer" if d.tokenizer else "model.name_or_path"
    return local_dir(
        d.tokenizer or model_path(cfg), revision_of(d.tokenizer, d.tokenizer_revision, m.name_or_path, m.revision), key
    )


def pin_data(cfg: C.RunConfig, is_main: bool = True) -> C.RunConfig:
    """`cfg` with every hub dataset's revision a commit: the one the run directory's config.yaml
    holds (written on the run's first start; on a fresh machine fetched from checkpoint.remote
    before this runs), else the one the hub names now. Rank 0 resolves; every rank gets its answer
    (or its failure: trainer/restart/agree.py), so all nodes read the same commit. The pinned config is what config.yaml and every checkpoint
    record (trainer/training/run.py writes them)."""
    from trainer.data.sources import pin_revisions
    from trainer.restart import agree  # here: `spotune prepare` needs no torch

    def pin() -> C.RunConfig:
        saved = saved_config(Path(cfg.output_dir))
        data, notes = pin_revisions(cfg.data, saved.data if saved is not None else None)
        data = dataclasses.replace(data, template_date=_template_date(cfg.data, saved))
        for note in notes:
            print(f"spotune: {note}", flush=True)
        return dataclasses.replace(cfg, data=data)

    # A hub that fails rank 0 fails every rank with its exit code (none waits for an answer that never comes).
    return agree.on_rank0(pin, is_main, "pin the hub datasets")


def _template_date(data: C.DataConfig, saved: C.RunConfig | None) -> str:
    """`data.template_date` as set, else the day of the run's first start (its config.yaml), else today:
    a chat template that writes the day renders every restart's rows as the first start did."""
    if data.template_date is not None:
        return data.template_date
    if saved is not None and saved.data.template_date is not None:
        return saved.data.template_date
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def saved_config(run_dir: Path) -> C.RunConfig | None:
    """The run's config.yaml as its first start wrote it, read through the config loader; None if absent."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return C.from_dict(yaml.safe_load(path.read_text()) or {}, source=str(path))
    except (C.ConfigError, yaml.YAMLError) as e:  # written by another spotune version: nothing to pin from
        print(f"spotune: {path} does not load ({str(e).splitlines()[0]}); hub datasets resolve anew", flush=True)
        return None


def resolved_data(cfg: C.RunConfig) -> C.DataConfig:
    """`cfg.data` with the built-in dataset names (`builtin:...`) turned into their files."""
    d = cfg.data
    sources = tuple(dataclasses.replace(s, path=builtin_assets.resolve_data(s.path)) for s in d.sources)
    return dataclasses.replace(d, path=builtin_assets.resolve_data(d.path), sources=sources)


def prepares_pairs(cfg: C.RunConfig) -> bool:
    """Whether the run trains on preference pairs (and its data is prepared as pairs)."""
    return cfg.train.objective != "sft"


def prepare_data(cfg: C.RunConfig, progress: bool = True, full: bool = True) -> Any:
    """Prepare (or reuse) the packed dataset of `cfg`. `progress`: print its summary (the full report;
    with `full=False`, a reused dataset's counts and what seq_len loses) and, on a terminal only,
    datasets' progress bars (in a log file a bar is one long line of carriage returns)."""
    from trainer import data
    from trainer.data.stats import brief_summary
    from trainer.progress import is_terminal

    data_cfg = resolved_data(cfg)
    cache_root = data_cache_root(cfg.data.cache_dir, cfg.output_dir)
    bars = progress and is_terminal()
    pairs = prepares_pairs(cfg)
    prepared = data.prepare(data_cfg, tokenizer_path(cfg), cache_root, progress=bars, seed=cfg.seed, pairs=pairs)
    if progress:
        where = str(prepared.train_path.parent)
        brief = prepared.reused and not full
        print(brief_summary(prepared.manifest, True, where) if brief else prepared.summary(), flush=True)
    _check_unpaired(cfg, prepared.manifest.get("train") or {}, progress)
    return prepared


def _check_unpaired(cfg: C.RunConfig, train: dict[str, Any], say: bool) -> None:
    """KTO trains on unpaired feedback and only KTO does: refuse the other kind of data naming the fix; for
    KTO, print the label counts and KTO's guidance on the weights when they are unbalanced."""
    from trainer.data import DataError, unpaired

    kto, unpaired_data = cfg.train.objective == "kto", "desirable" in train
    if kto and not unpaired_data:
        raise DataError(
            "train.objective=kto trains on unpaired feedback (TRL's prompt, completion and a bool label per row), "
            "but the data was read as chosen/rejected pairs, which spotune does not unpair itself (TRL's KTOTrainer "
            "does, with trl.data_utils.unpair_preference_dataset): write each pair as two rows, the chosen answer "
            "with label true and the rejected one with label false (that function does it), or set "
            "train.objective to dpo, orpo or simpo to train on the pairs"
        )
    if unpaired_data and not kto:
        raise DataError(
            f"train.objective={cfg.train.objective} trains on chosen/rejected pairs, but the data holds unpaired "
            "feedback (prompt, completion and a label): set train.objective=kto, or give pairs"
        )
    if kto and say:
        good, bad = int(train["desirable"]), int(train["undesirable"])
        print(f"kto: {good} desirable and {bad} undesirable answers", flush=True)
        note = unpaired.balance_note(good, bad, cfg.train.desirable_weight, cfg.train.undesirable_weight)
        if note:
            print(f"spotune: warning: {note}", file=sys.stderr, flush=True)


def prepare_once_per_node(cfg: C.RunConfig, proc: Process) -> Any:
    """The packed dataset (rank 0, then one rank per other node; the rest reuse their node's cache),
    and config.yaml in the run directory on its first start."""
    prepared = in_turns(
        lambda: prepare_data(cfg, progress=proc.is_main, full=False),  # `inspect` prints the whole report
        is_main=proc.is_main,
        is_local_main=proc.accelerator.is_local_main_process,
        barrier=proc.accelerator.wait_for_everyone,
    )
    if proc.is_main:
        write_config(proc.out, cfg)
    return prepared


def write_config(run_dir: Path, cfg: C.RunConfig) -> None:
    """config.yaml on the run's first start: what every restart pins its data and day from (`saved_config`).
    Atomic: a torn file from a kill mid-write would be kept (it exists) yet never load, and every restart
    would then pin the hub data and the day anew."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "config.yaml").exists():
        write_text(run_dir / "config.yaml", C.to_yaml(cfg))


def init_adapter(cfg: C.RunConfig) -> InitAdapter | None:
    """The adapter `adapter.init_from` names (None: a fresh adapter), which a DPO run also keeps, frozen,
    as its reference (trainer/model/reference.py): the run's own copy once `keep_init_adapter` made it,
    checked against `model.*`."""
    from trainer.model.reference import INIT_DIR, SOURCE_FILE, InitAdapter, check_base, kept_from, locate, trained_on

    init_from = cfg.adapter.init_from
    if init_from is None:
        return None
    kept = Path(cfg.output_dir) / INIT_DIR
    if kept_from(kept) == init_from:
        path, source = kept, json.loads((kept / SOURCE_FILE).read_text())
    else:  # before the first start's copy (and for a run without a directory of its own yet)
        path = locate(init_from)
        source = trained_on(path)
    check_base(source, cfg.model.name_or_path, model_path(cfg), cfg.model.revision)
    return InitAdapter(path, reference=C.runs_reference(cfg.train.objective))


def keep_init_adapter(cfg: C.RunConfig, proc: Process) -> None:
    """Make `adapter.init_from` the run's own: copied into the run directory (from `checkpoint.remote` when
    the store holds the run's copy, as on a fresh machine; else from the path, on the first start) and, by
    rank 0, into the store. Every restart then reads the copy (`init_adapter`): the path may be gone, or
    hold another adapter since (a continued SFT run). Rank 0 first, then one rank per other node, as the
    data is prepared. Call it after the store resolved the resume step: the store's rule lets an attempt
    write only then."""
    from trainer.atomic import remove_temp_siblings
    from trainer.model.reference import INIT_DIR, INIT_FILES, SOURCE_FILE, check_base, keep_copy, kept_from
    from trainer.restart.store.lifecycle import Store

    init_from = cfg.adapter.init_from
    if init_from is None:
        return
    kept = Path(cfg.output_dir) / INIT_DIR
    ck = cfg.checkpoint

    def keep() -> None:
        # Rank 0's store answered at connect (else it trains cut off from it, from a local checkpoint and copy).
        main_store = proc.remote.store if proc.remote.reachable else None
        store = main_store if proc.is_main else (Store(ck.remote, ck.storage_options) if ck.remote else None)
        # A kill inside publish_dir leaves the kept copy under a temp name (back in place: it may be the only copy
        # once init_from's path is gone) and a kill while copying leaves an unfinished one (removed).
        remove_temp_siblings(kept)
        if kept_from(kept) != init_from and not (store is not None and _fetch_init(store, kept, init_from)):
            keep_copy(init_from, kept)
        source = json.loads((kept / SOURCE_FILE).read_text())
        check_base(source, cfg.model.name_or_path, model_path(cfg), cfg.model.revision)  # before it is uploaded
        if proc.is_main and store is not None and _stored_from(store) != init_from:
            for rel in INIT_FILES:  # the source last: a copy without it is not whole, and is sent again
                store.put(Path(cfg.output_dir) / rel, rel)

    in_turns(
        keep,
        is_main=proc.is_main,
        is_local_main=proc.accelerator.is_local_main_process,
        barrier=proc.accelerator.wait_for_everyone,
    )


def _stored_from(store: Any) -> str | None:
    """The `init_from` of the store's copy of the starting adapter (None: no whole copy there)."""
    from trainer.model.reference import INIT_FILES

    body = store.read_run_file(INIT_FILES[-1])
    try:
        source = json.loads(body) if body is not None else None
    except ValueError:
        return None
    return source.get("init_from") if isinstance(source, dict) else None


def _fetch_init(store: Any, kept: Path, init_from: str) -> bool:
    """Download the store's copy of the starting adapter into `kept` when it was made from `init_from`."""
    from trainer.atomic import fsync_tree, publish_dir, temp_sibling
    from trainer.model.reference import INIT_DIR, INIT_FILES

    if _stored_from(store) != init_from:
        return False
    tmp = temp_sibling(kept, "download")
    for rel in INIT_FILES:
        if not store.get(rel, tmp / Path(rel).relative_to(INIT_DIR)):  # gone meanwhile: copy from the path
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    fsync_tree(tmp)
    publish_dir(tmp, kept)
    print(f"spotune: adapter.init_from: the run's copy fetched from {store.shown}/{INIT_DIR}", flush=True)
    return True


def init_structural(cfg: C.RunConfig) -> dict[str, Any]:
    """What a resume must find again of the starting adapter: its content (the path may differ per machine)."""
    init = init_adapter(cfg)
    return {} if init is None else {"adapter.init_from": f"sha256:{init.digest[:16]}"}
