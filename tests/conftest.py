"""Shared fixtures: tiny random models of real architectures and a tokenizer, built offline once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

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


def pytest_sessionstart(session: pytest.Session) -> None:  # noqa: ARG001
    """The environment the suite started with (tests that start `spotune` processes compare to it)."""
    STARTING_ENV.update(os.environ)


STARTING_ENV: dict[str, str] = {}
