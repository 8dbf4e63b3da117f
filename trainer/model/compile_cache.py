"""`model.compile` once per run, not once per attempt: what torch compiled travels with the checkpoint.

What is kept: torch's portable compile cache ("Mega-Cache", `torch.compiler.save_cache_artifacts`:
the Inductor FX-graph and AOTAutograd cache entries, autotuning results, and on a GPU the Triton
kernels bundled with them) and, because that cache carries CPU (C++) kernels only as source that
Inductor compiles again, the kernel libraries this process built or loaded from Inductor's cache
directory. They are staged once in `<output_dir>/compile/` (again only when more was compiled) and
hard-linked into each checkpoint's `compile/` folder, so they are listed in its manifest, verified
like every other file, and reach `checkpoint.remote` and a new machine with the checkpoint.

A resumed attempt loads them before its first step when the key matches (torch, Python, device
kind, the C library and C++ compiler the kernels were built with, and a hash of every setting that
shapes the compiled graph); otherwise it compiles from
scratch and says why in one line. Nothing here may fail a run: every problem reads as a miss.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trainer.atomic import fsync_tree, publish_dir, remove_temp_siblings, temp_sibling
from trainer.config import AdapterConfig, ModelConfig
from trainer.model.load import compile_seconds
from trainer.model.wrappers import causal_lm

log = logging.getLogger(__name__)

FOLDER = "compile"
"""In a step directory and in output_dir (the staged copy)."""
BLOB = "mega_cache.bin"
KEY = "key.json"
KERNELS = "kernels"
_NOT_GRAPH = {"name_or_path", "revision", "trust_remote_code", "compile", "compile_cache"}
"""Model settings that do not change what is compiled."""


def device_kind(device: torch.device) -> str:
    """What compiled code is specific to: the GPU's name and compute capability, or the CPU's
    architecture and the vector instruction set Inductor's C++ kernels are built for."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    # ATen's CPU capability (AVX2, AVX512, ...), the ISA Inductor's kernels are built for. Not Inductor's
    # own `pick_vec_isa`: it builds test libraries, which must come after the carried ones are in place.
    isa = torch.backends.cpu.get_cpu_capability().lower()
    return f"{device.type} {platform.machine()} {isa}"


def graph_settings(model: torch.nn.Module, model_cfg: ModelConfig, adapter: AdapterConfig, precision: str) -> dict:
    """Everything that shapes the compiled decoder layer: the architecture (the model's config), the
    dtype, attention, tiling, checkpointing and offloading, the adapter (targets, r, dropout, fused;
    the adapters each LoRA layer holds: a DPO run from `adapter.init_from` has its frozen reference
    beside the trained one) and the mixed precision. Not where `init_from` lies (a resume on another
    machine may find it elsewhere) nor its weights: neither changes what is compiled."""
    arch = {k: v for k, v in causal_lm(model).config.to_dict().items() if not k.startswith("_")}
    arch.pop("transformers_version", None)
    chosen = {k: v for k, v in asdict(model_cfg).items() if k not in _NOT_GRAPH}
    lora = {k: v for k, v in asdict(adapter).items() if k != "init_from"}
    lora["adapters"] = sorted(
        {
            name
            for m in model.modules()
            if isinstance(a := getattr(m, "lora_A", None), torch.nn.ModuleDict)
            for name in a
        }
    )
    return {"architecture": arch, "model": chosen, "adapter": lora, "mixed_precision": precision}


@functools.cache
def toolchain() -> dict[str, str]:
    """The C library and the C++ compiler of this image. The kernel libraries carried in `kernels/` were
    built by that compiler and link against that C library: loaded in another image (an older glibc, a
    compiler whose runtime differs) one can fail to load, or crash, so another toolchain recompiles."""
    libc = " ".join(part for part in platform.libc_ver() if part) or "unknown"
    compiler = "unknown"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        cxx = get_cpp_compiler()
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        compiler = f"{Path(cxx).name}: {out.splitlines()[0].strip()}" if out.strip() else Path(cxx).name
    except Exception:  # noqa: BLE001 (a private helper, or no compiler: such an image cannot load C++ kernels either)
        pass
    return {"libc": libc, "compiler": compiler}


def cache_key(settings: Mapping[str, Any], device: torch.device) -> dict[str, str]:
    """The key a checkpoint's artifacts are reused under; any difference means compiling from scratch."""
    shape = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_kind(device),
        **toolchain(),
        "model_shape": shape,
    }


def refusal(saved: Mapping[str, Any], here: Mapping[str, str]) -> str | None:
    """Why artifacts saved under `saved` must not be loaded here; None when the keys match."""
    differ = [f"{k} {saved.get(k)!r} in the checkpoint, {v!r} here" for k, v in here.items() if saved.get(k) != v]
    return "; ".join(differ) or None


def _api() -> tuple[Any, Any] | None:
    """torch's save/load of compiled artifacts, where this torch has them (2.7 and later)."""
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    return (save, load) if save is not None and load is not None else None


def _inductor_cache_dir() -> Path | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir())
    except Exception:  # noqa: BLE001 (a private helper: without it no kernel library is carried)
        return None


def _loaded_libraries() -> set[Path]:
    """Shared libraries mapped into this process (Linux); elsewhere the extension modules imported."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(maxsplit=5) for line in f]
        return {Path(p[5].strip()) for p in fields if len(p) == 6 and p[5].strip().endswith(".so")}
    except OSError:
        files = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
        return {Path(f) for f in files if isinstance(f, str) and f.endswith(".so")}


class CompileCache:
    """One attempt's compiled artifacts: loaded from the resumed checkpoint, staged, put into saves."""

    def __init__(self, key: dict[str, str], stage: Path | None, enabled: bool = True) -> None:
        self.key = key
        self.stage = stage
        self.outcome = "miss: no checkpoint to load from" if enabled else "off: model.compile_cache=false"
        self.enabled = enabled and _api() is not None
        if enabled and not self.enabled:
            self.outcome = f"off: torch {torch.__version__} has no torch.compiler.save_cache_artifacts"
        self._baseline = compile_seconds()  # compile_seconds counts the process; an attempt counts its own
        self._started = time.time()  # kernel libraries built from here on are this attempt's
        self._looked_at = 0.0
        if stage is not None:
            _tidy(stage)
        staged = self._read_key(stage) if stage is not None else None  # an earlier attempt's, on this disk
        self._staged: dict[str, Any] | None = staged if staged is not None and staged.get("key") == key else None

    def seconds(self) -> float:
        """Seconds this attempt has spent compiling so far."""
        return max(0.0, compile_seconds() - self._baseline)

    def account(self, phases: dict[str, float]) -> None:
        """The ledger's `compile` phase: this attempt's compile seconds (once it compiled)."""
        if seconds := self.seconds():
            phases["compile"] = seconds

    # ------------------------------------------------------------------ load (every rank)

    def load(self, checkpoint: Path) -> str:
        """Load the artifacts of `checkpoint` before the first step, if the key allows; the outcome
        (`hit ...`, `miss: ...`, `refused: ...`) is also kept in `outcome` for the ledger."""
        if not self.enabled:
            return self.outcome
        folder = checkpoint / FOLDER
        saved = self._read_key(folder)
        if saved is None:
            self.outcome = "miss: the checkpoint holds no compiled artifacts"
        elif why := refusal(saved.get("key") or {}, self.key):
            self.outcome = f"refused: {why}"
        else:
            try:
                self.outcome = self._load(folder, saved)
            except Exception as e:  # noqa: BLE001 (a cache: whatever it holds, the run compiles instead)
                self.outcome = f"miss: the artifacts did not load ({type(e).__name__}: {e})"
        return self.outcome

    def _load(self, folder: Path, saved: dict[str, Any]) -> str:
        api = _api()
        root = _inductor_cache_dir()
        assert api is not None  # `enabled` says so
        info = api[1]((folder / BLOB).read_bytes())
        kernels = self._restore_kernels(folder / KERNELS, root) if root is not None else 0
        if info is None:
            return "miss: torch read no artifacts from the checkpoint"
        self._staged = saved if saved.get("artifacts") else None  # the same set need not be written again
        try:
            self._link_stage(folder)
        except OSError as e:  # loaded all the same; the first save serialises them again instead
            self._staged = None
            log.warning("spotune: the loaded compiled artifacts were not staged (%s: %s)", type(e).__name__, e)
        return f"hit: {len(saved.get('artifacts') or [])} artifact(s) and {kernels} kernel librar(ies) loaded"

    @staticmethod
    def _restore_kernels(kernels: Path, root: Path) -> int:
        """Put the carried kernel libraries where Inductor looks (by content hash) before compiling."""
        count = 0
        for f in sorted(kernels.rglob("*.so")) if kernels.is_dir() else []:
            dest = root / f.relative_to(kernels)
            if not dest.exists():  # named by a hash of source and flags: an existing one is the same
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = temp_sibling(dest)
                shutil.copyfile(f, tmp)
                os.chmod(tmp, 0o755)
                os.replace(tmp, dest)  # other ranks of this node may place the same file
            count += 1
        return count

    # ------------------------------------------------------------------ save (rank 0, at each checkpoint)

    def write_into(self, checkpoint_tmp: Path) -> None:
        """Hard-link the staged artifacts into a checkpoint being written, re-staging first only
        when this attempt compiled more since the last look (serialising is cheap; writing is not)."""
        if not self.enabled or self.stage is None:
            return
        try:
            seconds = self.seconds()
            if seconds > self._looked_at:
                self._looked_at = seconds
                self._restage()
            if self._staged is not None:
                _link_files(self.stage, checkpoint_tmp / FOLDER)
        except Exception as e:  # noqa: BLE001 (never fail a save for a cache)
            log.warning("spotune: compiled artifacts not saved with the checkpoint (%s: %s)", type(e).__name__, e)

    def _restage(self) -> None:
        api = _api()
        got = api[0]() if api is not None else None
        if not got:
            return
        blob, info = got
        artifacts = sorted(f"{kind}:{k}" for kind, keys in info.artifacts.items() for k in keys)
        old = set((self._staged or {}).get("artifacts") or [])
        if set(artifacts) <= old:
            return  # nothing new: the staged copy stands
        assert self.stage is not None  # write_into says so
        tmp = temp_sibling(self.stage)
        tmp.mkdir(parents=True)
        (tmp / BLOB).write_bytes(blob)
        kernels = self._copy_kernels(tmp / KERNELS)
        record = {"key": self.key, "artifacts": artifacts, "kernels": kernels, "compile_seconds": self.seconds()}
        (tmp / KEY).write_text(json.dumps(record, indent=1, sort_keys=True))
        fsync_tree(tmp)
        publish_dir(tmp, self.stage)
        self._staged = record

    def _copy_kernels(self, dest: Path) -> list[str]:
        """The kernel libraries of Inductor's cache this process loaded or built (by time)."""
        root = _inductor_cache_dir()
        if root is None or not root.is_dir():
            return []
        mine = {p for p in _loaded_libraries() if p.is_relative_to(root)}
        mine |= {p for p in root.rglob("*.so") if p.stat().st_mtime >= self._started}
        names = []
        for f in sorted(mine):
            target = dest / f.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            names.append(f.relative_to(root).as_posix())
        return names

    def _link_stage(self, folder: Path) -> None:
        """After a hit: the checkpoint's artifacts become the staged copy (hard links, no bytes copied)."""
        if self._staged is None or self.stage is None:
            return
        tmp = temp_sibling(self.stage)
        _link_files(folder, tmp)
        publish_dir(tmp, self.stage)

    @staticmethod
    def _read_key(folder: Path) -> dict[str, Any] | None:
        try:
            record = json.loads((folder / KEY).read_text())
            return record if isinstance(record, dict) and (folder / BLOB).is_file() else None
        except (OSError, ValueError):
            return None


def _tidy(stage: Path) -> None:
    """Before the stage is read: a kill inside `publish_dir` (between its two renames) leaves the staged copy under
    a temp name, which goes back in place, and a kill while staging leaves unfinished copies, which go (each one
    as large as the artifacts, they would pile up on the disk at every kill)."""
    try:
        for gone in remove_temp_siblings(stage):
            log.info("spotune: removed an unfinished copy of the compiled artifacts: %s", gone)
    except OSError as e:  # a cache never fails a run: at worst it is a miss
        log.warning("spotune: the staged compiled artifacts in %s were not tidied (%s: %s)", stage, type(e).__name__, e)


def _link_files(src: Path, dest: Path) -> None:
    """Hard-link every file below `src` into `dest` (a copy where links are not supported)."""
    for f in sorted(src.rglob("*")):
        if f.is_file():
            target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)


def start(
    model_cfg: ModelConfig,
    adapter: AdapterConfig,
    precision: str,
    model: torch.nn.Module,
    resume_dir: Path | None,
    stage: Path | None,
) -> CompileCache | None:
    """This attempt's compile cache with `model.compile` (None without), with the artifacts of
    `resume_dir` loaded when the key matches (`outcome` says how it went). `stage`: where the
    main rank keeps the artifacts it puts into each checkpoint (`<output_dir>/compile`); None on
    the other ranks, which only load."""
    if not model_cfg.compile:
        return None
    # The device the layers compute on (accelerate made this rank's GPU current; FSDP's CPU offload
    # keeps the parameters in host memory, so they cannot say it). No GPU: training runs on the CPU.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    key = cache_key(graph_settings(model, model_cfg, adapter, precision), device)
    cache = CompileCache(key, stage, enabled=model_cfg.compile_cache)
    if resume_dir is not None:
        cache.load(resume_dir)
    return cache
