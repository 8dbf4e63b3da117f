"""Any rank's exit reason reaches the exit file (SPOTUNE_EXIT_FILE) that the templates read:
the ranks merge their codes into it, the most specific wins (trainer/exit_codes.py, PRIORITY)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer import builtin_assets
from trainer import exit_codes as E

REPO = Path(__file__).resolve().parents[1]


def test_most_specific_follows_the_documented_priority() -> None:
    assert E.most_specific([E.EXIT_ERROR, E.EXIT_OUT_OF_MEMORY]) == E.EXIT_OUT_OF_MEMORY
    assert E.most_specific([E.EXIT_PREEMPTED, E.EXIT_ERROR]) == E.EXIT_PREEMPTED
    assert E.most_specific([E.EXIT_FINISHED, E.EXIT_ERROR]) == E.EXIT_ERROR
    assert E.most_specific([E.EXIT_FINISHED, E.EXIT_FINISHED]) == E.EXIT_FINISHED
    assert E.most_specific([E.EXIT_BAD_INPUT, E.EXIT_OUT_OF_MEMORY, E.EXIT_BUSY]) == E.EXIT_BAD_INPUT
    assert E.most_specific([-9, E.EXIT_FINISHED]) == -9  # a code not listed ranks with the error
    assert set(E.PRIORITY) == {v for k, v in vars(E).items() if k.startswith("EXIT_") and isinstance(v, int)}


def test_ranks_merge_into_one_file_and_an_earlier_attempt_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "code"
    started = time.time()
    E.record(E.EXIT_ERROR, since=started, path=str(path))  # rank 0: its collective broke
    E.record(E.EXIT_OUT_OF_MEMORY, since=started, path=str(path))  # rank 1: the cause
    assert path.read_text() == "5\n"
    E.record(E.EXIT_FINISHED, since=started, path=str(path))
    assert path.read_text() == "5\n"
    # A later attempt that reuses the path: the old code is not merged in.
    os.utime(path, (started - 60, started - 60))
    E.record(E.EXIT_FINISHED, since=started, path=str(path))
    assert path.read_text() == "0\n"


def test_cli_writes_its_code_on_every_rank(tmp_path: Path) -> None:
    exit_file = tmp_path / "code"
    env = {**os.environ, E.EXIT_FILE_ENV: str(exit_file), "RANK": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "trainer", "train", "train.no_such_key=1"], env=env)
    assert done.returncode == E.EXIT_BAD_INPUT and exit_file.read_text() == f"{E.EXIT_BAD_INPUT}\n"


def test_a_traceback_is_recorded_as_an_error(tmp_path: Path) -> None:
    exit_file = tmp_path / "code"
    code = "from trainer.cli import main; main._main = lambda argv: 1 / 0; main.main([])"
    env = {**os.environ, E.EXIT_FILE_ENV: str(exit_file), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert done.returncode == 1 and exit_file.read_text() == f"{E.EXIT_ERROR}\n"


# Rank 1 runs out of memory at its second step (a test-only sitecustomize makes the loss raise
# torch's own OutOfMemoryError there); rank 0 is left waiting in a collective.
SITECUSTOMIZE = """
import os
if os.environ.get("RANK") == "1":
    import torch
    from trainer.model import objective  # the loop's SFT objective calls the loss there

    real, calls = objective.token_loss_sum, []

    def token_loss_sum(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated on rank 1)")
        return real(*args, **kwargs)

    objective.token_loss_sum = token_loss_sum
"""


@pytest.mark.slow
def test_out_of_memory_on_rank_1_reaches_the_exit_file_as_5(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    recipe = tmp_path / "recipe.yaml"
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
        "train": {"max_steps": 6, "micro_batch_size": 1, "grad_accum": 1},
        "checkpoint": {"every_steps": None, "every_minutes": None},
        "metrics": {"progress": False, "report": False},
    }
    recipe.write_text(yaml.safe_dump(raw))
    exit_file = tmp_path / "code"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{tmp_path / 'inject'}:{REPO}",
        E.EXIT_FILE_ENV: str(exit_file),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*cmd, "-m", "trainer", "train", str(recipe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1  # torchrun's own code for any failed rank: why the file exists
    assert "out of memory at step 3" in done.stderr and "To fit:" in done.stderr, done.stderr[-3000:]
    assert exit_file.read_text() == f"{E.EXIT_OUT_OF_MEMORY}\n", done.stderr[-3000:]


def test_an_exit_file_that_cannot_be_written_keeps_the_code(tmp_path: Path) -> None:
    env = {**os.environ, E.EXIT_FILE_ENV: str(tmp_path / "gone" / "code"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "train.no_such_key=1"], env=env, capture_output=True, text=True
    )
    assert done.returncode == E.EXIT_BAD_INPUT and "could not write the exit code to" in done.stderr


def _chain(*errors: BaseException) -> BaseException:
    """`errors[0]` raised from `errors[1]` raised from ... (as each library wraps the one below it)."""
    for outer, inner in zip(errors, errors[1:], strict=False):
        outer.__cause__ = inner
    return errors[0]


def test_a_fault_of_the_moment_is_told_by_its_causes() -> None:
    """`transient` decides 143 for any exception the CLI catches, by its chain of causes, wherever the
    fault came from: the store (s3fs turns a 503 SlowDown into an OSError from botocore's ClientError), the
    hub (transformers wraps huggingface_hub's LocalEntryNotFoundError, raised from httpx's ConnectError, in
    an OSError, which spotune wraps in a DataError), the network itself. A setting is never one."""
    import httpx
    from botocore.exceptions import ClientError
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    from s3fs.errors import translate_boto_error

    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.restart.store.errors import StoreDenied, StoreUnreachable

    def s3(code: str, status: int) -> BaseException:
        return translate_boto_error(
            ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")
        )

    hub_down = _chain(
        DataError("cannot load a tokenizer from 'org/model'"),
        OSError("We couldn't connect to 'https://huggingface.co'"),
        LocalEntryNotFoundError("cannot find the requested files"),
        httpx.ConnectError("[Errno 111] Connection refused"),
    )
    offline = _chain(
        ConfigError(["model.name_or_path: cannot load 'org/model'"]),
        OSError("We couldn't connect"),
        LocalEntryNotFoundError("outgoing traffic has been disabled"),
        OfflineModeIsEnabled("HF_HUB_OFFLINE"),
    )
    transient = [hub_down, s3("SlowDown", 503), s3("InternalError", 500), ConnectionResetError(), TimeoutError()]
    transient += [StoreUnreachable("the store does not answer"), _chain(RuntimeError("x"), httpx.ReadTimeout("slow"))]
    settings = [offline, s3("AccessDenied", 403), StoreDenied("refused"), s3("NoSuchBucket", 404), ValueError("x")]
    assert [E.transient(e) for e in transient] == [True] * len(transient)
    assert [E.transient(e) for e in settings] == [False] * len(settings)  # the control: these are 2 or 1
    assert isinstance(s3("AccessDenied", 403), PermissionError)  # what tells a refusal: s3fs's own mapping


def test_one_classifier_gives_every_error_its_code() -> None:
    """`code_for` is what the command line exits with and what agree.py carries to the other ranks: a
    carried code first, a fault of the moment by its causes, else the most derived class listed."""
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.restart.agree import Agreed
    from trainer.restart.ownership.lease_object import LeaseLost
    from trainer.restart.ownership.lock import RunBusy
    from trainer.restart.store.errors import StoreDenied, StoreError, StoreOffline, StoreUnreachable
    from trainer.restart.store.verify import Corrupt

    cases = {
        E.EXIT_BAD_INPUT: [ConfigError(["x"]), DataError("x"), StoreDenied("x"), StoreError("no gcsfs")],
        E.EXIT_PREEMPTED: [
            StoreUnreachable("x"),
            Corrupt("x"),
            StoreOffline("x"),
            _chain(DataError("x"), TimeoutError()),
        ],
        E.EXIT_BUSY: [RunBusy("x"), LeaseLost("x")],
        E.EXIT_OUT_OF_MEMORY: [Agreed("rank 1 ran out", E.EXIT_OUT_OF_MEMORY)],
        E.EXIT_ERROR: [KeyError("x"), RuntimeError("x")],
    }
    assert {code: [E.code_for(e) for e in errors] for code, errors in cases.items()} == {
        code: [code] * len(errors) for code, errors in cases.items()
    }


def test_a_tokenizer_the_hub_could_not_serve_keeps_the_cause_that_decides_the_exit_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hub that does not answer while the tokenizer is fetched is 143 (restart); offline mode with the
    tokenizer not cached is 2 (a setting): the DataError keeps huggingface_hub's cause, which tells them apart."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    from trainer.data import DataError
    from trainer.data.tokenizer import local_dir

    def failing(cause: BaseException) -> Any:
        def snapshot_download(*args: Any, **kwargs: Any) -> str:
            raise _chain(LocalEntryNotFoundError("cannot find the requested files"), cause)

        return snapshot_download

    outcomes = []
    for cause in (httpx.ConnectError("[Errno 111] Connection refused"), OfflineModeIsEnabled("HF_HUB_OFFLINE")):
        monkeypatch.setattr(huggingface_hub, "snapshot_download", failing(cause))
        with pytest.raises(DataError, match="not in the local HF cache") as e:
            local_dir("org/model", None)
        outcomes.append(E.transient(e.value))
    assert outcomes == [True, False]  # the second is the control


# Rank 0 loses its lease (exit_busy ends the process from the thread that found it) after rank 1
# recorded running out of memory in the same attempt: the file keeps 5, the most specific.
LOSES_ITS_LEASE = """
import sys
from trainer.restart.ownership.reclaim import exit_busy
print("started", flush=True)
sys.stdin.readline()  # rank 1 records its code meanwhile
exit_busy("another attempt took the run's lease")
"""


def test_a_lost_lease_merges_into_the_exit_file_as_every_code_does(tmp_path: Path) -> None:
    exit_file = tmp_path / "code"
    env = {**os.environ, E.EXIT_FILE_ENV: str(exit_file), "RANK": "0", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen(
        [sys.executable, "-c", LOSES_ITS_LEASE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdin is not None and p.stdout.readline() == "started\n"
    E.record(E.EXIT_OUT_OF_MEMORY, since=time.time() - 60, path=str(exit_file))  # rank 1, this attempt
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(timeout=60) == E.EXIT_BUSY
    assert exit_file.read_text() == f"{E.EXIT_OUT_OF_MEMORY}\n"
    # Control: alone, the lost lease is what the file says.
    exit_file.unlink()
    done = subprocess.run([sys.executable, "-c", LOSES_ITS_LEASE], env=env, input="\n", capture_output=True, text=True)
    assert done.returncode == E.EXIT_BUSY and exit_file.read_text() == f"{E.EXIT_BUSY}\n"
