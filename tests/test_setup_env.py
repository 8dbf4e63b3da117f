"""scripts/setup.sh run by a Python that is itself an environment (a venv, as a GPU image's python3
often is) with torch in it: .venv sees that environment's packages, so set-up reuses its torch and
installs nothing but spotune itself. Offline: no index, an empty find-links folder."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from test_setup_choice import _fake_smi

REPO = Path(__file__).resolve().parents[1]
HERE_SITE = Path(sysconfig.get_paths()["purelib"])  # this test's own environment: torch and the runtime


def _venv_with_torch(root: Path) -> Path:
    """A venv (no pip of its own, made in a second) whose site folder points at this environment's,
    so its python3 imports torch the way an image's venv would."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    py = root / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    (Path(site) / "outer.pth").write_text(f"{HERE_SITE}\n")
    return py


def test_setup_in_a_venv_with_torch_reuses_it_and_installs_nothing_heavy(tmp_path: Path) -> None:
    outer = _venv_with_torch(tmp_path / "image-venv")
    assert subprocess.run([str(outer), "-c", "import torch"], timeout=120).returncode == 0
    # Control: what set-up made before, --system-site-packages from that python, does not see its torch.
    subprocess.run([str(outer), "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "old")])
    hidden = subprocess.run([str(tmp_path / "old" / "bin" / "python"), "-c", "import torch"], capture_output=True)
    assert hidden.returncode != 0 and b"No module named 'torch'" in hidden.stderr

    _fake_smi(tmp_path / "bin", None)  # no GPU, even on a GPU runner
    (tmp_path / "no-wheels").mkdir()
    venv = tmp_path / "venv"
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "PYTHON": str(outer),
        "VENV": str(venv),
        "PIP_NO_INDEX": "1",  # anything pip would download fails the test
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": str(tmp_path / "no-wheels"),
    }
    env.pop("EXTRAS", None)  # the runtime alone: what `make demo` installs
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "setup: torch: system (no GPU answers nvidia-smi; this environment's torch" in done.stdout
    assert "setup: installing spotune and its dependencies" in done.stdout  # no extras
    # Nothing but spotune went into .venv: every package is the environment's.
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    installed = sorted(p.name.split("-")[0].lower() for p in site.glob("*.dist-info"))
    assert installed == ["spotune"], installed
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import torch, trainer; print(torch.__file__); print(trainer.__file__)"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert Path(where[0]).is_relative_to(HERE_SITE) and Path(where[1]).is_relative_to(REPO)
    # A second run on the unchanged .venv ends at once: nothing installed, nothing imported.
    again = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout == f"setup: {venv} unchanged since its last check (rm {venv}/.spotune-checked to check again)\n"
    # The control: a package added to a folder .venv reads is a change; the next run checks the imports again.
    (site / "added_by_hand.py").write_text("")
    changed = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert changed.returncode == 0 and "installing" not in changed.stdout and "torch: " not in changed.stdout
    assert changed.stdout.startswith("setup: torch "), changed.stdout
