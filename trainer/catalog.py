"""The GPU catalogue: memory, dense bf16 peak FLOP/s, typical prices, spot interruption rate.

Used by the meter (MFU against the device's peak) and by the planner (fit, hours, cost), so it
sits beside both and depends on neither.

Shipped as `gpus.yaml` next to this module; a user YAML of the same shape changes any
field of a known GPU (matched by name, case-insensitively) or adds new GPUs. Prices are
the part most worth overriding: they are typical public figures, not quotes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from trainer.exit_codes import EXIT_BAD_INPUT

BUILTIN_CATALOG = Path(__file__).with_name("gpus.yaml")
_REQUIRED = ("memory_gib", "peak_bf16_flops", "on_demand_price")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """Device memory as torch reports it."""
    peak_bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s."""
    on_demand_price: float
    """Price per GPU-hour, on demand."""
    spot_price: float | None = None
    """Price per GPU-hour on spot/preemptible capacity (None: no spot offer)."""
    mtbi_hours: float | None = None
    """Typical mean time between spot interruptions, hours."""
    aliases: tuple[str, ...] = field(default_factory=tuple)
    """Regexes matched against torch.cuda.get_device_name()."""

    @property
    def spot_discount(self) -> float | None:
        """Share of the on-demand price saved on spot (0.45 = 45% cheaper)."""
        if self.spot_price is None or self.on_demand_price <= 0:
            return None
        return 1.0 - self.spot_price / self.on_demand_price


class CatalogError(ValueError):
    """A bad GPU catalogue file or an unknown GPU name (a user error: exit code 2)."""

    exit_code = EXIT_BAD_INPUT


def load_catalog(overrides_path: str | Path | None = None) -> list[GPU]:
    """The built-in catalogue, with a user YAML's changes and additions applied."""
    gpus = list(_builtin())
    if overrides_path is None:
        return gpus
    path = Path(overrides_path)
    if not path.is_file():
        raise CatalogError(f"GPU catalogue file not found: {path} (give a YAML with a `gpus:` list)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise CatalogError(f"{path}: invalid YAML: {e}") from None
    by_name = {g.name.lower(): i for i, g in enumerate(gpus)}
    for n, entry in enumerate(_entries(raw, path)):
        where = f"{path}: gpus[{n}]"
        name = str(entry.get("name", "")).strip()
        if not name:
            raise CatalogError(f"{where}: every entry needs a `name`")
        if name.lower() in by_name:
            i = by_name[name.lower()]
            gpus[i] = replace(gpus[i], **_fields(entry, where, partial=True))
        else:
            gpus.append(GPU(**_fields(entry, where, partial=False)))
            by_name[name.lower()] = len(gpus) - 1
    return gpus


def with_mtbi(gpus: list[GPU], values: list[str]) -> list[GPU]:
    """`gpus` with the interruption rates of `--mtbi-hours` values: `H` sets every GPU's mean time
    between spot interruptions to H hours, `NAME=H` one GPU's (by name or device name); later values win."""
    out = list(gpus)
    for value in values:
        name, sep, hours_text = value.rpartition("=")
        try:
            hours = float(hours_text)
        except ValueError:
            hours = float("nan")
        if not hours > 0:
            raise CatalogError(
                f"--mtbi-hours {value!r}: give hours above 0, for every GPU (`--mtbi-hours 6`) or one "
                "(`--mtbi-hours L4=6`)"
            )
        if not sep:
            out = [replace(g, mtbi_hours=hours) for g in out]
            continue
        try:
            target = find_gpu(name, out)
        except CatalogError as e:
            raise CatalogError(f"--mtbi-hours {value!r}: {e}") from None
        out = [replace(g, mtbi_hours=hours) if g is target else g for g in out]
    return out


def find_gpu(name: str, catalog: list[GPU] | None = None) -> GPU:
    """A catalogue entry by its name (case-insensitive), or by a device name it matches."""
    gpus = catalog if catalog is not None else load_catalog()
    for g in gpus:
        if g.name.lower() == name.strip().lower():
            return g
    matched = match_device(name, gpus)
    if matched is None:
        raise CatalogError(f"GPU {name!r} is not in the catalogue; known: {', '.join(g.name for g in gpus)}")
    return matched


def match_device(device_name: str, catalog: list[GPU] | None = None) -> GPU | None:
    """The entry named `device_name`, else the one whose alias matches the longest span of it."""
    gpus = catalog if catalog is not None else load_catalog()
    text = device_name.strip().lower()
    for g in gpus:
        if g.name.lower() == text:
            return g
    best: tuple[int, GPU] | None = None
    for g in gpus:
        for pattern in g.aliases:
            m = re.search(pattern, text)
            if m and (best is None or len(m.group(0)) > best[0]):
                best = (len(m.group(0)), g)
    return best[1] if best else None


def peak_flops_for(device_name: str, catalog: list[GPU] | None = None) -> float | None:
    """Dense bf16 peak FLOP/s for a torch.cuda.get_device_name() string; None if unknown."""
    g = match_device(device_name, catalog)
    return g.peak_bf16_flops if g else None


# ---------------------------------------------------------------------------- parsing


@lru_cache(maxsize=1)
def _builtin() -> tuple[GPU, ...]:
    raw = yaml.safe_load(BUILTIN_CATALOG.read_text())
    return tuple(
        GPU(**_fields(e, f"{BUILTIN_CATALOG}: gpus[{i}]", partial=False))
        for i, e in enumerate(_entries(raw, BUILTIN_CATALOG))
    )


def _entries(raw: Any, path: Path) -> list[dict[str, Any]]:
    items = raw.get("gpus") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not all(isinstance(e, dict) for e in items):
        raise CatalogError(f"{path}: expected `gpus:` followed by a list of mappings (name, memory_gib, ...)")
    return items


def _fields(entry: dict[str, Any], where: str, *, partial: bool) -> dict[str, Any]:
    known = {f.name for f in fields(GPU)}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {unknown}; valid: {sorted(known)}")
    missing = [] if partial else [k for k in _REQUIRED if entry.get(k) is None]
    if missing:
        raise CatalogError(f"{where} ({entry.get('name')}): a new GPU needs {', '.join(missing)}")
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "name":
            out[key] = str(value)
        elif key == "aliases":
            out[key] = tuple(str(a) for a in ([value] if isinstance(value, str) else value or ()))
        elif value is None:
            if key in _REQUIRED:
                raise CatalogError(f"{where}: {key} cannot be null")
            out[key] = None
        else:
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                raise CatalogError(f"{where}: {key} must be a number, got {value!r}") from None
            if out[key] < 0:
                raise CatalogError(f"{where}: {key} must not be negative, got {value!r}")
    if partial:
        out.pop("name", None)
    return out
