"""What do checkpoints, and uploading them, cost the training loop?

Runs the tiny recipe (recipes/tiny-cpu.yaml: a tiny random Llama on CPU, a save every 20
steps) twice in this process: once with local checkpoints only, once with
`checkpoint.remote` on an S3 API (moto's server in a subprocess on localhost, so its work
does not share this interpreter; reached through s3fs with AWS_ENDPOINT_URL). From each
attempt's ledger row it prints:

- the time the loop is blocked per save (the ledger's checkpoint seconds / saves), with and
  without a remote, and their ratio (the upload runs in a background thread: goal ~1);
- checkpoint (+ upload) overhead as a share of training wall time at the recipe's interval,
  and projected at the default `checkpoint.every_minutes` (30 minutes); goal <= 1%;
- the upload's own seconds and bytes per save from metrics.jsonl, and the whole process
  wall time with a remote against without (it includes the final upload's flush).

    .venv/bin/python benchmarks/checkpoint_overhead.py [--steps 80]
Needs `pip install 'spotune[test]'` (moto[server], s3fs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import config as C  # noqa: E402
from trainer.restart.books.ledger import read_rows  # noqa: E402
from trainer.training import run  # noqa: E402


def moto_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start; pip install 'moto[server]'")


def one_run(out: Path, steps: int, remote: str | None) -> dict[str, Any]:
    cfg = C.load(REPO / "recipes" / "tiny-cpu.yaml", [f"output_dir={out}", f"train.max_steps={steps}"])
    cfg = cfg.replace(**{"checkpoint.remote": remote, "metrics.progress": False, "metrics.log_every": 1})
    started = time.perf_counter()
    assert run.train(cfg) == 0
    wall = time.perf_counter() - started
    row = read_rows(out)[-1]
    every = cfg.checkpoint.every_steps or steps
    saves = len({s for s in range(1, steps + 1) if s % every == 0} | {steps})
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    uploads = {r["remote_step"]: (r["upload_seconds"], r["upload_bytes"]) for r in metrics if "upload_seconds" in r}
    return {
        "wall": wall,
        "train_wall": (row["productive_seconds"] + row["checkpoint_seconds"] + row["lost_seconds"]),
        "blocked": row["checkpoint_seconds"],
        "saves": saves,
        "uploads": uploads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    server, endpoint = moto_server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    try:
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("spotune-bench")
        with tempfile.TemporaryDirectory() as tmp:
            one_run(Path(tmp) / "warm", 2, None)  # imports, data cache, tiny assets: not measured
            local = one_run(Path(tmp) / "local", args.steps, None)
            remote = one_run(Path(tmp) / "remote", args.steps, "s3://spotune-bench/run")
    finally:
        server.terminate()
        server.wait()

    default_interval = 60 * C.CheckpointConfig().every_minutes  # type: ignore[operator]
    print(f"tiny-cpu recipe, {args.steps} steps, a save every 20 steps ({local['saves']} saves)")
    for name, r in (("local only", local), ("with remote", remote)):
        per_save = r["blocked"] / r["saves"]
        print(
            f"  {name:12s} blocked per save {per_save * 1000:7.1f} ms | overhead at the recipe interval "
            f"{100 * r['blocked'] / r['train_wall']:5.2f}% | projected at every_minutes=30: "
            f"{100 * per_save / default_interval:.4f}% | process wall {r['wall']:.1f}s"
        )
    seconds = [s for s, _ in remote["uploads"].values()]
    sizes = [b for _, b in remote["uploads"].values()]
    if seconds:
        print(
            f"  background upload per save: {sum(seconds) / len(seconds):.3f}s, {sum(sizes) / len(sizes) / 1e6:.2f} MB "
            f"({len(seconds)} uploads seen in metrics rows)"
        )
    ratio = (remote["blocked"] / remote["saves"]) / max(local["blocked"] / local["saves"], 1e-9)
    print(f"ratio blocked per save, remote / local: {ratio:.2f} (goal ~1: the upload is off the loop)")
    print(f"ratio process wall, remote / local: {remote['wall'] / local['wall']:.3f} (includes the final flush)")
    share = remote["blocked"] / remote["train_wall"]
    print(f"checkpoint+upload overhead share at the recipe interval: {100 * share:.2f}% (goal <= 1% at the default)")


if __name__ == "__main__":
    main()
