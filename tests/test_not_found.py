"""A name that exists neither here nor on the hub is a setting to fix (exit 2, naming the path), never a fault
of the moment: a supervisor reruns 143, so a typo would requeue for ever. Only a hub that does not answer is
143. Offline here: "does not answer" is an endpoint nothing listens at, and "answers" a local HTTP server
that says what the hub says of an unknown repository (404, X-Error-Code: RepoNotFound)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from moto_fixture import free_port

from trainer.cli.main import main
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_PREEMPTED


def _hub_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> None:
    """huggingface_hub pointed at `endpoint`, online, with an empty cache; the working directory a fresh clone."""
    from huggingface_hub import constants

    from trainer.data import hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub, "RETRY_SECONDS", (0.0,))  # one retry, at once


@pytest.fixture
def silent_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub that does not answer: nothing listens at its endpoint."""
    _hub_at(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port()}")


class _NoSuchRepo(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b'{"error": "Repository Not Found"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def answering_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A hub that answers: it knows no repository."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _hub_at(monkeypatch, tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_a_missing_relative_model_folder_is_exit_2_naming_it(
    tmp_path: Path, silent_hub: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`models/my-llama` beside a `models/` folder is a path, decided without the hub (which does not answer):
    today it is taken for a hub id and the run exits 143 ("run the same command again"), for ever."""
    (tmp_path / "models").mkdir()
    code, err = _run(["train", "model.name_or_path=models/my-llama", f"output_dir={tmp_path / 'run'}"], capsys)
    assert code == EXIT_BAD_INPUT, err
    assert "model.name_or_path" in err and str(tmp_path / "models" / "my-llama") in err and "not a local folder" in err


def test_a_misspelt_hub_id_the_hub_does_not_know_is_exit_2_saying_it_is_neither(
    tmp_path: Path, answering_hub: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hub answered "no such repository": the message says the name is neither a local folder nor a hub id
    (today: "no hub model", leaving the reader to wonder whether a folder of that name was looked for)."""
    code, err = _run(
        ["train", "model.name_or_path=meta-llama/Llama-3.1-8B-Instrct", f"output_dir={tmp_path / 'run'}"], capsys
    )
    assert code == EXIT_BAD_INPUT, err
    assert "meta-llama/Llama-3.1-8B-Instrct" in err and "neither a local folder" in err and "hub model id" in err


def test_a_missing_data_folder_is_exit_2_naming_it(
    tmp_path: Path, silent_hub: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`data.path=data/mine` beside a `data/` folder is a missing folder: today it is taken for a hub dataset id,
    retried for 85 s while the hub does not answer, and the run exits 143."""
    (tmp_path / "data").mkdir()
    code, err = _run(["prepare", "data.path=data/mine", f"output_dir={tmp_path / 'run'}"], capsys)
    assert code == EXIT_BAD_INPUT, err
    assert "data.path" in err and str(tmp_path / "data" / "mine") in err and "does not exist" in err


def test_a_valid_looking_id_and_a_hub_that_does_not_answer_is_a_fault_of_the_moment(
    tmp_path: Path, silent_hub: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control: no local folder of the name's first part, and no hub to ask: nothing says it is a typo, so
    it is a fault of the moment (143: the same command once the hub answers), for data and for a model."""
    code, err = _run(["prepare", "data.path=org/mine", f"output_dir={tmp_path / 'run'}"], capsys)
    assert code == EXIT_PREEMPTED, err
    assert "could not be reached" in err
    code, err = _run(["train", "model.name_or_path=org/my-llama", f"output_dir={tmp_path / 'run2'}"], capsys)
    assert code == EXIT_PREEMPTED and "could not be reached" in err, err
