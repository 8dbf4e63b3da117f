"""Cloud preemption notices: poll the instance metadata service, stop the way SIGTERM does.

AWS gives a spot VM two minutes' notice, GCP about 30 s, Azure at least 30 s, but none of
them signals the training process in time: the notice sits in the instance metadata
service at 169.254.169.254. `NoticeWatcher` polls it from a daemon thread and, when a
notice appears, calls `Preemption.request` (the same flag SIGTERM sets), so the loop saves
at the next step boundary and exits with `EXIT_PREEMPTED`.

The documents, as each provider serves them:
- AWS (IMDSv2): `PUT /latest/api/token` (header `X-aws-ec2-metadata-token-ttl-seconds`)
  returns a token; `GET /latest/meta-data/spot/instance-action` with header
  `X-aws-ec2-metadata-token` is 404 until a notice, then 200 `{"action": "terminate",
  "time": "2026-11-23T16:02:00Z"}` (`stop` and `hibernate` too).
- GCP: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` is
  `FALSE`, then `TRUE`; the server answers with the same header.
- Azure: `GET /metadata/scheduledevents?api-version=2020-07-01` with `Metadata: true` is
  `{"DocumentIncarnation": n, "Events": [...]}`; an event with `EventType` `Preempt` (spot
  eviction) or `Terminate` whose `Resources` name this VM is the notice, `NotBefore` the time.
  We do not acknowledge it: an acknowledgement lets Azure evict at once, which would only
  shorten the time left to save.

Three GETs do not need a client library: this is the standard library's `urllib`, with
proxies bypassed (169.254.169.254 is link-local; a corporate `http_proxy` must not see it).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import Message
from email.utils import parsedate_to_datetime
from typing import Literal

from trainer.restart import defaults

log = logging.getLogger(__name__)

Mode = Literal["auto", "aws", "gcp", "azure", "off"]
DEFAULT_ENDPOINT = "http://169.254.169.254"
"""The link-local metadata address all three providers serve."""
PROBE_TIMEOUT = 1.0
"""Seconds to wait for the metadata service to answer a connect or a detection probe."""
POLL_TIMEOUT = 5.0
"""Seconds per poll request; a slower answer counts as the endpoint being unreachable."""
AZURE_FIRST_TIMEOUT = 120.0
"""Azure enables Scheduled Events on the first request, which may take up to two minutes."""


class NoticeError(Exception):
    """The endpoint answered, but not with a document this provider serves."""


@dataclass(frozen=True)
class Notice:
    provider: str
    what: str
    """What the provider says will happen (AWS action, Azure event type, GCP `preempted`)."""
    at: datetime | None
    """When the provider says the VM goes away, if it says."""

    def reason(self, now: datetime | None = None) -> str:
        """The line printed when the notice arrives."""
        when = ""
        if self.at is not None:
            left = (self.at - (now or datetime.now(timezone.utc))).total_seconds()
            when = f", the VM goes away at {self.at.isoformat()} (in {left:.0f}s)"
        return f"{self.provider.upper()} preemption notice ({self.what}{when})"


def _http(url: str, headers: dict[str, str], timeout: float, method: str = "GET") -> tuple[int, str, Message]:
    """(status, body, response headers, looked up case-insensitively); HTTP errors are answers,
    not exceptions; OSError when unreachable."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with opener.open(request, timeout=timeout) as r:
            return r.status, r.read(65536).decode("utf-8", "replace"), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(65536).decode("utf-8", "replace"), e.headers


def _at(text: str | None, parse: Callable[[str], datetime]) -> datetime | None:
    try:
        return parse(text) if text else None
    except (TypeError, ValueError):
        return None  # the notice matters more than its time


class Aws:
    name = "aws"

    def __init__(self, base: str) -> None:
        self.base = base
        self._token: str | None = None

    def _fetch_token(self, timeout: float) -> str:
        url = f"{self.base}/latest/api/token"
        status, body, _ = _http(url, {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, timeout, method="PUT")
        if status != 200 or not body.strip():
            raise NoticeError(f"PUT {url} answered HTTP {status}, not an IMDSv2 token")
        return body.strip()

    def probe(self) -> bool:
        self._token = self._fetch_token(PROBE_TIMEOUT)
        return True

    def poll(self) -> Notice | None:
        url = f"{self.base}/latest/meta-data/spot/instance-action"
        for attempt in range(2):
            if self._token is None:
                self._token = self._fetch_token(POLL_TIMEOUT)
            status, body, _ = _http(url, {"X-aws-ec2-metadata-token": self._token}, POLL_TIMEOUT)
            if status == 401 and attempt == 0:  # the token expired (6 h TTL): fetch a new one once
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise NoticeError(f"GET {url} answered HTTP {status}")
        doc = json.loads(body)
        return Notice("aws", f"action {doc.get('action', '?')}", _at(doc.get("time"), datetime.fromisoformat))


class Gcp:
    name = "gcp"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, base: str) -> None:
        self.url = f"{base}/computeMetadata/v1/instance/preempted"

    def _get(self, timeout: float) -> str:
        status, body, headers = _http(self.url, self.HEADERS, timeout)
        # The real server answers with the same header; anything else is not GCP's metadata service.
        if status != 200 or headers.get("Metadata-Flavor") != "Google":
            raise NoticeError(f"GET {self.url} answered HTTP {status} without Metadata-Flavor: Google")
        return body.strip().upper()

    def probe(self) -> bool:
        return self._get(PROBE_TIMEOUT) in ("TRUE", "FALSE")

    def poll(self) -> Notice | None:
        value = self._get(POLL_TIMEOUT)
        if value not in ("TRUE", "FALSE"):
            raise NoticeError(f"GET {self.url} answered {value[:40]!r}, expected TRUE or FALSE")
        return Notice("gcp", "preempted, about 30s left", None) if value == "TRUE" else None


class Azure:
    name = "azure"
    HEADERS = {"Metadata": "true"}
    STOPS = ("Preempt", "Terminate")
    """Event types after which this VM is gone (spot eviction; deletion)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.url = f"{base}/metadata/scheduledevents?api-version=2020-07-01"
        self.vm_name: str | None = None
        self._polled = False

    def probe(self) -> bool:
        # The instance endpoint answers at once (Scheduled Events may not) and names this VM,
        # which is how an event in the same availability set but for another VM is told apart.
        url = f"{self.base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        status, body, _ = _http(url, self.HEADERS, PROBE_TIMEOUT)
        if status != 200 or not body.strip():
            raise NoticeError(f"GET {url} answered HTTP {status}")
        self.vm_name = body.strip()
        return True

    def poll(self) -> Notice | None:
        if self.vm_name is None:  # never guess: a Preempt for a neighbour is not a reason to stop
            self.probe()
        timeout = POLL_TIMEOUT if self._polled else AZURE_FIRST_TIMEOUT
        status, body, _ = _http(self.url, self.HEADERS, timeout)
        self._polled = True
        if status != 200:
            raise NoticeError(f"GET {self.url} answered HTTP {status}")
        for event in json.loads(body).get("Events", []):
            resources = event.get("Resources") or []
            if event.get("EventType") in self.STOPS and self.vm_name in resources:
                at = _at(event.get("NotBefore"), parsedate_to_datetime)
                return Notice("azure", f"{event['EventType']} event {event.get('EventId', '?')}", at)
        return None


Source = Aws | Gcp | Azure
PROVIDERS: dict[str, type[Aws] | type[Gcp] | type[Azure]] = {"gcp": Gcp, "aws": Aws, "azure": Azure}
"""Detection order for `auto`: GCP and Azure identify themselves by header or document; AWS by its token."""


def _listening(base: str) -> bool:
    """Whether anything accepts a TCP connection at the endpoint: on a laptop or CI, nothing does."""
    parts = urllib.parse.urlsplit(base)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=PROBE_TIMEOUT):
            return True
    except OSError:
        return False


def detect(base: str) -> Source | None:
    """The provider whose metadata service answers at `base`, or None (quietly: the common case)."""
    if not _listening(base):
        log.debug("no metadata service at %s: notice watcher off", base)
        return None
    for cls in PROVIDERS.values():
        source = cls(base)
        try:
            if source.probe():
                return source
        except Exception as e:  # whatever answers there, it is not this provider
            log.debug("%s probe at %s: %s", cls.name, base, e)
    return None


class NoticeWatcher:
    """Polls one provider's notice in a daemon thread; calls `on_notice(reason)` once, then stops.

    `mode="auto"` detects the provider once in the thread (the main thread never waits) and
    stops without a word when no metadata service answers. An endpoint that goes down
    mid-run is a warning, never a stop: training goes on and polling retries.
    """

    def __init__(
        self,
        mode: Mode,
        on_notice: Callable[[str], object],
        endpoint: str | None = None,
        poll_seconds: float = defaults.NOTICE_POLL_SECONDS,
    ) -> None:
        self.mode = mode
        self.on_notice = on_notice
        self.base = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self.poll_seconds = poll_seconds
        self.source: Source | None = None
        self.notice: Notice | None = None
        self.detected = threading.Event()
        """Set once the provider is known (or known to be absent)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NoticeWatcher:
        if self.mode != "off":
            self._thread = threading.Thread(target=self._run, name="spotune-notice", daemon=True)
            self._thread.start()
        else:
            self.detected.set()
        return self

    def stop(self, timeout: float = 1.0) -> None:
        """Ask the thread to end; a request in flight is abandoned (the thread is a daemon)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.source = detect(self.base) if self.mode == "auto" else PROVIDERS[self.mode](self.base)
        finally:
            self.detected.set()
        if self.source is None:
            return
        self._say(
            f"watching for {self.source.name.upper()} preemption notices at {self.base} every {self.poll_seconds:g}s"
        )
        failing = False
        while not self._stop.is_set():
            try:
                notice = self.source.poll()
            except Exception as e:  # any bad answer (even a malformed document) must never stop training
                if not failing:  # one warning per outage, not one per poll
                    self._say(
                        f"cannot read the {self.source.name} preemption notice at {self.base} ({e}); training goes on, polling continues"
                    )
                failing = True
            else:
                if failing:
                    self._say(f"{self.source.name} notice endpoint {self.base} answers again")
                failing = False
                if notice is not None:
                    self.notice = notice
                    self.on_notice(notice.reason())
                    return
            self._stop.wait(self.poll_seconds)

    @staticmethod
    def _say(line: str) -> None:
        print(f"spotune: {line}", file=sys.stderr, flush=True)
