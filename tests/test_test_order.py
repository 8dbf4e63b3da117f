"""The order `make test` hands test modules to its workers: longest first, from the seconds
scripts/test_durations.py measured (tests/module_seconds.json); an unmeasured module that holds a
slow test goes first, any other last."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import conftest
import pytest

REPO = Path(__file__).resolve().parents[1]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("test_durations", REPO / "scripts" / "test_durations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_module_seconds_add_up_each_modules_tests(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="one" time="1.25"/>'
        '<testcase classname="tests.test_b" name="one" time="7.0"/>'
        '<testcase classname="tests.test_a" name="two" time="2.5"/>'
        "</testsuite></testsuites>"
    )
    table = _script().module_seconds(junit)
    assert table == {"test_b": 7.0, "test_a": 3.8} and list(table) == ["test_b", "test_a"]


def _item(module: str, slow: bool = False) -> Any:
    return SimpleNamespace(
        module=SimpleNamespace(__name__=module),
        get_closest_marker=lambda name: object() if slow and name == "slow" else None,
        name=module,
    )


def test_modules_go_longest_first_and_keep_their_tests_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "MODULE_SECONDS", {"test_short": 2.0, "test_long": 90.0})
    items = [
        _item("test_short"),
        _item("test_new_fast"),
        _item("test_long"),
        _item("test_new_drill", slow=True),
        _item("test_long"),
    ]
    first_long = items[2]
    conftest.pytest_collection_modifyitems(items)
    assert [i.module.__name__ for i in items] == [
        "test_new_drill",  # not measured yet, holds a slow test: first
        "test_long",
        "test_long",
        "test_short",
        "test_new_fast",  # not measured, nothing slow: last
    ]
    assert items[1] is first_long  # a module's tests keep their order


def test_the_shipped_table_names_modules_that_exist() -> None:
    table = json.loads((REPO / "tests" / "module_seconds.json").read_text())
    gone = sorted(name for name in table if not (REPO / "tests" / f"{name}.py").is_file())
    assert not gone, f"tests/module_seconds.json names modules that are gone: {gone} (scripts/test_durations.py)"
