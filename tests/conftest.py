"""Shared fixtures: tiny random models of real architectures and a tokenizer, built offline once per session."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The uninterrupted run every kill-and-resume drill compares against, trained once per session.
from drill_reference import uninterrupted  # noqa: E402,F401  (a fixture)

# A real S3 API on localhost (moto's server) for the remote-checkpoint tests.
from moto_fixture import moto_endpoint, s3_remote  # noqa: E402,F401  (fixtures)

from trainer import builtin_assets

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _isolated_spotune_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Built-in assets go to a per-session directory unless the caller chose one (CI caches it)."""
    if "SPOTUNE_HOME" not in os.environ:
        os.environ["SPOTUNE_HOME"] = str(tmp_path_factory.mktemp("spotune-home"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_assets.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Callable[..., Path]:
    """Factory: `tiny_model("qwen2")` -> directory with a tiny random model and tokenizer (cached per arch)."""
    built: dict[str, Path] = {}

    def make(arch: builtin_assets.Arch = "llama") -> Path:
        if arch not in built:
            built[arch] = builtin_assets.build_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tokenizer_dir=tiny_tokenizer
            )
        return built[arch]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_assets.write_dataset(tmp_path_factory.mktemp("tiny-data") / "train.jsonl", n=400)


def _threads_per_worker() -> int | None:
    """Under pytest-xdist (`make test` runs `-n auto`): the CPU's cores shared out among the workers.

    Each worker, and every process it starts, would otherwise run torch's default of one
    intra-op thread per core, so two workers on two cores oversubscribe them twice over and
    OpenMP's spinning threads slow every test down. None when no worker runs this process."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


@pytest.fixture(scope="session", autouse=True)
def _share_the_cores_among_workers() -> Iterator[None]:
    threads = _threads_per_worker()
    if threads is None:
        yield
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every process a test starts
    torch.set_num_threads(threads)
    yield


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """Modules marked `bitwise` train with one intra-op thread: this process (in-process
    references) and every process it starts (OMP_NUM_THREADS, inherited).

    Why: those modules assert that separate training runs agree bit for bit. On the 2-core CI VMs,
    with torch's default two intra-op threads, about one training process in six came out
    1-ulp different from its first micro-batch on, uninterrupted reference runs included (so no
    resume logic is involved), and stayed self-consistent afterwards. One such process was caught
    computing RoPE's cos 1.5e-4 off on exactly the rows the OpenMP worker thread computed, while
    the main thread's rows and the inputs were exact; repeating the same kernels in one process
    (3,600 forward/backward passes, 10^5 cos calls beside signals, forks and page churn) never
    differed. Measured on `test_one_writer_drill.py -k sigkill_the_holder`: 5 of 28 runs failed
    with two threads, 0 of 16 with OMP_NUM_THREADS=1. Two threads give the same bits as one when
    nothing goes wrong (tiny models split no reduction across threads), so this pins what the
    drills test, spotune's restore, and leaves the platform's fault out. Not suite-wide: a
    compiled-layer test (test_compile.py) took 52 s on one thread against 24 s on two."""
    if request.node.get_closest_marker("bitwise") is None:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


MODULE_SECONDS = json.loads((Path(__file__).with_name("module_seconds.json")).read_text())
"""Measured seconds per test module (scripts/test_durations.py refreshes them from a JUnit report)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules longest first, by their measured seconds (a module not measured yet: first if it holds
    a `slow` test, else last); the tests of a module keep their order.

    `make test` runs one pytest worker per core with `--dist loadfile --no-loadscope-reorder`, which
    hands out whole modules in this order as workers free up: a long drill module picked up last
    would keep the whole suite waiting on it while the other cores idle (xdist's own order, by the
    number of tests in a module, put the drills, which have few tests, last)."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow") and item.module}

    def seconds(item: pytest.Item) -> float:
        name = item.module.__name__ if item.module is not None else ""
        return MODULE_SECONDS.get(name, math.inf if name in slow_modules else 0.0)

    items.sort(key=lambda item: -seconds(item))  # stable: a module's tests stay together, in order
