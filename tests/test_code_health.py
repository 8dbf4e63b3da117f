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


# Where planning meets the run: these two read the world (RunConfig, the tokenizer, pilot.json)
# and start the pilot, so that the rest of plan/ takes numbers.
WIRING = {"plan/world.py", "plan/pilot_run.py"}


def test_planning_and_metrics_do_not_reach_into_the_run() -> None:
    """Data flows one way: plan/ and the meter take numbers; they never import the run's wiring."""
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        imports = _imports(path)
        if rel in WIRING:
            continue
        if rel.startswith("plan/") and ("trainer.training.run" in imports or "trainer.config.RunConfig" in imports):
            offenders.append(f"{rel} takes the whole run (trainer.training.run or RunConfig): pass sections or numbers")
        if rel == "training/metrics.py" and any(i.startswith("trainer.plan") for i in imports):
            offenders.append(f"{rel} imports trainer.plan")
    assert not offenders, offenders


def test_the_import_check_sees_an_upward_import() -> None:
    """Control: the CLI glue does import the run, and the check above would flag that in plan/."""
    assert "trainer.training.run" in _imports(PACKAGE / "plan" / "world.py")
