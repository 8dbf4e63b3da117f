"""Cloud preemption notices against a real HTTP server on 127.0.0.1 that serves the documents
AWS (IMDSv2), GCP and Azure serve: no notice -> no stop; a notice -> the stop flag within a
poll; server down -> no crash, no stop; `auto` detection; and end to end, `spotune train`
saves and exits with the requeue code when the server turns to "preempted", then resumes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import warm_start
import yaml

from trainer import config as C
from trainer.exit_codes import EXIT_FINISHED, EXIT_PREEMPTED
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.signals import notice as N
from trainer.restart.signals.preemption import Preemption

REPO = Path(__file__).resolve().parents[1]
POLL = 0.05
STEPS = 16
TOKEN = "AQAEAFakeImdsV2Token=="
VM = "spotune-vm-7"


class Metadata:
    """What one provider's metadata service would answer; flip `preempted` to send the notice."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.preempted = False
        self.garbage = False
        """Answer every request with 200 and a JSON list: no provider's document."""
        self.requests: list[tuple[str, str]] = []

    def answer(self, method: str, path: str, headers: Message) -> tuple[int, str, dict[str, str]]:
        """`headers` look-ups are case-insensitive, as in HTTP (urllib sends `Metadata-flavor`)."""
        self.requests.append((method, path))
        if self.garbage:
            return 200, "[1, 2]", {"Metadata-Flavor": "Google"}
        if self.provider == "aws":
            if method == "PUT" and path == "/latest/api/token":
                if "X-aws-ec2-metadata-token-ttl-seconds" not in headers:
                    return 400, "", {}
                return 200, TOKEN, {}
            if path == "/latest/meta-data/spot/instance-action":
                if headers.get("X-aws-ec2-metadata-token") != TOKEN:
                    return 401, "", {}
                if self.preempted:
                    return 200, json.dumps({"action": "terminate", "time": "2026-11-23T16:02:00Z"}), {}
                return 404, "<html>404 - Not Found</html>", {}
        if self.provider == "gcp" and path == "/computeMetadata/v1/instance/preempted":
            if headers.get("Metadata-Flavor") != "Google":
                return 403, "Missing Metadata-Flavor:Google header.", {}
            return 200, "TRUE" if self.preempted else "FALSE", {"Metadata-Flavor": "Google"}
        if self.provider == "azure" and headers.get("Metadata") == "true":
            if path == "/metadata/instance/compute/name?api-version=2021-02-01&format=text":
                return 200, VM, {}
            if path == "/metadata/scheduledevents?api-version=2020-07-01":
                events: list[dict[str, Any]] = [  # an event for another VM in the same availability set is never ours
                    {"EventId": "A1", "EventType": "Preempt", "Resources": ["other-vm"], "EventStatus": "Scheduled"}
                ]
                if self.preempted:
                    events.append(
                        {
                            "EventId": "B2",
                            "EventType": "Preempt",
                            "ResourceType": "VirtualMachine",
                            "Resources": [VM],
                            "EventStatus": "Scheduled",
                            "NotBefore": "Mon, 23 Nov 2026 16:02:00 GMT",
                            "EventSource": "Platform",
                            "DurationInSeconds": -1,
                        }
                    )
                return 200, json.dumps({"DocumentIncarnation": 1 + self.preempted, "Events": events}), {}
        return 404, "not found", {}


class Server:
    """ThreadingHTTPServer on 127.0.0.1 in a thread, answering from a `Metadata`."""

    def __init__(self, meta: Metadata, port: int = 0) -> None:
        self.meta = meta

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                status, body, headers = meta.answer(self.command, self.path, self.headers)
                data = body.encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = _serve

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # serve_forever's poll interval is how long `close` (shutdown) waits: 0.5 s by default, per server.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(POLL,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator:
    started: list[Server] = []

    def make(provider: str, port: int = 0) -> Server:
        started.append(Server(Metadata(provider), port))
        return started[-1]

    yield make
    for s in started:
        s.close()


def _free_port() -> int:
    """A port where nothing listens (just released)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_url() -> str:
    return f"http://127.0.0.1:{_free_port()}"


def _watch(mode: str, url: str) -> tuple[N.NoticeWatcher, Preemption]:
    stop = Preemption()  # request() only: no signal handlers needed here
    return N.NoticeWatcher(mode, stop.request, url, poll_seconds=POLL).start(), stop  # type: ignore[arg-type]


def _polls(meta: Metadata, n: int, timeout: float = 10.0) -> None:
    """Wait until the server has seen n more requests (so 'no stop' is not vacuous)."""
    target = len(meta.requests) + n
    deadline = time.monotonic() + timeout
    while len(meta.requests) < target and time.monotonic() < deadline:
        time.sleep(POLL / 2)
    assert len(meta.requests) >= target, f"watcher stopped polling: {meta.requests}"


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_no_notice_no_stop_then_notice_stops_within_a_poll(provider: str, serve, capsys) -> None:
    server = serve(provider)
    watcher, stop = _watch(provider, server.url)
    try:
        _polls(server.meta, 5)
        assert not stop.requested and watcher.notice is None
        assert "cannot read" not in capsys.readouterr().err  # those polls were answered, not failed
        server.meta.preempted = True
        flipped = time.monotonic()
        while not stop.requested and time.monotonic() - flipped < 5:
            time.sleep(0.005)
        assert stop.requested, "no stop after the notice"
        # one poll interval plus one request's round trip on a loaded 2-core machine
        assert time.monotonic() - flipped < POLL + 1.0
    finally:
        watcher.stop()
    assert watcher.notice is not None and watcher.notice.provider == provider
    err = capsys.readouterr().err
    assert f"{provider.upper()} preemption notice" in err and "saving a checkpoint" in err and "cannot read" not in err
    assert stop.reason is not None and stop.reason.startswith(f"{provider.upper()} preemption notice")


def test_notice_says_when_the_vm_goes_away(serve) -> None:
    from datetime import datetime, timezone

    for provider, what in (("aws", "action terminate"), ("azure", "Preempt event B2")):
        server = serve(provider)
        server.meta.preempted = True
        source = N.PROVIDERS[provider](server.url)
        source.probe()
        got = source.poll()
        assert got is not None and got.what == what
        assert got.at == datetime(2026, 11, 23, 16, 2, tzinfo=timezone.utc)
        reason = got.reason(now=datetime(2026, 11, 23, 16, 0, tzinfo=timezone.utc))
        assert reason.endswith("the VM goes away at 2026-11-23T16:02:00+00:00 (in 120s))")


def test_azure_event_for_another_vm_is_not_ours(serve) -> None:
    server = serve("azure")
    source = N.Azure(server.url)
    assert source.poll() is None
    assert (
        source.vm_name == VM
        and ("GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text") in server.meta.requests
    )
    source.vm_name = "other-vm"  # control: were we that VM, its event would be our notice
    got = source.poll()
    assert got is not None and got.what == "Preempt event A1"


def test_aws_expired_token_is_renewed(serve) -> None:
    server = serve("aws")
    source = N.Aws(server.url)
    source._token = "expired"
    assert source.poll() is None
    assert [m for m, _ in server.meta.requests] == ["GET", "PUT", "GET"]


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_server_down_no_crash_no_stop(provider: str, serve, capsys) -> None:
    port = _free_port()
    watcher, stop = _watch(provider, f"http://127.0.0.1:{port}")
    time.sleep(10 * POLL)
    assert watcher._thread is not None and watcher._thread.is_alive(), "the watcher died"
    assert not stop.requested
    # the service comes back on the same address: polling went on, and a notice still stops the run
    server = serve(provider, port)
    _polls(server.meta, 2)
    assert not stop.requested
    server.meta.preempted = True
    deadline = time.monotonic() + 5
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    assert stop.requested
    err = capsys.readouterr().err
    assert err.count(f"cannot read the {provider} preemption notice") == 1, err  # one warning per outage
    assert f"{provider} notice endpoint http://127.0.0.1:{port} answers again" in err


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_malformed_document_warns_and_never_stops(provider: str, serve, capsys) -> None:
    server = serve(provider)
    server.meta.garbage = True
    watcher, stop = _watch(provider, server.url)
    _polls(server.meta, 4)
    assert watcher._thread is not None and watcher._thread.is_alive() and not stop.requested
    watcher.stop()
    assert f"cannot read the {provider} preemption notice" in capsys.readouterr().err


def test_wrong_answers_are_errors_not_notices(serve) -> None:
    server = serve("aws")  # serves nothing for GCP or Azure paths
    with pytest.raises(N.NoticeError, match="without Metadata-Flavor: Google"):
        N.Gcp(server.url).poll()
    with pytest.raises(N.NoticeError, match="HTTP 404"):
        N.Azure(server.url).poll()


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_auto_detects_each_provider(provider: str, serve) -> None:
    server = serve(provider)
    source = N.detect(server.url)
    assert source is not None and source.name == provider


def test_auto_without_metadata_service_is_silent_and_stops(capsys) -> None:
    url = _free_url()
    started = time.monotonic()
    watcher, stop = _watch("auto", url)
    assert watcher.detected.wait(5)
    watcher._thread.join(5)  # type: ignore[union-attr]
    assert not watcher._thread.is_alive() and watcher.source is None  # type: ignore[union-attr]
    assert time.monotonic() - started < 3
    assert not stop.requested
    assert capsys.readouterr().err == ""


def test_auto_sees_no_provider_in_an_unrelated_server(serve, capsys) -> None:
    server = serve("none")  # listens, but is no metadata service
    assert N.detect(server.url) is None
    assert capsys.readouterr().err == ""


def test_off_starts_nothing() -> None:
    watcher, _ = _watch("off", _free_url())
    assert watcher._thread is None and watcher.detected.is_set()


def test_config_keys_validated() -> None:
    cfg = C.load(None, ["checkpoint.preemption_notice=gcp", "checkpoint.notice_endpoint=http://127.0.0.1:9"])
    assert cfg.checkpoint.preemption_notice == "gcp"
    assert C.load(None).checkpoint.preemption_notice == "off"  # no metadata traffic off the cloud
    with pytest.raises(C.ConfigError) as e:
        C.load(
            None,
            [
                "checkpoint.preemption_notice=ibm",
                "checkpoint.notice_endpoint=169.254.169.254",
                "checkpoint.notice_poll_seconds=0",
            ],
        )
    msg = str(e.value)
    assert "checkpoint.preemption_notice: expected one of 'auto', 'aws', 'gcp', 'azure', 'off', got 'ibm'" in msg
    assert "checkpoint.notice_endpoint: must be a plain http(s)://host[:port][/path] URL" in msg
    assert "got '169.254.169.254'" in msg
    for bad in ("http://user:s3cret@127.0.0.1:80", "http://127.0.0.1/?sig=s3cret"):
        with pytest.raises(C.ConfigError, match="checkpoint.notice_endpoint") as e:
            C.load(None, [f"checkpoint.notice_endpoint={bad}"])
        assert "s3cret" not in str(e.value)  # the message does not echo a secret back
    assert "checkpoint.notice_poll_seconds: must be above 0, got 0.0" in msg


# ---------------------------------------------------------------------------- end to end


def _train(recipe: Path, log: Path) -> warm_start.Started:
    """`spotune train RECIPE`, forked from the warm forkserver (tests/warm_start.py), its output in `log`."""
    return warm_start.start(["train", str(recipe)], log, new_session=False)


def test_train_saves_and_exits_on_notice_then_resumes(tmp_path, tiny_llama, tiny_data, serve, capsys) -> None:
    server = serve("aws")
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(out),
                "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
                "adapter": {"r": 4, "alpha": 8},
                "data": {"path": str(tiny_data), "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
                "train": {"max_steps": STEPS, "micro_batch_size": 2, "grad_accum": 1},
                "checkpoint": {
                    "every_steps": None,
                    "every_minutes": None,
                    "preemption_notice": "auto",  # detection included: the server is AWS's
                    "notice_endpoint": server.url,
                    "notice_poll_seconds": POLL,
                },
                "metrics": {"progress": False, "report": False, "log_every": 1},
            }
        )
    )
    log = tmp_path / "train.log"
    proc = _train(recipe, log)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and proc.poll() is None:
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.01)
        server.meta.preempted = True
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, output
    assert "AWS preemption notice (action terminate" in output
    manager = CheckpointManager(out / "checkpoints", keep_last=3)
    saved, _ = manager.latest_verified()
    assert saved is not None and manager.committed() == [saved], output  # the one save: the notice's
    step = manager.step_of(saved)
    assert 2 <= step < STEPS, output  # mid-run, after the flip
    assert "watching for AWS preemption notices" in output

    # the same recipe on the "next VM" (no notice any more) resumes from that step; in this process, as
    # the claim is what it resumes from (the exit code of a process was the first run's claim)
    from drill_reference import train_here

    server.meta.preempted = False
    capsys.readouterr()
    assert train_here([str(recipe)]) == EXIT_FINISHED
    output = "".join(capsys.readouterr())
    assert f"resuming from {saved} at step {step} of {STEPS}" in output
    assert (out / "final" / "adapter_model.safetensors").is_file()
