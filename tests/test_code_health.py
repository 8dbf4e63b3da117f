"""Standing rules of the code base, checked on every run (see CONTRIBUTING.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import trainer

PACKAGE = Path(trainer.__file__).parent
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_at_most_400_lines() -> None:
    too_long = {
        str(p.relative_to(PACKAGE)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these by concern (limit {MAX_LINES} lines): {too_long}"


def test_the_limit_check_can_fail(tmp_path: Path) -> None:
    """Control: the line count used above sees a long file as long."""
    long_file = tmp_path / "long.py"
    long_file.write_text("x = 1\n" * (MAX_LINES + 1))
    assert len(long_file.read_text().splitlines()) > MAX_LINES


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_planning_and_metrics_do_not_reach_into_the_run() -> None:
    """Data flows one way: plan/ and the meter take numbers; they never import the run's wiring."""
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        imports = _imports(path)
        if rel.startswith("plan/") and "trainer.run" in imports:
            offenders.append(f"{rel} imports trainer.run")
        if rel == "metrics.py" and any(i.startswith("trainer.plan") for i in imports):
            offenders.append(f"{rel} imports trainer.plan")
    assert not offenders, offenders
