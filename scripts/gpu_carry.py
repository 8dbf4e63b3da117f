"""`make gpu-carry`: the folder that goes with the repository to a GPU box without a network.

    python scripts/gpu_carry.py [--dest .gpu-carry]      # needs the package index once, here
    bash .gpu-carry/run.sh                               # there, from the repository root
    python scripts/gpu_carry.py --wheels DIR --extras test,gpu [--python 3.12]
        # scripts/fetch_wheels.sh's torch-less folder: spotune[EXTRAS]'s dependencies for a machine
        # whose environment has torch already (never torch, triton or an nvidia-* wheel)

It holds (git ignores it):
  wheels/   what the check needs and the GPU image lacks (`CARRY`, then what each requires that
            scripts/gpu_image_packages.txt does not list), for that image's Python and platform
            (`PYTHON`, `PLATFORMS`). Never torch, triton or an nvidia-* wheel: the image's CUDA
            stack is the one under test. Each pinned to the version this checkout's .venv runs
            (what CI tests), else the newest pyproject.toml allows.
  data/     what the restart drill reads: the first `DATA_ROWS` rows of the instruction set and
            the tokenizer's two files, from the data folder beside the repository (absent: the
            drill uses spotune's built-in tiny assets).
  run.sh    scripts/gpu_carry_run.sh: installs the wheels, runs scripts/gpu_check.py.
  carry.json what each file is and why it is there.
Prints the size of the folder and of what travels (it, the tracked files and the untracked ones
git does not ignore) and fails above `LIMIT_MIB`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover (3.10: pip's own copy)
    from pip._vendor import tomli as tomllib

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
IMAGE_PACKAGES = REPO / "scripts" / "gpu_image_packages.txt"
CARRY = ["bitsandbytes", "liger-kernel", "datasets"]
"""What the check needs beyond the image: QLoRA's 4-bit weights, the fused loss (CUDA's default), the
data pipeline of `spotune train`."""
NEVER = re.compile(r"^(torch|triton|nvidia-.*)$")
PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]  # bitsandbytes ships manylinux_2_24 only
DATA_ROWS = 2000
"""The drill's 30 steps of 8 packed 2048-token rows read about 1,750 of the set's documents."""
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
LIMIT_MIB = 60.0
MIB = 2**20


def image_packages() -> set[str]:
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonicalize_name(n) for n in lines if n.strip() and not n.startswith("#")}


def project_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and every extra's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in listed]


def wanted(name: str, specifier: str) -> str:
    """The requirement to download: the version this environment runs where it satisfies
    `specifier` (what CI tests), else `specifier` itself (pip takes the newest)."""
    try:
        here = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return f"{name}{specifier}"
    req = Requirement(f"{name}{specifier}")
    return f"{name}=={here}" if req.specifier.contains(Version(here), prereleases=True) else f"{name}{specifier}"


def download(requirement: str, dest: Path, python: str = PYTHON) -> Path:
    """One wheel for the target's Python and platform, no dependencies (they are walked here)."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    done = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu_carry: pip could not download {requirement} for Python {python}:\n{done.stderr[-2000:]}")
    name = canonicalize_name(Requirement(requirement).name)
    found = [w for w in dest.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name]
    new = [w for w in found if w not in before] or found
    return max(new, key=lambda w: Version(w.name.split("-")[1]))


def requires(wheel: Path, python: str) -> list[Requirement]:
    """The wheel's own requirements that apply on the target (Linux x86-64, `python`, no extra)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = default_environment() | {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def fetch_wheels(
    dest: Path, wanted_reqs: list[tuple[str, str]], provided: Callable[[str], bool], python: str = PYTHON
) -> list[dict[str, str]]:
    """Each (name, specifier) of `wanted_reqs` and what each requires that is not `provided` (the
    target has it), one wheel each, none of torch's CUDA stack; what each is and why it is there."""
    dest.mkdir(parents=True, exist_ok=True)
    queue = [(canonicalize_name(n), spec, "asked for") for n, spec in wanted_reqs]
    carried: dict[str, dict[str, str]] = {}
    while queue:
        name, specifier, why = queue.pop(0)
        if name in carried:
            continue
        if NEVER.match(name):
            raise SystemExit(f"gpu_carry: {why} requires {name}, which is never carried (the target's own)")
        wheel = download(wanted(name, specifier), dest, python)
        carried[name] = {"wheel": wheel.name, "why": why}
        for req in requires(wheel, python):
            dep = canonicalize_name(req.name)
            if not provided(dep) and dep not in carried:
                queue.append((dep, str(req.specifier), f"required by {name} ({req}), not on the target"))
    keep = {c["wheel"] for c in carried.values()}
    for stale in dest.glob("*.whl"):
        if stale.name not in keep:
            stale.unlink()
    return list(carried.values())


def carry_wheels(dest: Path) -> list[dict[str, str]]:
    """CARRY and what it needs that the GPU image lacks."""
    image = image_packages()
    specs = {canonicalize_name(r.name): str(r.specifier) for r in project_requirements()}
    wheels = fetch_wheels(dest, [(n, specs.get(canonicalize_name(n), "")) for n in CARRY], image.__contains__)
    for w in wheels:
        w["why"] = w["why"].replace("asked for", "spotune's GPU check").replace("not on the target", "not in the image")
    return wheels


def project_top(extras: list[str]) -> list[tuple[str, str]]:
    """spotune[extras]'s requirements (and the build's), as (name, specifier), but torch's CUDA stack."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + ["setuptools>=68", "wheel"]
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [(r.name, str(r.specifier)) for r in map(Requirement, reqs) if not NEVER.match(canonicalize_name(r.name))]


def project_wheels(dest: Path, extras: list[str], python: str) -> list[dict[str, str]]:
    """spotune[extras]'s dependencies but torch's CUDA stack, for an environment that has torch."""
    return fetch_wheels(dest, project_top(extras), lambda name: bool(NEVER.match(name)), python)


def copy_data(dest: Path) -> list[str]:
    """The drill's data and tokenizer, or nothing where the data folder is absent."""
    if not (SHARED / "gpteacher-roleplay.json").is_file():
        return []
    dest.mkdir(parents=True, exist_ok=True)
    rows = json.loads((SHARED / "gpteacher-roleplay.json").read_text())[:DATA_ROWS]
    (dest / "gpteacher-roleplay.json").write_text(json.dumps(rows))
    tok = dest / "llama2-tokenizer"
    tok.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(SHARED / "llama2-tokenizer" / name, tok / name)
    return ["gpteacher-roleplay.json", *(f"llama2-tokenizer/{n}" for n in TOKENIZER_FILES)]


def travelling_bytes(carry: Path) -> tuple[int, int]:
    """(the carry folder's bytes, the bytes of what travels with it: tracked and untracked-unignored files)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum((REPO / p.decode()).stat().st_size for p in listed if p and (REPO / p.decode()).is_file())
    own = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    return own, own + tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=REPO / ".gpu-carry")
    ap.add_argument(
        "--wheels", type=Path, help="instead: spotune[--extras]'s dependencies but torch's into this folder"
    )
    ap.add_argument("--extras", default="", help="with --wheels: the extras, comma-separated")
    ap.add_argument("--python", default=PYTHON, help="with --wheels: the target's Python version")
    args = ap.parse_args(argv)
    if args.wheels:
        wheels = project_wheels(args.wheels, [e for e in args.extras.split(",") if e], args.python)
        print(f"gpu_carry: {len(wheels)} wheels in {args.wheels}, no torch, triton or nvidia-* wheel")
        return 0
    dest = args.dest.resolve()
    wheels = carry_wheels(dest / "wheels")
    data = copy_data(dest / "data")
    shutil.copyfile(REPO / "scripts" / "gpu_carry_run.sh", dest / "run.sh")
    (dest / "run.sh").chmod(0o755)
    (dest / "carry.json").write_text(json.dumps({"python": PYTHON, "wheels": wheels, "data": data}, indent=2))
    own, total = travelling_bytes(dest)
    for w in wheels:
        size = (dest / "wheels" / w["wheel"]).stat().st_size / MIB
        print(f"gpu_carry: {w['wheel']} ({size:.1f} MiB): {w['why']}")
    print(f"gpu_carry: data: {', '.join(data) if data else 'none (the drill uses the built-in tiny assets)'}")
    print(f"gpu_carry: {dest} is {own / MIB:.1f} MiB; what travels (it and the repository) {total / MIB:.1f} MiB")
    if total / MIB > LIMIT_MIB:
        print(f"gpu_carry: over the {LIMIT_MIB:.0f} MiB a command may take along", file=sys.stderr)
        return 1
    print(f"gpu_carry: on the GPU machine, from the repository root: bash {dest.name}/run.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
