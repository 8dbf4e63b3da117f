"""The itemised fixed costs of a process and of a restart, each with its source; the save count."""

from __future__ import annotations

import pytest
from pilot_fixture import FIXED, RESTART

from trainer.plan import timeline as tl

PILOT = {"fixed": FIXED, "restart": {**RESTART, "warmup_extra_seconds": 6.0}}


def _by_name(items: list[tl.Item]) -> dict[str, tl.Item]:
    return {i.name: i for i in items}


def test_a_cache_hit_and_a_preparation_are_told_apart() -> None:
    hit = _by_name(tl.attempt_items(PILOT, tl.Target(data_cached=True)))
    miss = _by_name(tl.attempt_items(PILOT, tl.Target(data_cached=False)))
    assert hit["data: cache hit"] == tl.Item("data: cache hit", 1.0, "pilot")
    assert miss["data: prepare (no cache in the target directory)"].seconds == 30.0
    assert tl.total(list(miss.values())) - tl.total(list(hit.values())) == pytest.approx(29.0)
    # A pilot that only ever hit the cache: preparation from the time the manifest recorded.
    only_hit = {"fixed": {**PILOT["fixed"], "data_prepare": None}}
    item = _by_name(tl.attempt_items(only_hit, tl.Target(prepare_seconds=12.0)))
    assert item["data: prepare (no cache in the target directory)"] == tl.Item(
        "data: prepare (no cache in the target directory)", 13.0, "manifest (recorded when the cache was built)"
    )
    # A pilot that only prepared: a hit is its data phase less the preparation the manifest timed.
    only_prepared = {"fixed": {**PILOT["fixed"], "data_cache_hit": None}}
    item = _by_name(tl.attempt_items(only_prepared, tl.Target(data_cached=True, prepare_seconds=28.5)))
    assert item["data: cache hit"] == tl.Item("data: cache hit", 1.5, "pilot less manifest")


def test_a_hub_model_not_on_disk_is_downloaded_at_the_given_speed() -> None:
    target = tl.Target(model_local=False, model_bytes=16e9)
    fetch = _by_name(tl.attempt_items(PILOT, target))["base model download"]
    assert fetch == tl.Item("base model download", 16e9 / 200e6, "assumed 200 MB/s (--download-mb-s)")
    fast = tl.Target(model_local=False, model_bytes=16e9, download_bytes_per_s=1e9, download_given=True)
    assert _by_name(tl.attempt_items(PILOT, fast))["base model download"].seconds == 16.0
    cached = tl.Target(model_local=False, model_cached=True, model_bytes=16e9)
    assert _by_name(tl.attempt_items(PILOT, cached))["base model download"].seconds == 0.0
    # ... but a replacement VM has an empty cache: the restart downloads it again.
    restart = _by_name(tl.restart_items(PILOT, cached, checkpoint_bytes=None))
    assert restart["base model download (empty disk)"].seconds == pytest.approx(80.0)


def test_a_restart_is_itemised_from_the_pilot_until_the_run_has_measured_ones() -> None:
    target = tl.Target(data_cached=True, remote=True, download_bytes_per_s=100e6)
    items = _by_name(tl.restart_items(PILOT, target, checkpoint_bytes=50e6))
    assert items["replacement machine"] == tl.Item("replacement machine", 180.0, "assumed (--vm-start-seconds)")
    # The pilot's resumed process hit the cache; a new VM's empty disk prepares instead.
    assert items["start-up with resume (imports, load, restore)"].seconds == 69.0
    assert items["data: prepare (no cache in the target directory)"].seconds == 30.0
    assert items["checkpoint download"].seconds == pytest.approx(0.5)
    assert items["warm-up steps beyond the sustained rate"].seconds == 6.0
    cold = items["cold page cache (a new machine's first process)"]
    assert cold.seconds == 0.0 and "loaded warm" in cold.source
    old = {**PILOT, "restart": {k: v for k, v in PILOT["restart"].items() if k != "cold_start_extra_seconds"}}
    cold = _by_name(tl.restart_items(old, target, checkpoint_bytes=50e6))[
        "cold page cache (a new machine's first process)"
    ]
    assert cold.seconds == 0.0 and cold.source.startswith("not measured")
    pilot_cold = {**PILOT, "restart": {**PILOT["restart"], "cold_start_extra_seconds": 12.0}}
    items = _by_name(tl.restart_items(pilot_cold, target, checkpoint_bytes=50e6))
    assert items["cold page cache (a new machine's first process)"] == tl.Item(
        "cold page cache (a new machine's first process)", 12.0, "pilot: its first process over its second"
    )
    measured = tl.Target(restarts=[50.0, 70.0, 60.0], gaps=[100.0, 140.0])
    items = _by_name(tl.restart_items(PILOT, measured, checkpoint_bytes=50e6))
    assert items == {
        "replacement machine": tl.Item("replacement machine", 120.0, "ledger: 2 gap(s) between attempts"),
        "start-up with resume": tl.Item("start-up with resume", 60.0, "ledger: 3 measured restart(s)"),
    }


def test_without_a_pilot_the_assumptions_say_so() -> None:
    """Start-up is assumed from what it is made of: a fixed part and the model's weights loaded at a stated
    rate, so a 16 GB model starts in 46 s and a 2.8 MB one in about 30 s (once 300 s for both)."""
    items = tl.attempt_items(None, tl.Target(prepare_seconds=5.0, model_bytes=16e9))
    assert [i.source for i in items if i.seconds] == [
        "assumed: 30 s of imports, set-up and exit + 16 GB of weights loaded at 1000 MB/s (no pilot; "
        "`spotune pilot` measures)",
        "manifest (recorded when the cache was built)",
    ]
    assert tl.total(items) == tl.DEFAULT_STARTUP_S + 16.0 + 5.0
    tiny = tl.attempt_items(None, tl.Target(model_bytes=2.8e6))
    assert tl.total(tiny) == pytest.approx(30.0028)


@pytest.mark.parametrize(
    ("steps", "every_steps", "every_minutes", "step_s", "saves"),
    [
        (60, 20, None, 1.0, 3),  # 20, 40, 60
        (61, 20, None, 1.0, 4),  # ... and the end
        (60, None, None, 1.0, 1),  # only the end
        (60, None, 0.25, 1.0, 4),  # every 15 s: 15, 30, 45, 60
        (60, 20, 0.25, 1.0, 6),  # 15, 20 (a save restarts the clock), 35, 40, 55, 60
    ],
)
def test_save_count_follows_the_loop(
    steps: int, every_steps: int | None, every_minutes: float | None, step_s: float, saves: int
) -> None:
    assert tl.save_count(steps, every_steps, every_minutes, step_s) == saves
