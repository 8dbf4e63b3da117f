"""Write docs/config-reference.md, every config key with its default and meaning, from the schema's
docstrings (tests/test_docs.py fails when the page and the schema disagree).

    python scripts/config_reference.py           # rewrite the page
    python scripts/config_reference.py --check   # exit 1 when the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import field_docs  # noqa: E402

PAGE = REPO / "docs" / "config-reference.md"
HEADER = """# Config reference

Every key, its default and its meaning; `spotune config --reference` prints the same. A recipe
sets them in YAML sections (`train:` then `lr: 1e-4`), and overrides after the recipe set them
as dotted pairs (`train.lr=1e-4`). Unknown keys fail with the closest valid key suggested; all
problems are reported at once. How recipes and overrides combine: [config](config.md). Which
keys a resumed run may change: [resume FAQ](resume-faq.md).

This page is generated from the docstrings in `trainer/config/schema.py` by
`python scripts/config_reference.py`; edit those, not this page.
"""


def table() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in field_docs():
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '/')} |")
    return "\n".join(lines)


def page() -> str:
    return f"{HEADER}\n{table()}\n"


def main(argv: list[str]) -> int:
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page():
            print(f"{PAGE} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
