"""A fault-injecting HTTP reverse proxy between spotune and moto's S3 server, run as its own process:

    python tests/fault_proxy.py --listen PORT --upstream http://127.0.0.1:MOTO_PORT --control FILE

Every request reads FILE (JSON; absent = pass everything through):
- `{"down": true}`: the store is cut off: each request is answered 503 or its connection reset
  (alternately), nothing reaches moto;
- `{"double_put": N}`: the next N PUTs reach moto twice, the client sees the second answer (s3fs
  resending a PUT whose first copy landed: a conditional one then gets 412);
- `{"strip_conditions": true}`: If-Match / If-None-Match are dropped (a store that ignores them);
- `{"refuse": [RULE, ...]}`: a request whose `METHOD target` matches a rule's `match` (a regular
  expression) never reaches moto: `"as": "flaky"` answers 503 SlowDown and resets the connection
  alternately (a throttled, failing store), `"as": "denied"` answers 403 AccessDenied (a role that
  lacks the permission), `"as": "answer"` answers its `"status"` with S3 error `"code"` (a store that does not
  implement a request, a full disk, a skewed clock). A rule with `"times": N` refuses its next N matches only;
  one with `"header": NAME` only requests that carry that header (a conditional PUT: `if-none-match`).
Counts of what it did go to FILE + ".log" (one JSON line per request) for the tests to check.

mitmproxy (`mitmdump --mode reverse:...`) would do the same, but every release pins cryptography
and h11 below what this environment holds, so this is plain asyncio (HTTP/1.1, one request per
upstream connection, `Connection: close` both ways)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import struct
from pathlib import Path
from urllib.parse import urlsplit

CONDITIONS = (b"if-match", b"if-none-match")


class Proxy:
    def __init__(self, upstream: str, control: Path) -> None:
        parts = urlsplit(upstream)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.control = control
        self.n = 0

    def state(self) -> dict:
        try:
            return json.loads(self.control.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def note(self, **what: object) -> None:
        with open(str(self.control) + ".log", "a") as f:
            f.write(json.dumps(what) + "\n")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if b"\r\nexpect: 100-continue" in head.lower():  # aiobotocore waits for this before the body
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            body = await read_body(reader, head)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()
            return
        method, path = head.split(b" ", 2)[:2]
        state = self.state()
        self.n += 1
        if state.get("down"):
            self.note(method=method.decode(), path=path.decode(), action="down")
            if self.n % 2:
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
            else:  # a reset: SO_LINGER 0 makes close() send RST
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            return
        names = {h.split(b":", 1)[0].strip().lower().decode() for h in head.split(b"\r\n")[1:] if b":" in h}
        rule = self.refusal(state, f"{method.decode()} {path.decode()}", names)
        if rule is not None:
            self.note(method=method.decode(), path=path.decode(), action=f"refused {rule['as']}")
            await self.refuse(writer, rule, head=method == b"HEAD")
            return
        lines = head.split(b"\r\n")
        kept = [lines[0]] + [
            h
            for h in lines[1:]
            if h
            and h.split(b":", 1)[0].strip().lower() not in (b"connection", b"expect")
            and not (state.get("strip_conditions") and h.split(b":", 1)[0].strip().lower() in CONDITIONS)
        ]
        request = b"\r\n".join(kept + [b"Connection: close", b"", b""]) + body
        times = 1
        if method == b"PUT" and int(state.get("double_put", 0)) > 0:
            state["double_put"] = int(state["double_put"]) - 1
            tmp = self.control.with_suffix(".proxy-tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.control)
            times = 2
        answer = b""
        for _ in range(times):
            answer = await self.forward(request)
        self.note(method=method.decode(), path=path.decode(), times=times, status=answer[9:12].decode())
        writer.write(answer)
        await writer.drain()
        writer.close()

    def refusal(self, state: dict, request: str, headers: set[str]) -> dict | None:
        """The first rule of `refuse` that matches `request` ("METHOD target") and `headers`, its count taken down."""
        rules = state.get("refuse") or []
        for rule in rules:
            if "header" in rule and rule["header"] not in headers:
                continue
            if re.search(rule["match"], request) and int(rule.get("times", 1)) > 0:
                if "times" in rule:
                    rule["times"] = int(rule["times"]) - 1
                    tmp = self.control.with_suffix(".proxy-tmp")
                    tmp.write_text(json.dumps(state))
                    tmp.replace(self.control)
                return rule
        return None

    async def refuse(self, writer: asyncio.StreamWriter, rule: dict, head: bool) -> None:
        how = rule["as"]
        if how == "answer":
            status, code = int(rule["status"]), str(rule["code"])
            body = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{code}</Message></Error>"
            ).encode()
            writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\n" % (status, code.encode()))
        elif how == "denied":
            body = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n")
        else:
            self.n += 1
            if self.n % 2 == 0:  # a reset: SO_LINGER 0 makes close() send RST
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()
                return
            body = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            writer.write(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n")
        if head:  # a HEAD answer carries no body; botocore reads the status alone
            body = b""
        writer.write(b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    async def forward(self, request: bytes) -> bytes:
        r, w = await asyncio.open_connection(self.host, self.port)
        w.write(request)
        await w.drain()
        answer = await r.read()  # upstream closes after one response (Connection: close)
        w.close()
        return answer


async def read_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The request body, raw: by Content-Length, or chunked (botocore streams some uploads)."""
    headers = {
        k.strip().lower(): v.strip() for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:] if b":" in h)
    }
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        out = b""
        while True:
            size_line = await reader.readuntil(b"\r\n")
            out += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:  # trailers (botocore's checksum), then an empty line
                while True:
                    line = await reader.readuntil(b"\r\n")
                    out += line
                    if line == b"\r\n":
                        return out
            out += await reader.readexactly(size + 2)
    return b""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--control", type=Path, required=True)
    args = ap.parse_args()
    proxy = Proxy(args.upstream, args.control)

    async def serve() -> None:
        server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.listen)
        print("listening", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()


class FaultProxy:
    """The test side: start the proxy process, set its state, read what it did."""

    def __init__(self, upstream: str, workdir: Path) -> None:
        import subprocess
        import sys

        from moto_fixture import free_port

        self.control = workdir / "proxy.json"
        self.control.write_text("{}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            __file__,
            "--listen",
            str(self.port),
            "--upstream",
            upstream,
            "--control",
            str(self.control),
        ]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "listening"

    def set(self, **state: object) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.control)

    def log(self) -> list[dict]:
        path = Path(str(self.control) + ".log")
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
