"""URLs of run directories and checkpoint stores: the one way to show one (`redact`), and what
a recipe may hold (`remote_problems`). Shared by the config rules, the store and the report.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """`url` without user:password@ and without a query string (signed URLs, SAS tokens)."""
    parts = urlsplit(url)
    local = not parts.scheme or len(parts.scheme) == 1  # a path (or a Windows drive letter)
    if local or parts.scheme == "file" and not parts.netloc:
        return url.split("?", 1)[0]
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def one_line(e: BaseException) -> str:
    """An exception's message on one line for logs, the ledger and the ranks' messages, any URL in it
    redacted (a signed URL or credentials in an error never reach a log)."""
    text = " ".join(str(e).split())[:300]
    return re.sub(r"[a-z][a-z0-9+.-]*://[^\s'\"]+", lambda m: redact(m.group(0)), text)


def known_protocol(url: str) -> str | None:
    """None when fsspec knows the URL's scheme (a plain path is a local directory), else the problem."""
    from fsspec.registry import known_implementations, registry

    scheme = urlsplit(url).scheme
    if not scheme or len(scheme) == 1:  # a relative path, or a Windows drive letter
        return None
    if scheme in known_implementations or scheme in registry:
        return None
    return f"unknown URL scheme {scheme!r}; use s3://, gs://, az://, file:// or a local directory"


_SECRET_KEY = re.compile(r"(^|_)(key|secret|token|password|credentials?|connection_string|sas_token)$", re.I)


def remote_problems(remote: str | None, storage_options: dict[str, Any]) -> list[str]:
    """Config problems of `checkpoint.remote` / `checkpoint.storage_options`, one per line.

    No credential may sit in the recipe: the resolved config is saved in config.yaml and in
    every checkpoint, local and remote.
    """
    p: list[str] = []
    if remote is not None:
        problem = known_protocol(remote)
        if problem:
            p.append(f"checkpoint.remote: {problem}")
        parts = urlsplit(remote)
        if parts.username or parts.password or parts.query:
            p.append(
                "checkpoint.remote: the URL carries credentials or a query string (a signed URL?); give the plain "
                "URL and let the cloud's credential chain (env vars, profile, instance role) sign requests"
            )
    for key in _flat_keys(storage_options):
        if _SECRET_KEY.search(key.rsplit(".", 1)[-1]):
            p.append(
                f"checkpoint.storage_options.{key}: credentials do not belong in the recipe (it is saved with every "
                "checkpoint); use the cloud's standard chain, e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            )
    return p


def _flat_keys(options: Any, prefix: str = "") -> list[str]:
    if not isinstance(options, dict):
        return []
    keys: list[str] = []
    for k, v in options.items():
        keys += _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return keys
