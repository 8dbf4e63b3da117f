"""Refresh tests/module_seconds.json, the measured seconds of each test module, from a JUnit XML
report (`pytest --junitxml=runs/junit.xml ...`). tests/conftest.py hands the modules to the
pytest workers longest first, so that no long drill module starts last while the other cores idle;
stale or missing figures only make that order worse, never a test fail.

    .venv/bin/python scripts/test_durations.py runs/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "module_seconds.json"


def module_seconds(junit: Path) -> dict[str, float]:
    """Module name (`test_kill_anywhere`) -> the seconds its tests took, setup and teardown included."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        seconds[case.get("classname", "").rsplit(".", 1)[-1]] += float(case.get("time") or 0.0)
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]) if name}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = module_seconds(Path(argv[0]))
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {OUT}: {len(table)} modules, {sum(table.values()):,.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
