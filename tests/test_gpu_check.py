"""The GPU check keeps working and fits its window: the CPU dry path runs every part and writes the
report; each part is cut at its cap with its whole process tree; the report is rewritten (and copied
to $OUT) after every part; the carried wheels install with --target and the later parts import them."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@pytest.fixture
def parts(monkeypatch: pytest.MonkeyPatch) -> Any:
    """gpu_check with its PARTS replaced for one test (the callers set them)."""
    gpu_check = _gpu_check()
    monkeypatch.setattr(gpu_check, "PARTS", {})
    monkeypatch.delenv("OUT", raising=False)
    return gpu_check


@pytest.mark.slow
def test_the_dry_run_passes_every_part_and_writes_the_report(tmp_path: Path) -> None:
    out, back = tmp_path / "check", tmp_path / "OUT"
    cmd = [sys.executable, "scripts/gpu_check.py", "--dry", "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(back)}  # the CPU path even on a GPU runner
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"gpu-check: wrote {out / 'gpu-check.md'}" in done.stdout
    result = json.loads((out / "gpu-check.json").read_text())
    plan = json.loads(subprocess.run([*cmd[:2], "--plan"], cwd=REPO, capture_output=True, text=True).stdout)
    assert result["dry"] is True and result["pending"] == []
    assert {k: v["status"] for k, v in result["parts"].items()} == {p["name"]: "pass" for p in plan["parts"]}
    assert list(result["parts"]) == [p["name"] for p in plan["parts"]]  # in the plan's order
    drill = result["parts"]["resume-drill"]["figure"]
    assert "SIGKILL after the step-4 checkpoint, resumed there" in drill and "['killed', 'finished']" in drill
    assert "tests collected" in result["parts"]["gpu-tests"]["figure"]
    assert "spotune " in result["parts"]["speed-8b"]["figure"] and "tok/s" in result["parts"]["speed-8b"]["figure"]
    assert "lora estimate" in result["parts"]["memory"]["figure"]
    md = (out / "gpu-check.md").read_text()
    assert "| resume-drill | pass |" in md and "All parts passed." in md
    # $OUT: the report, its logs and the artifacts, flat, at most 8 files.
    copied = sorted(p.name for p in back.iterdir())
    assert copied == ["bench-gpu.json", "drill.json", "gpu-check.json", "gpu-check.log", "gpu-check.md"]
    assert "===== resume-drill: pass" in (back / "gpu-check.log").read_text()


def test_the_plan_fits_the_window_and_names_each_slice() -> None:
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--plan"], cwd=REPO, capture_output=True, text=True)
    plan = json.loads(done.stdout)
    names = [p["name"] for p in plan["parts"]]
    assert names == ["setup", "environment", "gpu-tests", "exit-paths", "resume-drill", "speed-8b", "memory"]
    assert plan["total_cap_s"] == sum(p["cap_s"] for p in plan["parts"]) <= 450
    assert plan["total_cap_s"] + 30 <= plan["command_limit_s"] == 480 and plan["command"] == "bash .gpu-carry/run.sh"
    assert {s["name"] for s in plan["slices"]} >= {"longest", "nf4", "compile", "tinyllama"}
    for s in plan["slices"]:  # each with the set-up under 3 minutes
        assert s["cap_s"] < 180 and s["command"] == f"bash .gpu-carry/run.sh --slice {s['name']}"
    assert all(p["proves"] for p in plan["parts"] + plan["slices"])


# A part's process that starts a grandchild in a session of its own (as the drill's trainer does),
# then both outlive any cap.
SPAWNS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(120)
"""


def test_a_part_over_its_cap_is_cut_with_its_whole_tree_and_the_report_follows_every_part(
    tmp_path: Path, parts: Any
) -> None:
    gpu_check = parts
    pid_file, seen = tmp_path / "grandchild", {}

    def slow(args: argparse.Namespace, part: Any) -> None:
        code = gpu_check.run_capped(args, part, [sys.executable, "-c", SPAWNS, str(pid_file)])
        part.status, part.figure = ("cut", "cut") if code is None else ("pass", "ended")

    def after(args: argparse.Namespace, part: Any) -> None:
        # What a command cut short now would return: the report and its copy, with the cut part.
        seen["report"] = json.loads((args.out / "gpu-check.json").read_text())
        seen["copied"] = sorted(p.name for p in args.copy_to.iterdir())
        part.status, part.figure = "pass", "ran after the cut part"

    gpu_check.PARTS.update({"slow": gpu_check.Spec(slow, 2, "sleeps"), "after": gpu_check.Spec(after, 5, "checks")})
    started = time.monotonic()
    code = gpu_check.main(["--out", str(tmp_path / "check"), "--copy-to", str(tmp_path / "OUT")])
    assert time.monotonic() - started < 30 and code == 1
    grandchild = int(pid_file.read_text())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert seen["report"]["parts"]["slow"]["status"] == "cut" and seen["report"]["pending"] == ["after"]
    assert "(cut at the 2 s cap)" in seen["report"]["parts"]["slow"]["log"]
    assert seen["copied"] == ["gpu-check.json", "gpu-check.log", "gpu-check.md"]
    final = json.loads((tmp_path / "check" / "gpu-check.json").read_text())
    assert {k: v["status"] for k, v in final["parts"].items()} == {"slow": "cut", "after": "pass"}
    assert "Not passed: slow" in (tmp_path / "OUT" / "gpu-check.md").read_text()


def test_a_check_stopped_by_sigterm_reports_the_part_in_flight_and_ends_its_tree(tmp_path: Path, parts: Any) -> None:
    gpu_check = parts
    started: dict[str, int] = {}

    def sleeping(args: argparse.Namespace, part: Any) -> None:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the command's own limit
        proc_seen = threading.Timer(0.5, lambda: started.update(pid=args.running.pid))
        proc_seen.start()
        gpu_check.run_capped(args, part, [sys.executable, "-c", "import time; time.sleep(60)"])

    def never(args: argparse.Namespace, part: Any) -> None:
        raise AssertionError("a stopped check runs no further part")

    gpu_check.PARTS.update({"first": gpu_check.Spec(sleeping, 30, "-"), "next": gpu_check.Spec(never, 5, "-")})
    previous = signal.getsignal(signal.SIGTERM)
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    assert signal.getsignal(signal.SIGTERM) is previous  # the check's handler is gone with it
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["parts"]["first"]["status"] == "cut" and result["pending"] == ["next"]
    assert result["parts"]["first"]["figure"] == "the check itself was stopped (SIGTERM) during this part"
    assert not psutil.pid_exists(started["pid"]) or psutil.Process(started["pid"]).status() == psutil.STATUS_ZOMBIE


def test_a_failing_part_is_reported_and_the_others_still_run(tmp_path: Path, parts: Any) -> None:
    gpu_check = parts

    def broken(args: argparse.Namespace, part: Any) -> None:
        raise RuntimeError("boom")

    def fine(args: argparse.Namespace, part: Any) -> None:
        part.status = "pass"

    gpu_check.PARTS.update({"broken": gpu_check.Spec(broken, 5, "-"), "fine": gpu_check.Spec(fine, 5, "-")})
    code = gpu_check.main(["--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert code == 1
    assert result["parts"]["broken"] | {"seconds": 0} == {
        "status": "fail",
        "figure": "RuntimeError: boom",
        "seconds": 0,
        "cap_s": 5,
        "log": "",
    }
    assert result["parts"]["fine"]["status"] == "pass"


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of one module `name` holding VERSION (RECORD hashes included)."""
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{name}-{version}.dist-info/METADATA": metadata,
        f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},{len(text.encode())}"
        for path, text in files.items()
    ]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record + [f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_the_carried_wheels_install_with_target_and_every_later_part_imports_them(tmp_path: Path, parts: Any) -> None:
    """--target (a Python whose site-packages cannot be written): the later parts' PYTHONPATH has the
    folder. Control: the same part without the set-up before it cannot import the package."""
    gpu_check = parts
    # It requires what the "image" lacks: installed anyway, and the set-up names the shortfall.
    _wheel(tmp_path / "carry" / "wheels", "spotune_carry_probe", "1.2", ("spotune-absent-dep>=1",))

    def probe(args: argparse.Namespace, part: Any) -> None:
        cmd = [sys.executable, "-c", "import spotune_carry_probe as p, trainer; print('found', p.VERSION)"]
        code = gpu_check.run_capped(args, part, cmd)
        part.status, part.figure = ("pass" if code == 0 else "fail"), part.log.strip().splitlines()[-1]

    gpu_check.PARTS.update({"setup": gpu_check.Spec(gpu_check.setup, 60, "-"), "probe": gpu_check.Spec(probe, 60, "-")})
    site = tmp_path / "site"
    args = ["--out", str(tmp_path / "check"), "--carry", str(tmp_path / "carry"), "--install-into", str(site)]
    assert gpu_check.main(args) == 0
    result = json.loads((tmp_path / "check" / "gpu-check.json").read_text())["parts"]
    assert result["setup"]["figure"] == (
        f"1 wheels into --target {site} (on PYTHONPATH): spotune_carry_probe 1.2; "
        "unmet: spotune-carry-probe 1.2 requires spotune-absent-dep, which is not installed."
    )
    assert result["probe"]["figure"] == "found 1.2"
    assert (site / "spotune_carry_probe" / "__init__.py").is_file()
    # control: the probe alone, without the set-up's folder on its path
    assert gpu_check.main(["--out", str(tmp_path / "alone"), "--only", "probe"]) == 1


@pytest.mark.parametrize(
    "summary, status",
    [
        ("===== 14 skipped, 880 deselected in 3.10s =====", "fail"),  # no GPU seen: every test skipped
        ("===== 12 passed, 2 skipped, 880 deselected in 93.10s =====", "pass"),
        ("===== 1 failed, 11 passed in 93.10s =====", "fail"),
    ],
)
def test_a_gpu_run_where_every_test_skipped_is_not_a_pass(
    monkeypatch: pytest.MonkeyPatch, summary: str, status: str
) -> None:
    gpu_check = _gpu_check()
    code = 1 if "failed" in summary else 0  # pytest's own exit code: 0 when everything skipped

    def ran(args: argparse.Namespace, part: Any, cmd: list[str]) -> int:
        part.log = f"...\n{summary}\n"
        return code

    monkeypatch.setattr(gpu_check, "run_capped", ran)
    part = gpu_check.Part("gpu-tests", 120)
    gpu_check.gpu_tests(argparse.Namespace(dry=False), part)
    assert part.status == status, part.figure
    if "14 skipped" in summary:
        assert "no GPU test ran (14 skipped, 880 deselected)" in part.figure


def test_a_pytest_part_cut_at_its_cap_counts_what_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_check = _gpu_check()

    def cut(args: argparse.Namespace, part: Any, cmd: list[str]) -> None:
        part.log = (
            "tests/test_gpu.py::test_a PASSED\ntests/test_gpu.py::test_b FAILED\ntests/test_gpu.py::test_c PASSED\n"
        )

    monkeypatch.setattr(gpu_check, "run_capped", cut)
    part = gpu_check.Part("gpu-tests", 120)
    gpu_check.gpu_tests(argparse.Namespace(dry=False), part)
    assert (part.status, part.figure) == ("cut", "cut at the 120 s cap after 2 passed, 1 failed")


def _arm(tokens_per_s: float, peak: float | None) -> dict[str, Any]:
    figures = {"attn_implementation": "spotune_varlen", "tokens_per_s": tokens_per_s, "step_seconds": 1.5}
    return figures | {"mfu": 0.3, "mfu_lora": 0.3, "mfu_6n": 0.5, "peak_memory_gib": peak, "first_step_seconds": 9.0}


# What each GPU-only part's program leaves behind on a GPU (its JSON, or its printed lines), as the
# reader of that part's figure meets it: these readers run nowhere else before a GPU session.
GPU_OUTPUTS: dict[str, tuple[str, Any, str]] = {
    "speed-8b": (
        "bench-gpu.json",
        {
            "arms": {"spotune": _arm(10970, 38.6), "hf_peft": _arm(7590, 50.6), "spotune_qlora": _arm(5100, 7.96)},
            "pending": ["hf_peft_qlora", "hf_peft_liger", "hf_peft_liger_qlora"],
            "ratios": ["LoRA spotune / HF+PEFT: tokens/s 1.45, peak memory 0.76"],
            "memory_estimate_gib": {"lora": {"estimate": 39.6, "measured": 38.6}},
        },
        "cut at the 145 s cap: spotune 10970 tok/s, 38.6 GiB; hf_peft 7590 tok/s, 50.6 GiB; spotune_qlora 5100 tok/s, "
        "8.0 GiB; LoRA spotune / HF+PEFT: tokens/s 1.45, peak memory 0.76; not measured: hf_peft_qlora, "
        "hf_peft_liger, hf_peft_liger_qlora",
    ),
    "longest": (
        "bench-longest.json",
        {"probe": {"seq": 131072, "estimate": {"allocated": 41.2}, "allocated_gib": 39.0, "seconds": 48.2}},
        "8B QLoRA r32, one 131072-token row: fits, 39.0 GiB allocated, 48 s; estimate 41.2 GiB allocated",
    ),
    "nf4": (
        "bench-nf4.json",
        {
            "shapes": [
                {
                    "shape": "gate_up 14336x4096",
                    "rows": [{"tokens": 16384, "bf16_dense": {"ms": 1.1}, "bnb_invoke_quant": "out of memory"}],
                }
            ]
        },
        "gate_up 14336x4096 x16384: bf16_dense 1.10 ms, bnb_invoke_quant out of memory",
    ),
    "compile": (
        "",
        "device: cuda; model builtin:tiny-llama (bfloat16), seq_len 128\n"
        "  first attempt (from scratch)         compile    42.1 s   process   60.2 s   {'hit': False}\n"
        "  resumed, with the artifacts          compile     3.2 s   process   20.1 s   {'hit': True}\n"
        "compile seconds: resumed / first 0.08\n",
        "compile seconds: resumed / first 0.08 (compile seconds: first attempt (from scratch) 42.1 s; "
        "resumed, with the artifacts 3.2 s)",
    ),
    "moe": (
        "bench-moe.json",
        [
            {"path": "spotune", "tokens_per_s": 41000.0, "step_peak_mib": 900.0, "speedup": 2.4, "memory_ratio": 0.3},
            {"path": "peft", "tokens_per_s": 17083.3, "step_peak_mib": 3000.0, "speedup": 1.0, "memory_ratio": 1.0},
        ],
        "one Qwen3-30B-A3B layer, expert LoRA r16, against peft's ParamWrapper: spotune 41000 tok/s (2.40x), step "
        "peak 900 MiB (0.30x); peft 17083 tok/s (1.00x), step peak 3000 MiB (1.00x)",
    ),
}


@pytest.mark.parametrize("name", list(GPU_OUTPUTS))
def test_each_gpu_part_reads_its_figure_from_what_its_program_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    gpu_check = _gpu_check()
    artifact, output, figure = GPU_OUTPUTS[name]

    def program(args: argparse.Namespace, part: Any, cmd: list[str]) -> int | None:
        if artifact:
            (args.out / artifact).write_text(json.dumps(output))
        part.log = "" if artifact else output
        return None if name == "speed-8b" else 0  # the speed part cut at its cap, the others ended

    monkeypatch.setattr(gpu_check, "run_capped", program)
    spec = {**gpu_check.PARTS, **gpu_check.SLICES}[name]
    part = gpu_check.Part(name, spec.cap_s)
    spec.run(argparse.Namespace(dry=False, out=tmp_path), part)
    assert part.figure == figure
    assert part.status == ("cut" if name == "speed-8b" else "pass")
    if name == "speed-8b":  # the memory point reads the same JSON
        memory = gpu_check.Part("memory", 10)
        gpu_check.memory_point(argparse.Namespace(dry=False, out=tmp_path), memory)
        assert (memory.status, memory.figure) == (
            "pass",
            "lora estimate 39.60 GiB / measured 38.60 GiB = 1.03 (goal 0.90-1.10)",
        )
