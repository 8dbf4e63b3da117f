"""Which torch `scripts/setup.sh` installs on this machine, and why (stdlib only: it runs before torch).

Prints shell assignments that setup.sh evaluates:
  CHOICE   system  the Python that runs set-up (a venv, a conda env or the system's) has a torch that
                   satisfies pyproject.toml and, on a GPU machine, sees the GPU: .venv sees that
                   environment's packages instead of downloading another torch
           cpu     the CPU build (no GPU here): never the multi-GB CUDA wheels
           cuda    the CUDA build whose CUDA version the driver supports, from that build's index
  INDEX    the package index of the chosen build (cpu and cuda)
  BUILD    the local version label of the CUDA build (cu128): setup.sh installs torch from INDEX
           alone and checks the label, so a newer release on PyPI built for another CUDA never wins
  SPEC     the requirement to install
  WHY      one line for the user

A GPU image usually ships a working torch; the package index's default build may need a newer
driver than the machine has (torch 2.15's default is built for CUDA 13.2, which needs R580+),
so a plain `pip install torch` on a rented box can download gigabytes and still not see the GPU.
Exit 3 with the reason when the driver is too old for every build we know.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

CUDA_BUILDS = [((13, 0), "cu130"), ((12, 0), "cu128")]
"""torch's CUDA builds for the releases pyproject allows (newest first), with the CUDA version the driver
must support: CUDA's minor-version compatibility runs the 12.8 build on any 12.x driver (R525+), and the
13.0 build needs a 13.x driver (R580+). There is no CUDA 11 build of those releases."""
INDEX = "https://download.pytorch.org/whl/"
PROBE = (
    "import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.cuda.is_available(), "
    "'built': torch.version.cuda}))"
)


def torch_floor(pyproject: Path) -> tuple[int, ...]:
    """The lower bound pyproject.toml gives torch (`torch>=X.Y`), defined there once."""
    m = re.search(r'"torch>=([0-9.]+)', pyproject.read_text())
    if not m:
        raise SystemExit(f"{pyproject}: no 'torch>=X' lower bound")
    return _version(m.group(1))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def gpu_driver(nvidia_smi: str = "nvidia-smi") -> tuple[str, tuple[int, int] | None] | None:
    """(GPU name, the CUDA version the driver supports) or None where no GPU answers."""
    try:
        listed = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30)
        header = subprocess.run([nvidia_smi], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = [line for line in listed.stdout.splitlines() if line.startswith("GPU ")]
    if listed.returncode != 0 or not gpus:
        return None
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header.stdout)
    name = gpus[0].split(":", 1)[1].split("(UUID")[0].strip()
    return name, (int(m.group(1)), int(m.group(2))) if m else None


def system_torch(python: str) -> dict | None:
    """What `python` has: {'version', 'cuda' (sees a GPU), 'built'} or None without torch."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return None
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return None


def choose(
    gpu: tuple[str, tuple[int, int] | None] | None, system: dict | None, floor: tuple[int, ...], cpu_spec: str
) -> dict[str, str]:
    floor_text = ".".join(map(str, floor))
    if gpu is None:
        if system is not None and _version(system["version"]) >= floor:
            return {
                "CHOICE": "system",
                "INDEX": "",
                "SPEC": "",
                "WHY": f"no GPU answers nvidia-smi; this environment's torch {system['version']} satisfies "
                f"torch>={floor_text}: reused, nothing downloaded",
            }
        why = f"; the environment's torch {system['version']} is older than torch>={floor_text}" if system else ""
        return {"CHOICE": "cpu", "INDEX": INDEX + "cpu", "SPEC": cpu_spec, "WHY": "no GPU answers nvidia-smi" + why}
    name, driver_cuda = gpu
    if system is not None and system.get("cuda") and _version(system["version"]) >= floor:
        return {
            "CHOICE": "system",
            "INDEX": "",
            "SPEC": "",
            "WHY": f"this machine's torch {system['version']} (CUDA {system.get('built')}) already sees the "
            f"{name} and satisfies torch>={floor_text}: reused, nothing downloaded",
        }
    if driver_cuda is None:
        raise SystemExit(f"setup: nvidia-smi lists the {name} but prints no 'CUDA Version'; is the driver loaded?")
    for needs, build in CUDA_BUILDS:
        if driver_cuda >= needs:
            had = (
                f"the system torch {system['version']} does not see the GPU"
                if system is not None and not system.get("cuda")
                else f"the system torch {system['version']} is older than torch>={floor_text}"
                if system is not None
                else "no system torch"
            )
            return {
                "CHOICE": "cuda",
                "INDEX": INDEX + build,
                "BUILD": build,
                "SPEC": f"torch>={floor_text}",
                "WHY": f"{name}, driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}; {had}: the newest {build} "
                "build of torch",
            }
    oldest = CUDA_BUILDS[-1][0]
    print(
        f"setup: the {name}'s driver supports CUDA {driver_cuda[0]}.{driver_cuda[1]}, older than every torch build "
        f"spotune can use (CUDA {oldest[0]}.{oldest[1]}+). Update the NVIDIA driver (R525 or newer), or use a GPU "
        "image with a working torch.",
        file=sys.stderr,
    )
    raise SystemExit(3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--system-python", default="python3", help="the interpreter whose torch (and packages) may be reused"
    )
    ap.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml")
    ap.add_argument("--cpu-spec", default="torch==2.13.0")
    args = ap.parse_args(argv)
    gpu = gpu_driver()
    system = system_torch(args.system_python)
    for key, value in choose(gpu, system, torch_floor(args.pyproject), args.cpu_spec).items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
