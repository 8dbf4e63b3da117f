"""README.md and docs/ hold together: every relative link and #anchor lands, every page is reachable
from the README, the README stays a short front door, nothing points outside the repository or at
an issue tracker, and the config reference matches the schema."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# "issue 21", "Issues 12, 22", "issue #3", "(#24)", "PR #7": citations a reader of the repository cannot
# follow (a CSS colour such as `color: #666;` is not one).
ISSUE_CITATION = re.compile(r"""\b(?:issues?|PR|pull request)\s*#?\d+|(?:^|(?<=[\s(]))#\d+\b(?![;"'])""", re.IGNORECASE)
OUTSIDE = "../shared"


def doc_pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside code blocks (fenced, or indented after a blank line), inline code
    removed unless `keep_code` (a heading's code spans are part of its anchor)."""
    out: list[tuple[int, str]] = []
    fenced = indented = False
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            indented = line.startswith("    ") and (indented or not previous.strip())
            if not indented:
                out.append((number, line if keep_code else INLINE_CODE.sub("", line)))
        previous = line
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def anchors(path: Path) -> set[str]:
    """Every #anchor of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    for _, line in prose_lines(path.read_text(), keep_code=True):
        m = HEADING.match(line)
        if m:
            base, n = slug(m.group(2)), 0
            while (name := base if n == 0 else f"{base}-{n}") in found:
                n += 1
            found.add(name)
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link (no scheme, no mailto)."""
    found = []
    for number, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                found.append((number, target))
    return found


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO.resolve()) if path.is_relative_to(REPO.resolve()) else path}:{number}"
        if not dest.exists():
            problems.append(f"{where}: {target} -> {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: {target} -> no heading #{anchor} in {dest.name}")
    return problems


def reachable_from(start: Path) -> set[Path]:
    todo, seen = [start.resolve()], {start.resolve()}
    while todo:
        page = todo.pop()
        for _, target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve() if target.partition("#")[0] else page
            if dest.suffix == ".md" and dest.exists() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    return seen


def citations(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE_CITATION.finditer(text)]


# ---------------------------------------------------------------------------- the checks


def front_door_problems(text: str) -> list[str]:
    """What a newcomer must meet in the README, in order: the two set-up commands before anything
    else runs, a row of data of each common format, a quick start that ends talking to the result,
    and the supported-models table saying where each was checked."""
    problems = []
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    if not blocks or [ln.split("#")[0].strip() for ln in blocks[0].splitlines()] != ["make demo", "make test"]:
        problems.append("the first command block is not `make demo` then `make test`")
    for fmt, field in [
        ("alpaca", '"instruction"'),
        ("prompt_completion", '"completion"'),
        ("messages", '"role"'),
        ("sharegpt", '"from"'),
        ("text", '"text"'),
    ]:
        if not re.search(rf"^\| `{fmt}`.*{field}", text, flags=re.M):
            problems.append(f"no row of {fmt} data")
    quick = next((b for b in blocks if "spotune train" in b), "")
    commands = [ln for ln in quick.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not commands or not commands[-1].startswith("spotune chat"):
        problems.append("the quick start does not end with `spotune chat`")
    if not re.search(r"^\| model family \| recipe \| CPU tests \| GPU \|$", text, flags=re.M):
        problems.append("no supported-models table (model family, recipe, CPU tests, GPU)")
    return problems


def test_readme_is_a_front_door() -> None:
    assert not front_door_problems(README.read_text())
    # The control: a README that starts with set-up internals and ends its quick start with an export.
    moved = README.read_text().replace("make demo", "bash scripts/setup.sh", 1)
    assert "the first command block is not `make demo` then `make test`" in front_door_problems(moved)
    ends_in_export = README.read_text().replace("spotune chat runs/", "spotune export runs/")
    assert "the quick start does not end with `spotune chat`" in front_door_problems(ends_in_export)


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_links_and_anchors_resolve(page: Path) -> None:
    assert not broken_links(page.resolve())


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached = reachable_from(README)
    orphans = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in reached]
    assert not orphans, f"docs pages no link from README.md (or docs/index.md) leads to: {orphans}"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_nothing_points_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert OUTSIDE not in text, f"{page.name} names {OUTSIDE}, which a user of the repository does not have"
    assert not citations(text), f"{page.name} cites issue numbers: {citations(text)}; state the reason instead"


def test_code_cites_no_issue_numbers_or_outside_files() -> None:
    """Comments and docstrings users read say why, not which ticket asked, and name no file a user
    of the repository does not have."""
    found = []
    files = [REPO / name for name in ("Makefile", "pyproject.toml", "CONTRIBUTING.md", ".ci/run")]
    for folder in ("trainer", "scripts", "benchmarks", "docker", "recipes", "tests"):
        files += sorted((REPO / folder).rglob("*"))
    files.remove(Path(__file__))  # it names what it looks for
    for path in files:
        if path.is_file() and path.suffix in {".py", ".sh", ".yaml", ".yml", ".sbatch", ".j2", ".toml", ".md", ""}:
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                outside = [name for name in (OUTSIDE, "GPU-FINDINGS") if name in line]
                found += [f"{path.relative_to(REPO)}:{number}: {c}" for c in citations(line) + outside]
    assert not found, found


def missing_repo_paths(page: Path) -> list[str]:
    """Shipped recipe, script and benchmark paths a page names (in prose or code) that the repository
    lacks; a user's own recipe in an example (`recipes/mine.yaml`) is not a shipped one."""
    shipped = r"recipes/gpu/|recipes/tiny|scripts/|benchmarks/|docker/"
    named = re.findall(rf"\b((?:{shipped})[\w./-]*\.(?:yaml|py|sh|yml))\b", page.read_text())
    return sorted({p for p in named if not (REPO / p).exists()})


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.name)
def test_named_files_exist(page: Path, tmp_path: Path) -> None:
    assert not missing_repo_paths(page)
    control = tmp_path / "control.md"
    control.write_text("Train with `recipes/gpu/llama-9-lora.yaml` or recipes/tiny-cpu.yaml.")
    assert missing_repo_paths(control) == ["recipes/gpu/llama-9-lora.yaml"]


def test_config_reference_matches_the_schema() -> None:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = DOCS / "config-reference.md"
    assert page.read_text() == module.page(), f"{page} is out of date: run python scripts/config_reference.py"


# ---------------------------------------------------------------------------- controls: the checks can fail


def test_controls(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Page A\n\n## Any GPU count, any time (elastic resume)\n\n## `make gpu-check`\n\n"
        "[ok](#any-gpu-count-any-time-elastic-resume) [ok](#make-gpu-check) [ok](b.md#b-title)\n"
        "[bad anchor](b.md#nowhere) [missing](c.md) [web](https://example.com/x.md)\n"
        "```\n[in code](missing.md)\n```\n"
    )
    (tmp_path / "docs" / "b.md").write_text("# B title\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    (tmp_path / "README.md").write_text("[docs](docs/a.md)\n")
    problems = broken_links((tmp_path / "docs" / "a.md").resolve())
    assert len(problems) == 2, problems
    assert "#nowhere" in problems[0] and "c.md does not exist" in problems[1]
    reached = reachable_from(tmp_path / "README.md")
    assert (tmp_path / "docs" / "b.md").resolve() in reached
    assert (tmp_path / "docs" / "orphan.md").resolve() not in reached
    assert citations("fixed in issue 21; see #24 and Issues 12") == ["issue 21", "#24", "Issues 12"]
    assert citations('color="#666", color: #667;, [x](#heading), see (#3)') == ["#3"]
    assert not citations("a 4-bit base; 12 issues of the magazine; `#include`")


def test_make_test_names_failures_as_they_happen_and_the_readme_says_how_long_it_takes() -> None:
    """`-q` names nothing until the end of a long run: the test target prints each failure as it fails
    (pytest-instafail, which works under pytest-xdist), and the README gives the duration."""
    make = (REPO / "Makefile").read_text()
    line = next(ln for ln in make.splitlines() if "-m pytest" in ln and "--dist loadfile" in ln)
    assert "--instafail" in line
    import importlib.util

    assert importlib.util.find_spec("pytest_instafail") is not None, "pip install pytest-instafail (the test extra)"
    assert re.search(r"`make test` takes about \S+ minutes on 2", README.read_text())
