"""Standing rules of the code base, checked on every run (see CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import trainer

PACKAGE = Path(trainer.__file__).parent


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


# No line count for modules: a module is shaped by its concern, split when it does two things,
# never trimmed or squeezed to meet a number (CONTRIBUTING.md, "Rules, each with one home").


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


# Where planning meets the run: cli/world.py and cli/pilot_run.py read the world (RunConfig, the
# tokenizer, pilot.json) and start the pilot, for the estimate and pilot commands, so that plan/ takes numbers.


def test_planning_and_metrics_do_not_reach_into_the_run() -> None:
    """Data flows one way: plan/ and the meter take numbers; they never import the run's wiring."""
    offenders = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        imports = _imports(path)
        if rel.startswith("plan/") and ("trainer.training.run" in imports or "trainer.config.RunConfig" in imports):
            offenders.append(f"{rel} takes the whole run (trainer.training.run or RunConfig): pass sections or numbers")
        if rel == "training/metrics.py" and any(i.startswith("trainer.plan") for i in imports):
            offenders.append(f"{rel} imports trainer.plan")
    assert not offenders, offenders


def test_the_import_check_sees_an_upward_import() -> None:
    """Control: the CLI glue does import the run, and the check above would flag that in plan/."""
    assert "trainer.training.run" in _imports(PACKAGE / "cli" / "pilot_run.py")


# ---------------------------------------------------------------------------- stages
# The folders (and the few top-level modules) of trainer/, lowest first, in the order data flows
# through a run (CONTRIBUTING.md, "Layout"). A module may import its own stage and the stages
# with a lower rank, never one of equal or higher rank: so no import points upward and no two
# stages import each other.
STAGES: dict[str, int] = {
    # the error classifier and the exit codes sit below the other leaves: exit_codes asks faults whether an
    # error is a fault of the moment, and every error class names its exit code (catalog's too)
    "faults": -2,
    "exit_codes": -1,
    # shared leaves: import nothing of trainer/ but the two above
    "atomic": 0,
    "urls": 0,
    "catalog": 0,
    "progress": 0,
    "config": 1,
    "data": 2,
    "model": 3,
    "builtin_assets": 4,  # the built-in tiny model and dataset: written with model/'s loaders
    "restart": 4,
    "report": 5,
    "plan": 5,  # forecasts from numbers; the run reads its memory arithmetic (training/autofit.py)
    "serve": 5,  # final/, export and chat: what is done with a trained run
    "training": 6,  # run.py wires the whole train command, down to final/ (serve/) and the report
    "cli": 8,
    "__main__": 9,
}


# Leaves inside a stage: a module that imports nothing of trainer/ but the ranks below 0, which a lower stage may
# import. restart/defaults.py holds the numbers restart is tuned by, beside the code they tune; the schema
# (config/, rank 1) takes them as its defaults, where users read them.
LEAVES: dict[str, int] = {"trainer.restart.defaults": 0}
RANKS: dict[str, int] = {**STAGES, **LEAVES}


def _stage(module: str) -> str:
    """`trainer.model.loss` -> `model`; `trainer.atomic` -> `atomic`; a leaf is a stage of its own."""
    return module if module in LEAVES else module.split(".")[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path) -> set[str]:
    """The trainer modules `path` imports (anywhere in it, lazily or under TYPE_CHECKING too),
    each the most specific module the import names: `from trainer.data import cache` -> trainer.data.cache."""
    known = {_module_name(p) for p in _modules()}

    def resolve(name: str) -> str:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            named.update(resolve(a.name) for a in node.names)
    return {n for n in named if n.startswith("trainer.") and n in known}


def upward_imports(module: str, targets: set[str]) -> list[str]:
    """Every import of `module` into a stage of its own rank or above (other than its own stage)."""
    own = _stage(module)
    return [
        f"{module} (stage {own}, rank {RANKS[own]}) imports {t} (stage {_stage(t)}, rank {RANKS[_stage(t)]})"
        for t in sorted(targets)
        if _stage(t) != own and RANKS[_stage(t)] >= RANKS[own]
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per import circle of `graph` (module -> modules it imports)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _targets(p) - {_module_name(p)} for p in _modules()}


def test_every_module_belongs_to_a_stage() -> None:
    unranked = sorted({_stage(m) for m in _graph() if m != "trainer"} - set(RANKS))
    assert not unranked, f"give these a stage in STAGES (and CONTRIBUTING.md's map): {unranked}"


def test_each_stage_imports_only_the_stages_below_it() -> None:
    offenders = [
        line for module, targets in _graph().items() if module != "trainer" for line in upward_imports(module, targets)
    ]
    assert not offenders, "\n".join(offenders)


def test_no_import_circle() -> None:
    assert not cycles(_graph()), cycles(_graph())


def test_the_stage_checks_can_fail() -> None:
    """Controls: an upward import, an import between two stages of one rank, and a circle are seen."""
    assert upward_imports(
        "trainer.config.rules", {"trainer.restart.store.lifecycle"}
    )  # config reaching up into restart
    assert upward_imports("trainer.serve.export", {"trainer.report.load"})  # same rank: neither may import the other
    assert not upward_imports("trainer.restart.local.state", {"trainer.model.distributed", "trainer.restart.local.rng"})
    # a leaf may be imported from below; the rest of its stage may not, and a leaf imports nothing of its stage
    assert not upward_imports("trainer.config.schema", {"trainer.restart.defaults"})
    assert upward_imports("trainer.config.schema", {"trainer.restart.ownership.lease"})
    assert upward_imports("trainer.restart.defaults", {"trainer.restart.agree"})
    assert "trainer.restart.defaults" in _targets(PACKAGE / "config" / "schema.py")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert not cycles({"a": {"b"}, "b": {"c"}, "c": set()})
    # and the graph is read from the real code: the training wiring imports restart (a lower stage)
    assert "trainer.restart.local.saving" in _targets(PACKAGE / "training" / "run.py")
    assert "trainer.data.cache" in _targets(PACKAGE / "data" / "prepare.py")  # `from trainer.data import cache`


# The parts of restart/ (its sub-folders, and agree.py), lowest first: the same rule inside the stage, so a
# newcomer reads the parts from the tree in the order they build on each other (CONTRIBUTING.md's map).
RESTART_PARTS: dict[str, int] = {
    "defaults": -1,  # the numbers restart is tuned by: imports nothing (a leaf the schema imports, LEAVES)
    "agree": 0,  # ranks that decide together: imports nothing of restart/
    "signals": 0,  # the stop paths
    "books": 0,  # the ledger, its hand-over records and clocks
    "local": 1,  # this disk's checkpoints; the one save asks the stop flag (signals)
    "store": 2,  # checkpoint.remote: manifests (local/), the ledger's file names (books/)
    "ownership": 3,  # the lock and the lease: written through the store
    "remote": 4,  # what an attempt asks of the store: every part below
}


def _part(module: str) -> str:
    """`trainer.restart.store.lifecycle` -> `store`; `trainer.restart.agree` -> `agree`."""
    return module.split(".")[2]


def upward_parts(module: str, targets: set[str]) -> list[str]:
    """Every import of restart module `module` into a part of restart/ of its own rank or above (other than its own part)."""
    own = _part(module)
    return [
        f"{module} (part {own}, rank {RESTART_PARTS[own]}) imports {t} (part {_part(t)}, rank {RESTART_PARTS[_part(t)]})"
        for t in sorted(targets)
        if t.startswith("trainer.restart.") and _part(t) != own and RESTART_PARTS[_part(t)] >= RESTART_PARTS[own]
    ]


def test_every_restart_module_belongs_to_a_part() -> None:
    parts = {_part(m) for m in _graph() if m.startswith("trainer.restart.")}
    assert parts == set(RESTART_PARTS), f"give these a rank in RESTART_PARTS (and CONTRIBUTING.md's map): {parts}"


def test_each_restart_part_imports_only_the_parts_below_it() -> None:
    offenders = [
        line
        for module, targets in _graph().items()
        if module.startswith("trainer.restart.")
        for line in upward_parts(module, targets)
    ]
    assert not offenders, "\n".join(offenders)
    # The controls: the store reaching up into ownership, and two parts of one rank, are seen; the real code
    # is read (the lease writes through the store, a lower part).
    assert upward_parts("trainer.restart.store.lifecycle", {"trainer.restart.ownership.lease"})
    assert upward_parts("trainer.restart.books.ledger", {"trainer.restart.signals.preemption"})
    assert not upward_parts("trainer.restart.ownership.lease", {"trainer.restart.store.lifecycle"})
    assert "trainer.restart.store.lifecycle" in _targets(PACKAGE / "restart" / "ownership" / "lease.py")


# ---------------------------------------------------------------------------- functions
MAX_FUNCTION_LINES = 80
# Each longer function, and why it may be.
LONG_FUNCTIONS: dict[str, str] = {
    "training/loop.py:train_loop": "the training loop read top to bottom in one place (one readable loop: the house style keeps it whole)",
}


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """`file:function` -> lines, for every function (or method, or nested function) over `limit`."""
    rel = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            lines = node.end_lineno - node.lineno + 1 + len(node.decorator_list)
            if lines > limit:
                found[f"{rel}:{node.name}"] = lines
    return found


def test_every_function_is_at_most_80_lines() -> None:
    too_long = {k: v for p in _modules() for k, v in long_functions(p).items() if k not in LONG_FUNCTIONS}
    assert not too_long, f"split these (limit {MAX_FUNCTION_LINES} lines, or name the exception and why): {too_long}"


def test_the_named_long_functions_exist_and_are_long() -> None:
    """An exception outlives its reason once the function is split or gone: then remove it."""
    found = {k for p in _modules() for k in long_functions(p)}
    assert set(LONG_FUNCTIONS) <= found, set(LONG_FUNCTIONS) - found


def test_the_function_check_can_fail(tmp_path: Path) -> None:
    """Control: an 81-line function is seen, an 80-line one is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    (tmp_path / "f.py").write_text(f"def ok():\n{body}\n\ndef long():\n{body}    return 1\n")
    assert long_functions(tmp_path / "f.py") == {"f.py:long": 81}


# ---------------------------------------------------------------------------- first screen
BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def test_bitsandbytes_hub_kernel_fallback_is_quiet_after_import_trainer() -> None:
    """`import peft` imports bitsandbytes, whose CPU backend warns (on AVX512-BF16 CPUs) that the
    kernels-community build is missing; importing trainer first drops that line, and only that one."""
    script = (
        "import logging, trainer\n"
        f"log = logging.getLogger({BNB_CPU_LOGGER!r})\n"
        "log.warning('Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure', 'x')\n"
        "log.warning('another bitsandbytes warning')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "kernels-community" not in out.stderr
    assert "another bitsandbytes warning" in out.stderr  # control: the logger still speaks
    bare = subprocess.run([sys.executable, "-c", script.replace(", trainer", "")], capture_output=True, text=True)
    assert "kernels-community" in bare.stderr  # control: without trainer's filter the line shows
