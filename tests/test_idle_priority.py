"""scripts/idle_priority.sh, what make test runs mypy with beside the tests: nice 19 is not enough
where the kernel shares CPU between sessions first (autogroups), since every drill's attempt is a
session of its own; the command runs in a session of its own whose autogroup is niced to 19 too."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "idle_priority.sh"
PROBE = 'echo "$$ $(ps -o sid= -p $$) $(nice)"; cat /proc/self/autogroup'


def _probe(cmd: list[str]) -> tuple[int, int, int, str]:
    done = subprocess.run([*cmd, "sh", "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    head, *group = done.stdout.splitlines()
    pid, sid, nice = (int(x) for x in head.split())
    # A process in the kernel's default autogroup (init's, which a CI job can inherit when nothing
    # above it started a session) reads /proc/self/autogroup as empty: that group is the root one,
    # which has no nice of its own.
    return pid, sid, nice, group[0] if group else ""


@pytest.mark.skipif(
    not Path("/proc/self/autogroup").exists(),
    reason="no /proc/self/autogroup: this kernel does not group CPU time by session, so the script is plain nice",
)
def test_the_command_runs_niced_in_a_session_whose_autogroup_is_niced() -> None:
    pid, sid, nice, group = _probe(["bash", str(SCRIPT)])
    assert pid == sid and nice == 19 and group.endswith(" nice 19"), (pid, sid, nice, group)
    # The control: nice alone stays in the caller's session and autogroup, whose nice is not 19.
    pid, sid, nice, group = _probe(["nice", "-n", "19"])
    assert pid != sid and nice == 19 and not group.endswith(" nice 19"), (pid, sid, nice, group)


def test_its_exit_status_is_the_commands() -> None:
    assert subprocess.run(["bash", str(SCRIPT), "sh", "-c", "exit 3"], timeout=60).returncode == 3
