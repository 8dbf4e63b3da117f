"""Hub datasets: which `data.path` names one, and fetching a revision of it into the HF cache.

A hub dataset is read through `huggingface_hub.snapshot_download(repo_type="dataset")`, so it
lands in the normal HF cache (`HF_HOME`, `HF_HUB_CACHE`), shares it with `datasets` and other
tools, and `HF_HUB_OFFLINE=1` reads that cache without the network. A download names the commit
it resolved to (the snapshot folder is named by it); the run pins that commit (trainer/data/sources.py).
Tokens come from `HF_TOKEN` or `huggingface-cli login` through huggingface_hub itself: nothing
here reads, prints or stores one.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer.data.read import DATA_ENDINGS, DataError
from trainer.faults import classify

PREFIX = "hf://datasets/"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None
    """As written in `hf://datasets/org/name@revision`; None when the path names none."""

    def url(self, revision: str | None) -> str:
        return f"{PREFIX}{self.repo_id}" + (f"@{revision}" if revision else "")


def parse(path: str) -> HubId | None:
    """The hub dataset `path` names, or None for a local path.

    `hf://datasets/org/name[@revision]` always names the hub. A bare `org/name` does when no such
    local path exists, its name does not end like a data file (`data/train.jsonl` is a missing
    file, not a dataset), the way `datasets.load_dataset` resolves names, and it does not look like a
    local path (`looks_local`: `data/mine` with a `data/` folder here is a missing folder, said at once,
    not a hub id retried while the hub does not answer).
    """
    if path.startswith(PREFIX):
        repo, _, rev = path[len(PREFIX) :].partition("@")
        repo = repo.rstrip("/")
        if not _REPO.match(repo):
            raise DataError(f"{path}: expected {PREFIX}org/name[@revision] (a dataset id of the form org/name)")
        return HubId(repo, rev or None)
    if path.startswith("hf://"):
        raise DataError(f"{path}: only hub datasets are read; write {PREFIX}org/name[@revision]")
    if Path(path).exists() or not _REPO.match(path) or path.lower().endswith(DATA_ENDINGS) or looks_local(path):
        return None
    return HubId(path, None)


def looks_local(name: str) -> bool:
    """Whether `name`, which does not exist here, was meant as a local path and not a hub id (org/name),
    decided without the network (a hub that does not answer must not turn a typo into a retry for ever):
    it starts like a path (`/`, `./`, `../`, `~`), holds more parts than org/name (or the OS's own
    separator, where that is not `/`), or its first part is a folder here (`models/my-llama` beside a
    `models/` folder, `data/mine` beside `data/`)."""
    if name.startswith(("/", "./", "../", "~")) or (os.sep != "/" and os.sep in name):
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def not_found(key: str, name: str, kind: str) -> str:
    """The message for a name that is neither a local path here nor (the hub answered) a hub id."""
    return (
        f"{key}: {name!r} is neither a local {'folder' if kind == 'model' else 'file or folder'} (no such path: "
        f"{Path(name).expanduser().absolute()}) nor a hub {kind} id the hub knows (it answered: no such {kind}, "
        "or it is private or gated): check the path or the id, or set HF_TOKEN to a token that can read it."
    )


RETRY_SECONDS = (5.0, 20.0, 60.0)
"""Waits between attempts when the hub cannot be reached (and the cache cannot stand in)."""


class HubUnreachable(ConnectionError):
    """The hub could not be reached and the cache lacks what was asked: a transient fault, so not
    a DataError (whose exit code tells a supervisor not to rerun): the process exits 143
    (trainer/faults.py `transient`)."""


def download(hub: HubId, revision: str | None, patterns: list[str] | None, key: str) -> tuple[Path, str]:
    """The snapshot folder of `revision` (None: the default branch) holding the files matching
    `patterns` (None: all), and the commit it resolved to. Errors name the key and the fix; an
    unreachable hub is retried (RETRY_SECONDS), then raises HubUnreachable."""
    for wait in (*RETRY_SECONDS, None):
        try:
            return _download(hub, revision, patterns, key)
        except HubUnreachable as e:
            if wait is None:
                raise
            print(f"spotune: {e} Retrying in {wait:.0f}s.", file=sys.stderr, flush=True)
            time.sleep(wait)
    raise AssertionError("unreachable")  # the loop returns or raises


def _download(hub: HubId, revision: str | None, patterns: list[str] | None, key: str) -> tuple[Path, str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = hub.url(revision)
    try:
        folder = snapshot_download(hub.repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns)
    except GatedRepoError:
        raise DataError(
            f"{key}: {where} is gated: accept its terms on https://huggingface.co/datasets/{hub.repo_id} "
            "and set HF_TOKEN to a token of that account (or run `hf auth login`)."
        ) from None
    except RevisionNotFoundError:
        raise DataError(
            f"{key}: {hub.repo_id} has no revision {revision!r}; set the revision to a branch, tag or commit it has."
        ) from None
    except RepositoryNotFoundError:
        raise DataError(not_found(key, hub.repo_id, "dataset")) from None
    except LocalEntryNotFoundError:
        if not _offline():
            raise HubUnreachable(
                f"{key}: {where} is not in the local HF cache and the hub could not be reached; check the "
                "network (a private or gated dataset also needs HF_TOKEN)."
            ) from None
        raise DataError(
            f"{key}: {where} is not in the local HF cache and HF_HUB_OFFLINE is set: run once with the network "
            "(unset HF_HUB_OFFLINE) to download it, check the id, or point HF_HOME at the cache that holds it; "
            "a private or gated dataset also needs HF_TOKEN."
        ) from None
    except HfHubHTTPError as e:
        verdict = classify(e)  # the one classifier of hub and store errors
        if verdict.transient:
            raise HubUnreachable(f"{key}: the hub failed to serve {where} ({verdict}).") from None
        if verdict.kind in ("credentials", "permission"):
            raise DataError(
                f"{key}: the hub refused {where} ({verdict}); set HF_TOKEN to a token that can read it."
            ) from None
        raise DataError(f"{key}: the hub refused {where} ({verdict}: {str(e).splitlines()[0]}).") from e
    return Path(folder), Path(folder).name


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def listing(hub: HubId, commit: str, snapshot: Path, key: str) -> list[str]:
    """Every file of the dataset at `commit` (relative paths): the hub's listing, or, offline or with
    the hub out of reach, the files of that commit the cache holds."""
    if not _offline():
        from huggingface_hub import HfApi

        try:
            return HfApi().list_repo_files(hub.repo_id, repo_type="dataset", revision=commit)
        except Exception as e:  # a network or server fault (httpx's are no OSErrors): the cache's copy of the commit
            print(f"spotune: {key}: cannot list {hub.url(commit)} ({type(e).__name__}); reading what the cache holds")
    return sorted(
        f.relative_to(snapshot).as_posix()
        for f in snapshot.rglob("*")
        if (f.is_file() or f.is_symlink()) and not any(p.startswith(".") for p in f.relative_to(snapshot).parts[:-1])
    )


def exactly(paths: list[str]) -> list[str]:
    """`allow_patterns` that match these paths and nothing else (a `[` in a name is not a glob)."""
    import glob

    return [glob.escape(p) for p in paths]
