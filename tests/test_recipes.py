"""Every shipped recipe loads and validates; the count is asserted so none is silently skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer import config as C

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


def test_recipe_count() -> None:
    assert len(RECIPES) == 4, [str(p) for p in RECIPES]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path: Path) -> None:
    cfg = C.load(path)
    assert cfg.output_dir.startswith("runs/")
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), "each recipe opens with a comment"
    if "gpu" in path.parts:
        assert "spotune" in path.read_text().split("\n\n")[0] or "torchrun" in path.read_text(), (
            "launch command in the header"
        )
        assert cfg.train.mixed_precision == "bf16"


def test_config_reference_documents_every_key() -> None:
    reference = (Path(__file__).resolve().parents[1] / "docs" / "config-reference.md").read_text()
    missing = [key for key, _, _ in C.field_docs() if f"`{key}`" not in reference]
    assert not missing, f"docs/config-reference.md lacks {missing}: run python scripts/config_reference.py"


def test_readme_commands_match_ci() -> None:
    root = Path(__file__).resolve().parents[1]
    assert "make test" in (root / ".ci" / "run").read_text()
    readme = (root / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
