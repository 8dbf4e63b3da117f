"""A pilot's fixed costs as `spotune pilot` writes them (pilot.json `fixed` and `restart`), for the
estimate and timeline tests: round figures whose sums the tests can state."""

from __future__ import annotations

from typing import Any

FIXED: dict[str, Any] = {
    "imports": 20.0,
    "store": 0.0,
    "data_prepare": 30.0,
    "data_cache_hit": 1.0,
    "model": 40.0,
    "setup": 3.0,
    "warmup_extra": 5.0,
    "final": 2.0,
    "flush": 0.0,
    "report": 1.0,
    "exit": 1.0,
    "sd": 2.0,
}
RESTART: dict[str, Any] = {
    "startup_seconds": 70.0,
    "cold_start_extra_seconds": 0.0,
    "resolve_seconds": 1.0,
    "restore_seconds": 4.0,
    "warmup_extra_seconds": 5.0,
    "data_reused": True,
}
