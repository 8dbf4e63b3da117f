"""The GPU check: everything a CUDA machine must show about spotune, part by part, each under a cap.

    bash .gpu-carry/run.sh                       # a GPU box without a network (`make gpu-carry` first)
    bash .gpu-carry/run.sh --slice longest       # one slice, for a second command (see --plan)
    make gpu-check                               # a GPU machine with a network (.venv, set-up)
    python scripts/gpu_check.py --plan           # the parts, their caps and what each proves (JSON)
    python scripts/gpu_check.py --dry --out DIR  # every part at CPU size (CI)

The parts run in the order of what decides most (`PARTS`): the set-up (the carried wheels into
this Python), the environment, correctness on CUDA, the exit paths, the restart drill, the 8B
speed table, the memory estimate against the measured peak. Each runs as its own process tree,
killed whole at its cap (`run_capped`); a part that fails or is cut does not stop the next.
After every part the report (`gpu-check.md` and `.json`, each part's log in `logs/`) is
rewritten, and copied with the logs and the benchmark JSON into $OUT (`--copy-to`) as at most 8
files, so a command ended early still returns every finished part.

Nothing is downloaded: models are random-initialised from shipped configs; the data and the
tokenizer come from --data/--tokenizer, else the carry folder's `data/`, else the data folder
beside the repository, else spotune's built-in tiny assets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import atomic  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
PY = sys.executable
DATA_NAME = "gpteacher-roleplay.json"
TOKENIZER_NAME = "llama2-tokenizer"
COMMAND = "bash .gpu-carry/run.sh"
COMMAND_LIMIT_S = 480
"""The limit the one command is documented with; every cap together stays under it (with 30 s to spare)."""
DRY_CAP_FACTOR = 4
"""--dry's caps are the GPU's times this: a 2-core CI machine starts each Python process slower than
the GPU box, and the dry run proves the parts run, not how fast."""
MAX_COPIED_FILES = 8
LOG_TAIL_BYTES = 200_000
"""Of each part's log, what the combined log that travels back keeps (its end)."""
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class Part:
    """One part's outcome: pass / fail / cut (ended by its cap), its figure (one line), its log."""

    def __init__(self, name: str, cap_s: float) -> None:
        self.name, self.cap_s = name, cap_s
        self.status, self.figure, self.log, self.seconds = "fail", "", "", 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "figure": self.figure,
            "seconds": round(self.seconds, 1),
            "cap_s": self.cap_s,
            "log": self.log[-6000:],
        }


@dataclass(frozen=True)
class Spec:
    """A part of the plan: its function, its cap on the GPU and what it proves (docs/gpu.md)."""

    run: Callable[[argparse.Namespace, Part], None]
    cap_s: int
    proves: str
    artifact: str | None = None  # a JSON file of its own, copied back with the report


# ---------------------------------------------------------------------------- running a part


def run_capped(args: argparse.Namespace, part: Part, cmd: list[str]) -> int | None:
    """Run `cmd` as this part's process tree, its output into the part's log; its exit code, or
    None when the cap ended it. At the cap, and after a normal exit too, every process of the
    tree is killed: its process group, and each descendant that started a group or session of
    its own (the resume drill's trainer does), so nothing of one part outlives it or holds the GPU."""
    log_path = args.out / "logs" / f"{part.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cap = part.cap_s
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        # A process group of its own, in this session: killed as one at the cap, and still ended with
        # the command if the whole check is killed (a new session would outlive it).
        group: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=part_env(args), **group)
        args.running = proc
        try:
            code: int | None = proc.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            left = kill_tree(proc)
            args.running = None
    part.log = log_path.read_text(errors="replace")
    if code is None:
        part.log += f"\n(cut at the {cap:.0f} s cap)"
    elif left:
        part.log += f"\n({left} processes it left behind were killed)"
    return code


def kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL every process of `proc`'s tree and group; how many besides `proc` were alive."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    in_group = []  # orphans of the group (their parent gone) are no longer in the tree
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if p.pid != proc.pid and os.getpgid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                in_group.append(p)
    alive = {p.pid: p for p in tree + in_group}
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in alive.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    psutil.wait_procs(list(alive.values()), timeout=5)
    return len(alive)


def part_env(args: argparse.Namespace) -> dict[str, str]:
    """Offline, unbuffered, the repository and the wheels installed with --target importable."""
    paths = [*args.pythonpath, str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _pytest_figure(out: str) -> str:
    m = re.findall(r"=+ (.*(?:passed|failed|skipped|error|deselected|collected).*?) in [\d.]+s", out)
    return m[-1] if m else out.strip().splitlines()[-1] if out.strip() else "no output"


def _ran_any(figure: str) -> bool:
    """Whether a pytest summary line counts any test that ran (passed, failed, xfailed...)."""
    return bool(re.search(r"\b\d+ (passed|failed|xfailed|xpassed|errors?)\b", figure))


def _progress(log: str) -> str:
    """What a pytest -v run cut short had done: its result words counted."""
    counts = {w: len(re.findall(rf"\s{w}\b", log)) for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    return ", ".join(f"{n} {w.lower()}" for w, n in counts.items() if n) or "no test finished"


def pytest_part(args: argparse.Namespace, part: Part, targets: list[str], dry_targets: list[str]) -> None:
    """pytest on `targets` (-v: a run cut at its cap still shows each test that finished)."""
    cmd = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", *(dry_targets if args.dry else targets)]
    code = run_capped(args, part, cmd)
    if code is None:
        part.status, part.figure = "cut", f"cut at the {part.cap_s:.0f} s cap after {_progress(part.log)}"
        return
    part.figure = _pytest_figure(part.log)
    part.status = "pass" if code == 0 else "fail"
    if part.status == "pass" and not args.dry and not _ran_any(part.figure):
        # pytest exits 0 when every test skipped: on a GPU machine that means torch saw no GPU
        # (or a marker broke), which is the very thing this part is here to catch.
        part.status = "fail"
        part.figure = f"no GPU test ran ({part.figure}); the skip reasons are in the log: does torch see the GPU?"


def gpu_test_files() -> list[str]:
    """The test modules with a `gpu` marker: collecting only them saves importing the whole suite."""
    return sorted(
        str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()
    )


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------- the parts


def setup(args: argparse.Namespace, part: Part) -> None:
    """The carried wheels into this Python (no venv inside its venv): into its own site-packages
    where it may write, else with --target into a folder the later parts put on PYTHONPATH.
    Without dependencies: the carry holds exactly what the image lacks (scripts/gpu_carry.py);
    what they require of the image is checked after (`pip check`), and named where it falls short."""
    wheels = sorted((args.carry / "wheels").glob("*.whl")) if args.carry else []
    if not wheels:
        part.status = "pass"
        part.figure = "nothing to install (no carry folder): the parts use this environment's packages"
        return
    site = Path(sysconfig.get_paths()["purelib"])
    target = args.install_into or (None if os.access(site, os.W_OK) else args.out / "site-packages")
    options = ["--target", str(target), "--upgrade"] if target is not None else []
    if target is not None:
        args.pythonpath.insert(0, str(target))
    code = run_capped(args, part, [PY, "-c", INSTALL, *options, *map(str, wheels)])
    names = ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in wheels)
    where = f"--target {target} (on PYTHONPATH)" if target is not None else str(site)
    if code is None:
        part.status, part.figure = "cut", f"pip was cut at the {part.cap_s:.0f} s cap installing {names}"
        return
    if code != 0:
        part.figure = f"pip install of {names} into {where} failed (the log says why)"
        return
    ours = {w.name.split("-")[0].replace("_", "-").lower() for w in wheels}
    unmet = [
        line.strip()
        for line in part.log.splitlines()
        if line.split(" ")[0].replace("_", "-").lower() in ours
        and (" requires " in line or " has requirement " in line)
    ]
    part.status = "pass"
    part.figure = f"{len(wheels)} wheels into {where}: {names}" + (f"; unmet: {'; '.join(unmet[:5])}" if unmet else "")


INSTALL = """
import subprocess, sys
pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
options = ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
code = subprocess.call(pip + options + sys.argv[1:])
if code == 0:
    subprocess.call(pip + ["check"])  # the image's own conflicts are listed too: the part keeps its packages'
sys.exit(code)
"""
"""pip install, then pip check, as one process under the set-up's cap."""


def environment(args: argparse.Namespace, part: Part) -> None:
    code = run_capped(args, part, [PY, "-c", ENV_PROBE, ENV_MARKER])
    if code is None:
        part.status, part.figure = "cut", f"the environment probe was cut at the {part.cap_s:.0f} s cap"
        return
    # Found by its marker: a library may log after it (bitsandbytes names a missing optional
    # package on stderr at import).
    found = [line for line in part.log.splitlines() if line.startswith(ENV_MARKER)]
    if code != 0 or not found:
        part.figure = "the environment probe failed (the log says why)"
        return
    env = json.loads(found[-1].removeprefix(ENV_MARKER))
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    part.figure = (
        f"{env['gpu']} (driver {env['driver']}), CUDA {env['cuda']}; {versions}; attention auto: {env['attention']}"
    )
    args.environment = env
    missing = [k for k in ("bitsandbytes", "liger-kernel", "datasets") if env["versions"].get(k) == "not installed"]
    part.status = "pass" if (env["cuda_available"] and not missing) or args.dry else "fail"
    if missing and not args.dry:
        part.figure = f"not installed: {', '.join(missing)}; " + part.figure


ENV_MARKER = "gpu-check-environment: "
"""Starts the probe's one result line (the probe is given it as its argument)."""
ENV_PROBE = """
import json, subprocess, sys, warnings
import torch
from importlib.metadata import PackageNotFoundError, version
import trainer  # first: it quiets bitsandbytes' optional-kernel notice
from trainer.model import attention, load as model
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
NAMES = ["torch", "transformers", "peft", "accelerate", "triton", "bitsandbytes", "liger-kernel", "datasets",
         "pyarrow", "fsspec", "dill", "multiprocess", "flash-attn", "nvidia-ml-py"]
cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    choice = model.resolve_attn_implementation("auto", device)
why = "; ".join(str(w.message) for w in caught) or attention.varlen_unavailable_reason() or "its first choice"
driver = "none"
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.strip() or "none"
except OSError:
    pass
paths = {"train and the spotune arms (auto)": f"{choice} ({why})", "HF Trainer arms": "sdpa (as its docs show it)"}
print(sys.argv[1] + json.dumps({"gpu": torch.cuda.get_device_name(0) if cuda else "no GPU (CPU)", "driver": driver,
    "cuda": torch.version.cuda, "cuda_available": cuda, "versions": {n: v(n) for n in NAMES},
    "attention": "; ".join(f"{k}: {c}" for k, c in paths.items())}))
"""


def gpu_tests(args: argparse.Namespace, part: Part) -> None:
    files = gpu_test_files()
    # CPU: every one of them skips; collecting proves they import.
    pytest_part(args, part, ["-m", "gpu", *files], ["-m", "gpu", "--collect-only", "-q", *files])


def exit_paths(args: argparse.Namespace, part: Part) -> None:
    # CI runs the whole file in the suite already: the dry run collects it.
    tests = ["tests/test_exit_paths.py", "-m", "not slow"]
    pytest_part(args, part, tests, [*tests, "--collect-only", "-q"])


def resume_drill(args: argparse.Namespace, part: Part) -> None:
    result = args.out / "drill.json"
    result.unlink(missing_ok=True)
    cmd = [PY, "scripts/resume_drill.py", str(args.out / "work" / "drill"), "--json", str(result)]
    cmd += ["--data", str(args.data)] if args.data else []
    cmd += ["--tokenizer", str(args.tokenizer)] if args.tokenizer else []
    cmd += ["--dry"] if args.dry else []
    code = run_capped(args, part, cmd)
    found = _json(result)
    if code is None:
        part.status, part.figure = "cut", f"cut at the {part.cap_s:.0f} s cap; last line: {_last_line(part.log)}"
    elif found is None:
        part.figure = f"the drill exited {code} without a result; last line: {_last_line(part.log)}"
    else:
        part.status, part.figure = ("pass" if found["ok"] else "fail"), found["figure"]


def _last_line(log: str) -> str:
    lines = [line for line in log.strip().splitlines() if line.strip() and not line.startswith("(cut at")]
    return lines[-1][-200:] if lines else "none"


def _bench_cmd(args: argparse.Namespace, out: Path, gpu: list[str], dry: list[str]) -> list[str]:
    cmd = [PY, "benchmarks/gpu.py", "--json", str(out)]
    shm = Path("/dev/shm")  # the random 8B weights load from memory (16 GB), not from disk, on every arm
    if not args.dry and shm.is_dir() and shutil.disk_usage(shm).free > 40 * 2**30:
        cmd += ["--work", str(SHM_WORK)]
    return cmd + (dry if args.dry else gpu)


SHM_WORK = Path("/dev/shm/spotune-gpu-check")
"""Removed after every benchmark part: a part cut at its cap leaves its 16 GB of weights there."""


def bench_part(args: argparse.Namespace, part: Part, out: Path, cmd: list[str]) -> None:
    """benchmarks/gpu.py: its table from the JSON it rewrites after every arm, cut or not."""
    out.unlink(missing_ok=True)
    try:
        code = run_capped(args, part, cmd)
    finally:
        shutil.rmtree(SHM_WORK, ignore_errors=True)
    found = _json(out)
    if found is None:
        part.figure = "benchmarks/gpu.py wrote no JSON" + (" before its cap" if code is None else f" (exit {code})")
        part.status = "cut" if code is None else "fail"
        return
    arms = found["arms"]
    shown = [
        f"{name} {r['tokens_per_s']:.0f} tok/s, {r['peak_memory_gib']:.1f} GiB"
        if r.get("peak_memory_gib")
        else f"{name} {r['tokens_per_s']:.0f} tok/s"
        for name, r in arms.items()
        if "tokens_per_s" in r
    ]
    skipped = [f"{name} skipped ({r['skipped']})" for name, r in arms.items() if "skipped" in r]
    part.figure = "; ".join(shown + found.get("ratios", []) + skipped) or "no arm measured"
    if found["pending"]:
        part.figure += f"; not measured: {', '.join(found['pending'])}"
    if code is None:
        part.status = "cut"
        part.figure = f"cut at the {part.cap_s:.0f} s cap: " + part.figure
    else:
        part.status = "pass" if code == 0 and not found["pending"] else "fail"


def speed_8b(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-gpu.json"
    gpu = ["--steps", "4", "--warmup", "1"]  # every arm: 3 timed steps of 4 rows of 4096 tokens
    dry = ["--tiny", "--steps", "2", "--warmup", "1", "--seq", "64", "--arms", "spotune"]
    bench_part(args, part, out, _bench_cmd(args, out, gpu, dry))


def memory_point(args: argparse.Namespace, part: Part) -> None:
    """The estimate of spotune's LoRA (and QLoRA) peak beside the peak the speed part measured."""
    found = _json(args.out / "bench-gpu.json")
    if found is None:
        part.figure = "no bench-gpu.json: the speed part measured nothing"
        return
    shown, ok = [], []
    for method, m in found["memory_estimate_gib"].items():
        if m["measured"]:
            ratio = m["estimate"] / m["measured"]
            shown.append(f"{method} estimate {m['estimate']:.2f} GiB / measured {m['measured']:.2f} GiB = {ratio:.2f}")
            ok.append(0.90 <= ratio <= 1.10)
        else:
            shown.append(f"{method} estimate {m['estimate']:.2f} GiB, not measured")
    part.figure = "; ".join(shown) + " (goal 0.90-1.10)"
    part.status = "pass" if (ok and all(ok)) or (args.dry and not ok) else "fail"


def slice_longest(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-longest.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "benchmarks/gpu_memory.py", "--json", str(out), "--probe", "512" if args.dry else "131072"]
    code = run_capped(args, part, cmd + (["--tiny"] if args.dry else []))
    found = _json(out)
    if code is None or found is None:
        part.status = "cut" if code is None else "fail"
        part.figure = f"no probe result ({'cut at the cap' if code is None else f'exit {code}'})"
        return
    p = found["probe"]
    measured = f"{p['allocated_gib']:.1f} GiB allocated" if p.get("allocated_gib") else "no allocator figure (CPU)"
    part.figure = (
        f"8B QLoRA r32, one {p['seq']}-token row: "
        + (f"out of memory ({p['error']})" if "error" in p else f"fits, {measured}, {p['seconds']:.0f} s")
        + f"; estimate {p['estimate']['allocated']:.1f} GiB allocated"
    )
    part.status = "pass" if code == 0 and "error" not in p else "fail"


def slice_nf4(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-nf4.json"
    out.unlink(missing_ok=True)
    paths = ["bf16_dense", "bnb_matmul_4bit", "bnb_dequant_linear", "bnb_invoke_quant"]  # no torchao in the carry
    cmd = [PY, "benchmarks/nf4_matmul.py", "--json", str(out), "--paths", *paths]
    cmd += (
        ["--warmup", "1", "--iters", "2", "--tokens", "64"]
        if args.dry
        else ["--shapes", "gate_up", "--tokens", "16384"]
    )
    code = run_capped(args, part, cmd)
    found = _json(out)
    if code is None or found is None:
        part.status = "cut" if code is None else "fail"
        part.figure = f"no NF4 result ({'cut at the cap' if code is None else f'exit {code}'})"
        return
    rows = [
        f"{shape['shape']} x{row['tokens']}: "
        + ", ".join(
            f"{name} {r['ms']:.2f} ms" if isinstance(r, dict) else f"{name} {r}"
            for name, r in row.items()
            if name != "tokens"
        )
        for shape in found["shapes"]
        for row in shape["rows"]
    ]
    part.figure, part.status = "; ".join(rows)[:600], "pass" if code == 0 else "fail"


def slice_compile(args: argparse.Namespace, part: Part) -> None:
    cmd = [PY, "benchmarks/compile_cache.py", "--dtype", "float32" if args.dry else "bfloat16"]
    code = run_capped(args, part, cmd)
    found = [line for line in part.log.splitlines() if line.startswith("compile seconds:")]
    if code is None or not found:
        part.status = "cut" if code is None else "fail"
        part.figure = f"no compile figures ({'cut at the cap' if code is None else f'exit {code}'})"
        return
    attempts = [
        f"{m.group(1)} {m.group(2)} s"
        for m in re.finditer(r"^\s+(\S.*?)\s+compile\s+([\d.]+) s\s+process", part.log, flags=re.MULTILINE)
    ]
    part.figure = found[-1] + " (compile seconds: " + "; ".join(attempts) + ")"
    part.status = "pass" if code == 0 else "fail"


def slice_tinyllama(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-gpu-1b.json"
    gpu = ["--model", "benchmarks/configs/tinyllama-1.1b.json", "--seq", "2048", "--grad-accum", "8"]
    gpu += ["--steps", "6", "--warmup", "2", "--arms", "spotune,hf_peft,spotune_qlora,hf_peft_qlora"]
    dry = ["--tiny", "--steps", "2", "--warmup", "1", "--seq", "64", "--arms", "spotune"]
    bench_part(args, part, out, _bench_cmd(args, out, gpu, dry))


def slice_liger(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-gpu-liger.json"
    gpu = ["--steps", "4", "--warmup", "1", "--arms", "spotune,spotune_qlora,hf_peft_liger,hf_peft_liger_qlora"]
    dry = ["--tiny", "--steps", "2", "--warmup", "1", "--seq", "64", "--arms", "spotune,hf_peft_liger"]
    bench_part(args, part, out, _bench_cmd(args, out, gpu, dry))


def slice_moe(args: argparse.Namespace, part: Part) -> None:
    out = args.out / "bench-moe.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "benchmarks/moe_lora.py", "--json", str(out)]
    cmd += (
        ["--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "64", "--layers", "1", "--tokens", "512"]
        if args.dry
        else ["--device", "cuda", "--dtype", "bfloat16", "--experts", "128", "--hidden", "2048"]
        + ["--intermediate", "768", "--layers", "1", "--tokens", "4096"]
    )
    code = run_capped(args, part, cmd)
    found = _json(out)
    if code is None or not isinstance(found, list):
        part.status = "cut" if code is None else "fail"
        part.figure = f"no MoE result ({'cut at the cap' if code is None else f'exit {code}'})"
        return
    part.figure = "one Qwen3-30B-A3B layer, expert LoRA r16, against peft's ParamWrapper: " + "; ".join(
        f"{r['path']} {r['tokens_per_s']:.0f} tok/s ({r['speedup']:.2f}x), step peak {r['step_peak_mib']:.0f} MiB "
        f"({r['memory_ratio']:.2f}x)"
        for r in found
    )
    part.status = "pass" if code == 0 else "fail"


PARTS: dict[str, Spec] = {
    "setup": Spec(setup, 25, "the carried wheels install into the image's own Python, offline"),
    "environment": Spec(
        environment, 25, "GPU, driver, CUDA and every library's version; the attention kernel each path picks"
    ),
    "gpu-tests": Spec(
        gpu_tests,
        120,
        "the -m gpu tests: packed varlen attention in bf16 against each document alone (each implementation, GQA), "
        "a QLoRA step, Liger's fused loss against the plain one, NVML, two deterministic runs and a resume "
        "bit-identical, activation offloading bit-identical, QLoRA under FSDP, SIGTERM -> save -> resume",
    ),
    "exit-paths": Spec(
        exit_paths,
        45,
        "a failure in the forward and an out-of-memory end the process with its loader worker: no GPU held",
    ),
    "resume-drill": Spec(
        resume_drill,
        80,
        "spotune train on a ~1B Llama with real data, SIGKILL after a checkpoint, the same command resumes "
        "and finishes: one ledger row per attempt, report.html, the final adapter",
        "drill.json",
    ),
    "speed-8b": Spec(
        speed_8b,
        145,
        "the Llama-3.1-8B shape: spotune, HF Trainer + PEFT and HF + PEFT + Liger, LoRA and QLoRA, tokens/s and "
        "peak memory each (what a cap cuts is named; the `liger` slice measures it)",
        "bench-gpu.json",
    ),
    "memory": Spec(memory_point, 10, "the estimate's LoRA and QLoRA peak against the measured peak (goal 0.90-1.10)"),
}
"""The one command's parts, in order; the caps with the set-up sum to `total_cap_s` (<= 450 s)."""

SLICES: dict[str, Spec] = {
    "longest": Spec(
        slice_longest,
        150,
        "one 131,072-token row of 8B QLoRA r32 (checkpointing, offloading, tiling): fits, its peak, the estimate's",
        "bench-longest.json",
    ),
    "nf4": Spec(
        slice_nf4,
        150,
        "NF4 dequant+matmul on the 8B gate/up shape at 16k tokens: bitsandbytes' paths, "
        "Inductor's prologue fusion of its dequantisation (max-autotune), the bf16 floor",
        "bench-nf4.json",
    ),
    "compile": Spec(
        slice_compile, 150, "model.compile in bf16: a resumed attempt's compile seconds with the checkpoint's artifacts"
    ),
    "tinyllama": Spec(
        slice_tinyllama,
        150,
        "the 1.1B (TinyLlama shape) at seq 2048: spotune and HF + PEFT, LoRA and QLoRA",
        "bench-gpu-1b.json",
    ),
    "liger": Spec(
        slice_liger, 150, "HF + PEFT + Liger on the 8B, LoRA and QLoRA, beside spotune's", "bench-gpu-liger.json"
    ),
    "moe": Spec(
        slice_moe,
        150,
        "mixture of experts: spotune's per-token expert LoRA (grouped_mm and the loop) against peft's ParamWrapper "
        "on one Qwen3-30B-A3B layer (128 experts, top-8) in bf16: tokens/s and step peak memory, the loss checked equal",
        "bench-moe.json",
    ),
}
"""Slices for a second command (`--slice NAME`; each with the set-up under 3 minutes)."""


def plan() -> dict[str, Any]:
    parts = [{"name": n, "cap_s": s.cap_s, "proves": s.proves} for n, s in PARTS.items()]
    return {
        "command": COMMAND,
        "command_limit_s": COMMAND_LIMIT_S,
        "parts": parts,
        "total_cap_s": sum(s.cap_s for s in PARTS.values()),
        "slices": [
            {
                "name": n,
                "cap_s": s.cap_s + PARTS["setup"].cap_s,
                "command": f"{COMMAND} --slice {n}",
                "proves": s.proves,
            }
            for n, s in SLICES.items()
        ],
    }


# ---------------------------------------------------------------------------- report


def summary(parts: list[Part], pending: list[str], args: argparse.Namespace) -> str:
    env = getattr(args, "environment", {})
    versions = env.get("versions", {})
    lines = [
        f"# spotune gpu-check ({'dry run on CPU' if args.dry else 'CUDA'}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Machine: {env.get('gpu', '?')}, driver {env.get('driver', '?')}; torch {versions.get('torch', '?')} "
        f"(CUDA {env.get('cuda', '?')}). Command: `{args.command}`",
        "",
        "| part | result | figure | seconds | cap |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.name} | {p.status} | {p.figure.replace('|', '/')} | {p.seconds:.0f} | {p.cap_s:.0f} |" for p in parts
    ]
    lines += [f"| {name} | not run yet | | | |" for name in pending]
    failed = [p.name for p in parts if p.status != "pass"]
    lines.append("")
    if failed:
        lines.append(f"Not passed: {', '.join(failed)} (logs in {args.stem}.json, {args.stem}.log and logs/).")
    elif pending:
        lines.append(f"Still to run: {', '.join(pending)}.")
    else:
        lines.append("All parts passed.")
    return "\n".join(lines) + "\n"


def write_report(parts: list[Part], pending: list[str], args: argparse.Namespace) -> None:
    """The report as it stands, then (with --copy-to / $OUT) copied there with the logs and artifacts."""
    stem = args.out / args.stem
    atomic.write_text(stem.with_suffix(".md"), summary(parts, pending, args))
    report = {
        "dry": args.dry,
        "command": args.command,
        "environment": getattr(args, "environment", {}),
        "parts": {p.name: p.as_dict() for p in parts},
        "pending": pending,
    }
    atomic.write_text(stem.with_suffix(".json"), json.dumps(report, indent=2))
    combined = []
    for p in parts:
        log = args.out / "logs" / f"{p.name}.log"
        text = log.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace") if log.exists() else ""
        combined.append(f"===== {p.name}: {p.status} ({p.seconds:.0f} s of {p.cap_s:.0f})\n{text}\n")
    atomic.write_text(stem.with_suffix(".log"), "".join(combined))
    if args.copy_to:
        copy_back(args, [stem.with_suffix(s) for s in (".md", ".json", ".log")], parts)


def copy_back(args: argparse.Namespace, report: list[Path], parts: list[Part]) -> None:
    """At most MAX_COPIED_FILES flat files into args.copy_to: the report first, then artifacts."""
    specs = {**PARTS, **SLICES}
    artifacts = [args.out / a for p in parts if (a := specs[p.name].artifact) and (args.out / a).exists()]
    args.copy_to.mkdir(parents=True, exist_ok=True)
    for path in (report + artifacts)[:MAX_COPIED_FILES]:
        shutil.copyfile(path, args.copy_to / path.name)


class Interrupted(Exception):
    """SIGTERM or SIGINT (the command's own limit): the part in flight is cut, the report written."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def run_parts(chosen: dict[str, Spec], args: argparse.Namespace) -> list[Part]:
    parts: list[Part] = []
    pending = list(chosen)
    for name, spec in chosen.items():
        part = Part(name, spec.cap_s * (DRY_CAP_FACTOR if args.dry else 1))
        started = time.monotonic()
        print(f"gpu-check: {name} (cap {part.cap_s:.0f} s) ...", flush=True)
        stopped = False
        try:
            spec.run(args, part)
        except Interrupted as e:
            part.status, part.figure, stopped = "cut", f"the check itself was stopped ({e}) during this part", True
            if args.running is not None:
                kill_tree(args.running)
        except Exception as e:  # a part that breaks is a failed part, not a failed check
            part.status, part.figure = "fail", f"{type(e).__name__}: {e}"
        part.seconds = time.monotonic() - started
        print(f"gpu-check: {name}: {part.status} ({part.seconds:.0f} s): {part.figure}", flush=True)
        parts.append(part)
        pending.remove(name)
        write_report(parts, pending, args)
        if stopped:
            break
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="folder of the report and logs")
    ap.add_argument("--plan", action="store_true", help="print the parts, caps and slices as JSON, run nothing")
    ap.add_argument("--dry", action="store_true", help="every part at CPU size (CI): proves the command still works")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), help="run these parts only")
    ap.add_argument("--slice", nargs="+", choices=list(SLICES), help="the set-up, then these slices (not the parts)")
    ap.add_argument("--carry", type=Path, help="a folder from `make gpu-carry`: its wheels/ and data/")
    ap.add_argument("--install-into", type=Path, help="install the carried wheels with --target here (tests)")
    ap.add_argument("--copy-to", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    ap.add_argument("--data", type=Path, help=f"instruction data for the drill (default: the carry's {DATA_NAME})")
    ap.add_argument("--tokenizer", type=Path, help=f"its tokenizer (default: the carry's {TOKENIZER_NAME})")
    args = ap.parse_args(argv)
    if args.plan:
        print(json.dumps(plan(), indent=2))
        return 0
    for key, name in (("data", DATA_NAME), ("tokenizer", TOKENIZER_NAME)):
        if getattr(args, key) is None:
            found = [d / name for d in ([args.carry / "data"] if args.carry else []) + [SHARED] if (d / name).exists()]
            setattr(args, key, found[0] if found else None)
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    args.carry = args.carry.resolve() if args.carry else None
    args.pythonpath, args.running = [], None
    args.command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    if args.slice:
        chosen = {"setup": PARTS["setup"], **{n: SLICES[n] for n in args.slice}}
        args.stem = "gpu-slice"
    else:
        chosen = {n: s for n, s in PARTS.items() if not args.only or n in args.only}
        args.stem = "gpu-check"
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        parts = run_parts(chosen, args)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print((args.out / f"{args.stem}.md").read_text())
    print(f"gpu-check: wrote {args.out / (args.stem + '.md')} and {args.out / (args.stem + '.json')}")
    return 0 if all(p.status == "pass" for p in parts) and len(parts) == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
