"""The launch templates under scripts/launch/ and the docker entrypoint, each checked by its own
tool where one installs here (SkyPilot's task loader, kubernetes-validate, a single-node SLURM
controller) and by running the scripts with stand-ins for `docker` and `spotune` otherwise.
The exit codes they rely on are tied to trainer/exit_codes.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from trainer import exit_codes as E

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch"
SKYPILOT, SLURM, K8S, DOCKER_RUN, SLURM_NODES = (
    LAUNCH / n for n in ("skypilot.yaml", "slurm.sbatch", "k8s-job.yaml", "docker-run.sh", "slurm-multinode.sbatch")
)
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


# ---------------------------------------------------------------------------- exit codes


def _shell_codes(text: str) -> dict[str, int]:
    return {name: int(v) for name, v in re.findall(r"^(EXIT_[A-Z_]+)=(\d+)\b", text, re.MULTILINE)}


def _k8s_rules(doc: dict) -> dict[str, list[int]]:
    rules = doc["spec"]["podFailurePolicy"]["rules"]
    return {r["action"]: r["onExitCodes"]["values"] for r in rules if "onExitCodes" in r}


def template_code_problems(texts: dict[Path, str]) -> list[str]:
    """Every place a template's exit code differs from trainer/exit_codes.py, naming the file."""
    problems: list[str] = []

    def same(where: Path, what: str, got: object, want: object) -> None:
        if got != want:
            problems.append(f"{where.name}: {what} is {got}, trainer/exit_codes.py says {want}")

    want = {
        name: getattr(E, name)
        for name in ("EXIT_FINISHED", "EXIT_BAD_INPUT", "EXIT_OUT_OF_MEMORY", "EXIT_PREEMPTED", "EXIT_BUSY")
    }
    for path in (SLURM, SLURM_NODES, ENTRYPOINT):
        same(path, "EXIT_* assignments", _shell_codes(texts[path]), want)
    recovery = yaml.safe_load(texts[SKYPILOT])["resources"]["job_recovery"]
    same(SKYPILOT, "recover_on_exit_codes", recovery["recover_on_exit_codes"], [E.EXIT_PREEMPTED])
    same(SKYPILOT, "max_restarts_on_errors", recovery["max_restarts_on_errors"], 0)
    rules = _k8s_rules(yaml.safe_load(texts[K8S]))
    same(K8S, "FailJob exit codes", rules.get("FailJob"), [E.EXIT_BAD_INPUT, E.EXIT_OUT_OF_MEMORY, E.EXIT_BUSY])
    same(K8S, "Ignore (restart) exit codes", rules.get("Ignore"), [E.EXIT_PREEMPTED])
    return problems


def _templates() -> dict[Path, str]:
    return {p: p.read_text() for p in (SKYPILOT, SLURM, SLURM_NODES, K8S, ENTRYPOINT)}


def test_template_exit_codes_are_the_trainers() -> None:
    assert template_code_problems(_templates()) == []


@pytest.mark.parametrize("path", [SKYPILOT, SLURM, SLURM_NODES, K8S, ENTRYPOINT], ids=lambda p: p.name)
def test_template_exit_code_drift_is_caught(path: Path) -> None:
    texts = _templates()
    drifted = re.sub(r"\b143\b", "142", texts[path])
    assert drifted != texts[path], f"{path.name} names no 143"
    problems = template_code_problems({**texts, path: drifted})
    assert problems and all(p.startswith(path.name) and "142" in p for p in problems), problems


def test_every_template_treats_busy_as_do_not_restart_now() -> None:
    """EXIT_BUSY (another attempt holds the run): never requeued or restarted at once; the ones that start
    replacement machines wait for a dead holder's lease first (--wait)."""
    for path in (SLURM, SLURM_NODES):
        branch = re.search(r'^  "\$EXIT_BUSY"\)\n(.*?;;)', path.read_text(), re.MULTILINE | re.DOTALL)
        assert branch and "requeue" in branch.group(1) and "scontrol" not in branch.group(1), path.name
    recovery = yaml.safe_load(SKYPILOT.read_text())["resources"]["job_recovery"]
    assert E.EXIT_BUSY not in recovery["recover_on_exit_codes"] and recovery["max_restarts_on_errors"] == 0
    assert "spotune train --wait" in yaml.safe_load(SKYPILOT.read_text())["run"]
    assert E.EXIT_BUSY in _k8s_rules(yaml.safe_load(K8S.read_text()))["FailJob"]
    assert ENTRYPOINT.read_text().count('train --wait "${SPOTUNE_WAIT:-300}"') == 3
    assert 'train --wait "$SPOTUNE_WAIT"' in SLURM_NODES.read_text()
    assert "export SPOTUNE_WAIT=${SPOTUNE_WAIT:-300}" in SLURM_NODES.read_text()


def test_a_requeued_slurm_job_waits_for_a_killed_attempts_lease(tmp_path: Path) -> None:
    """After a SIGKILL the lease stays live until it expires: a requeued job that does not wait meets it and
    exits 75, which is not requeued, so the run stops for good. The script passes --wait (SPOTUNE_WAIT, 300 s
    by default), so the job waits the dead lease out. Run outside SLURM with a stand-in trainer."""
    fake = tmp_path / "spotune"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path / "argv"}\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "RECIPE": "r.yaml", "SPOTUNE": str(fake)}
    env.pop("SPOTUNE_WAIT", None)
    done = subprocess.run(["bash", str(SLURM), "seed=3"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "finished" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == ["train", "--wait", "300", "r.yaml", "seed=3"]
    done = subprocess.run(["bash", str(SLURM)], env={**env, "SPOTUNE_WAIT": "30"}, capture_output=True, text=True)
    assert (tmp_path / "argv").read_text().splitlines()[:3] == ["train", "--wait", "30"]


# ---------------------------------------------------------------------------- SkyPilot


def _sky_python() -> str | None:
    """SkyPilot lives in its own venv (scripts/ci_tools.sh): its pins clash with ours."""
    for candidate in (os.environ.get("SPOTUNE_SKY_PYTHON"), REPO / ".venv-sky/bin/python", "/work/venv-sky/bin/python"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


SKY_LOAD = textwrap.dedent(
    """
    import json, sys
    import sky
    from sky.utils import dag_utils
    dag = dag_utils.load_chain_dag_from_yaml(sys.argv[1])
    task = sky.Task.from_yaml(sys.argv[1])
    (r,) = task.resources
    print(json.dumps({"tasks": len(dag.tasks), "name": task.name, "accelerators": r.accelerators,
                      "use_spot": r.use_spot, "job_recovery": r.job_recovery, "envs": task.envs,
                      "setup": task.setup, "run": task.run}))
    """
)


def _sky_load(sky: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sky, "-c", SKY_LOAD, str(path)], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_skypilot_task_loads_with_skypilot(tmp_path: Path) -> None:
    sky = _sky_python()
    if sky is None:
        pytest.skip("SkyPilot not installed: run scripts/ci_tools.sh, or set SPOTUNE_SKY_PYTHON to its venv's python")
    done = _sky_load(sky, SKYPILOT)
    assert done.returncode == 0, done.stderr[-3000:]
    task = json.loads(done.stdout.strip().splitlines()[-1])
    assert task["tasks"] == 1 and task["name"] == "spotune"
    assert task["accelerators"] == {"H100": 1} and task["use_spot"] is True
    assert task["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
    assert task["envs"]["CHECKPOINT_URL"].startswith("s3://")
    assert "spotune prepare $RECIPE" in task["setup"]
    assert "spotune train --wait 300 $RECIPE" in task["run"] and "checkpoint.remote=$CHECKPOINT_URL" in task["run"]
    # control: SkyPilot's loader rejects what its schema does not know
    bad = tmp_path / "bad.yaml"
    bad.write_text(SKYPILOT.read_text().replace("use_spot:", "use_spott:"))
    done = _sky_load(sky, bad)
    assert done.returncode != 0 and "use_spott" in done.stderr


# ---------------------------------------------------------------------------- Kubernetes


def test_kubernetes_job_validates_and_restarts_on_the_right_failures(tmp_path: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    doc = yaml.safe_load(K8S.read_text())
    version = kv.latest_version()
    kv.validate(doc, version, strict=True)  # raises ValidationError naming the path
    spec = doc["spec"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it; the schema does not check the value
    (container,) = pod["containers"]
    rules = spec["podFailurePolicy"]["rules"]
    assert {r["onExitCodes"]["containerName"] for r in rules if "onExitCodes" in r} == {container["name"]}
    assert [r["action"] for r in rules if r.get("onPodConditions") == [{"type": "DisruptionTarget"}]] == ["Ignore"]
    assert (REPO / container["args"][0]).is_file(), "the Job trains a recipe that does not exist"
    # control: a misspelled field fails strict validation
    bad = yaml.safe_load(K8S.read_text().replace("onPodConditions:", "onPodCondition:"))
    with pytest.raises(kv.ValidationError, match="onPodCondition"):
        kv.validate(bad, version, strict=True)


# ---------------------------------------------------------------------------- docker


def _stub(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def test_docker_run_restarts_on_failure_with_the_image_entrypoint(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "docker", f'printf "%s\\n" "$@" > {tmp_path}/argv\n')  # records what would run
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RUNS": str(tmp_path / "runs"), "IMAGE": "img:1"}
    subprocess.run(["bash", str(DOCKER_RUN), "recipes/tiny-cpu.yaml", "train.max_steps=5"], env=env, check=True)
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0] == "run" and "--restart" in argv and argv[argv.index("--restart") + 1] == "on-failure:5"
    assert argv[argv.index("--stop-timeout") + 1] == "120"
    assert argv[-3:] == ["img:1", "recipes/tiny-cpu.yaml", "train.max_steps=5"]  # image, then its entrypoint's args
    assert f"{tmp_path / 'runs'}:/work/runs" in argv
    done = subprocess.run(["bash", str(DOCKER_RUN)], env=env, capture_output=True, text=True)
    assert done.returncode == E.EXIT_BAD_INPUT and "usage:" in done.stderr
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["/usr/local/bin/spotune-entrypoint"]' in dockerfile
    assert "COPY docker/entrypoint.sh /usr/local/bin/spotune-entrypoint" in dockerfile


@pytest.mark.parametrize("code", [E.EXIT_FINISHED, E.EXIT_BAD_INPUT, E.EXIT_BUDGET, E.EXIT_PREEMPTED, E.EXIT_BUSY])
def test_entrypoint_passes_the_trainers_exit_code_through(tmp_path: Path, code: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "spotune", f'printf "%s\\n" "$@" > {tmp_path}/argv\nexit {code}\n')
    _stub(bin_dir, "python", "echo 1\n")  # one GPU: no torchrun
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(ENTRYPOINT), "recipes/tiny-cpu.yaml", "seed=3"], env=env)
    assert done.returncode == code
    assert (tmp_path / "argv").read_text().splitlines() == ["train", "--wait", "300", "recipes/tiny-cpu.yaml", "seed=3"]


@pytest.mark.parametrize("code", [E.EXIT_BAD_INPUT, E.EXIT_PREEMPTED])
def test_entrypoint_on_several_gpus_exits_with_the_main_ranks_code(tmp_path: Path, code: int) -> None:
    """torchrun turns any rank's non-zero exit into 1; the main rank's SPOTUNE_EXIT_FILE keeps the code."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "python", "echo 2\n")  # two GPUs: torchrun
    # A stand-in torchrun that runs the real CLI's exit-code path (as the main rank) and exits 1 like torchrun.
    real_python = sys.executable
    _stub(
        bin_dir,
        "torchrun",
        f'RANK=0 PYTHONPATH={REPO} {real_python} -c "from trainer.cli import main; main._record_exit_code({code})"\nexit 1\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(ENTRYPOINT), "recipes/tiny-cpu.yaml"], env=env)
    assert done.returncode == code
    # Control: without the main rank's file the entrypoint can only pass torchrun's 1 on.
    _stub(bin_dir, "torchrun", "exit 1\n")
    assert subprocess.run(["bash", str(ENTRYPOINT), "recipes/tiny-cpu.yaml"], env=env).returncode == 1


def test_cli_writes_its_exit_code_for_a_launcher(tmp_path: Path) -> None:
    exit_file = tmp_path / "code"
    env = {**os.environ, E.EXIT_FILE_ENV: str(exit_file), "RANK": "0", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "train.no_such_key=1"], env=env, capture_output=True, text=True
    )
    assert done.returncode == E.EXIT_BAD_INPUT and exit_file.read_text() == f"{E.EXIT_BAD_INPUT}\n"
    assert "trainer.cli.main:run" in (REPO / "pyproject.toml").read_text()  # the console script: run -> main records it


# ---------------------------------------------------------------------------- SLURM


def _sbatch_options(text: str) -> list[str]:
    return re.findall(r"^#SBATCH\s+(\S+)", text, re.MULTILINE)


def test_slurm_script_options_and_signal_forwarding_in_the_text() -> None:
    text = SLURM.read_text()
    options = _sbatch_options(text)
    assert "--requeue" in options and "--signal=B:USR1@120" in options
    # with B: the signal reaches the batch shell only: it must run the trainer in the background and forward
    assert re.search(r"^\$SPOTUNE train .*&$", text, re.MULTILINE)
    assert re.search(r"^trap .*kill -TERM \"\$trainer\".* USR1 TERM$", text, re.MULTILINE)
    assert 'scontrol requeue "${SLURM_JOB_ID' in text
    subprocess.run(["bash", "-n", str(SLURM)], check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    """A single-node SLURM cluster (munged, slurmctld, slurmd) in a temp dir, on free ports.

    Needs the Debian packages slurmctld slurmd slurm-client munge (scripts/ci_tools.sh) and
    root (slurmd runs jobs as their owner). One fake GPU, so `--gres=gpu:1` schedules.
    """
    tools = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
    missing = [t for t in tools if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing): run scripts/ci_tools.sh as root")
    if os.geteuid() != 0:
        pytest.skip("a single-node SLURM cluster needs root (slurmd runs jobs as their owner)")
    d = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: the munge socket path has a length limit
    host = socket.gethostname().split(".")[0]
    (d / "state").mkdir()
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(
        textwrap.dedent(
            f"""\
            ClusterName=spotune-test
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            AuthType=auth/munge
            AuthInfo=socket={d}/munge.sock
            CredType=cred/munge
            SlurmUser=root
            StateSaveLocation={d}/state
            SlurmdSpoolDir={d}/spool
            SlurmctldPidFile={d}/slurmctld.pid
            SlurmdPidFile={d}/slurmd.pid
            SlurmctldLogFile={d}/slurmctld.log
            SlurmdLogFile={d}/slurmd.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SchedulerType=sched/backfill
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            MpiDefault=none
            ReturnToService=2
            GresTypes=gpu
            NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 Gres=gpu:1 State=UNKNOWN
            PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
            """
        )
    )
    (d / "gres.conf").write_text(f"AutoDetect=off\nNodeName={host} Name=gpu File=/dev/null\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    sbin = lambda t: shutil.which(t) or f"/usr/sbin/{t}"  # noqa: E731
    started: list[Path] = []
    try:
        subprocess.run([sbin("mungekey"), "--create", f"--keyfile={d}/munge.key"], check=True, env=env)
        subprocess.run(
            [sbin("munged"), f"--socket={d}/munge.sock", f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid"]
            + [f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed", "--force"],
            check=True,
            env=env,
        )
        started.append(d / "munged.pid")
        subprocess.run([sbin("slurmctld"), "-c", "-i"], check=True, env=env)
        started.append(d / "slurmctld.pid")
        subprocess.run([sbin("slurmd")], check=True, env=env)
        started.append(d / "slurmd.pid")
        deadline = time.monotonic() + 30
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-1500:] for p in (d / "slurmctld.log", d / "slurmd.log") if p.exists())
                pytest.skip(f"the single-node SLURM cluster did not come up within 30 s:\n{logs}")
            time.sleep(0.3)
        yield env
    finally:
        for pid_file in reversed(started):  # only the daemons this fixture started, by pid
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)
        shutil.rmtree(d, ignore_errors=True)


def test_sbatch_accepts_the_script(slurm: dict[str, str], tmp_path: Path) -> None:
    done = subprocess.run(["sbatch", "--test-only", str(SLURM)], env=slurm, capture_output=True, text=True)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr
    # control: the same check refuses a script that asks for what the cluster cannot give
    bad = tmp_path / "bad.sbatch"
    bad.write_text(SLURM.read_text().replace("--gres=gpu:1", "--gres=gpu:9"))
    done = subprocess.run(["sbatch", "--test-only", str(bad)], env=slurm, capture_output=True, text=True)
    assert done.returncode != 0 and "not available" in done.stderr


FAKE_TRAINER = """\
# Stands in for `spotune train`: counts its runs; exits $FAKE_FIRST_EXIT or, when told to wait,
# waits for SIGTERM and exits 143 like spotune after saving; every later run finishes (0).
n=$(( $(cat "$FAKE_DIR/runs" 2>/dev/null || echo 0) + 1 )); echo $n > "$FAKE_DIR/runs"
echo "run $n: $*" >> "$FAKE_DIR/log"
[ "$n" -gt 1 ] && exit 0
[ "$FAKE_FIRST_EXIT" != wait ] && exit "$FAKE_FIRST_EXIT"
trap 'echo "run $n: SIGTERM" >> "$FAKE_DIR/log"; exit 143' TERM
touch "$FAKE_DIR/running"
while :; do sleep 0.1; done
"""


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _rerun_requeued(env: dict[str, str], job: str, timeout: float = 240.0) -> None:
    """Wait for a requeued job to run again and complete. SLURM holds a requeued batch job for
    about two minutes (Reason=BeginTime); skip that hold each time the job shows it: an update
    sent while the requeue is still completing is overwritten by the hold."""

    def done() -> bool:
        info = _job(env, job)
        if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
        return info.get("JobState") == "COMPLETED"

    _wait_for(done, timeout, f"job {job} to run again and finish")


def _submit(slurm: dict[str, str], tmp_path: Path, first_exit: str) -> tuple[str, dict[str, str]]:
    _stub(tmp_path, "fake-spotune", FAKE_TRAINER)
    env = {**slurm, "FAKE_DIR": str(tmp_path), "FAKE_FIRST_EXIT": first_exit, "RECIPE": "r.yaml"}
    env["SPOTUNE"] = str(tmp_path / "fake-spotune")
    cmd = ["sbatch", "--parsable", f"--output={tmp_path}/job.out", str(SLURM), "seed=1"]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    return job, env


def test_slurm_forwards_the_signal_requeues_on_143_and_resumes(slurm: dict[str, str], tmp_path: Path) -> None:
    job, env = _submit(slurm, tmp_path, "wait")
    _wait_for(lambda: (tmp_path / "running").exists(), 60, "the trainer to start")
    # what SLURM does 120 s before the time limit with --signal=B:USR1@120: USR1 to the batch shell only
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    _wait_for(lambda: _job(env, job).get("Restarts") == "1", 60, f"job {job} to be requeued")
    _rerun_requeued(env, job)
    log = (tmp_path / "log").read_text().splitlines()
    run = "train --wait 300 r.yaml seed=1"  # the script waits a killed attempt's lease out
    assert log == [f"run 1: {run}", "run 1: SIGTERM", f"run 2: {run}"]
    assert _job(env, job)["Restarts"] == "1"
    out = (tmp_path / "job.out").read_text()
    assert "requeueing job" in out and "finished" in out


def test_slurm_does_not_requeue_a_configuration_error(slurm: dict[str, str], tmp_path: Path) -> None:
    job, env = _submit(slurm, tmp_path, str(E.EXIT_BAD_INPUT))
    _wait_for(lambda: _job(env, job).get("JobState") in ("FAILED", "COMPLETED"), 60, f"job {job} to end")
    info = _job(env, job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == f"{E.EXIT_BAD_INPUT}:0" and info["Restarts"] == "0"
    assert "not requeueing" in (tmp_path / "job.out").read_text()
    assert (tmp_path / "runs").read_text().strip() == "1"


def test_shell_scripts_pass_shellcheck(tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed: apt-get install shellcheck (scripts/ci_tools.sh does, as root)")
    scripts = [
        SLURM,
        DOCKER_RUN,
        ENTRYPOINT,
        *(REPO / "scripts" / n for n in ("ci_tools.sh", "setup.sh", "fetch_wheels.sh", "gpu_carry_run.sh")),
    ]
    done = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    # control: the trainer's arguments unquoted (split and globbed) are flagged
    bad = tmp_path / "bad.sh"
    bad.write_text(DOCKER_RUN.read_text().replace('"$IMAGE" "$@"', '"$IMAGE" $@'))
    done = subprocess.run(["shellcheck", str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "SC2068" in done.stdout


# ---------------------------------------------------------------------------- SLURM, several nodes


def test_slurm_multinode_script_launches_one_torchrun_per_node_in_the_text() -> None:
    text = SLURM_NODES.read_text()
    options = _sbatch_options(text)
    assert "--requeue" in options and "--signal=B:USR1@120" in options and "--ntasks-per-node=1" in options
    launch = re.search(r"^srun .*?&$", text, re.MULTILINE | re.DOTALL)
    assert launch, "srun runs in the background, so the trap can forward the signal"
    for part in (
        '--node_rank "$SLURM_NODEID"',
        '--master_addr "$MASTER_ADDR"',
        "-m trainer train",
        "--kill-on-bad-exit=0",
    ):
        assert part in launch.group(0), part
    assert "checkpoint.remote=$CHECKPOINT_URL" in launch.group(0)
    # SIGTERM to srun would make it SIGKILL the tasks: the steps get it from SLURM instead
    assert re.search(r"^trap .*scancel --signal=TERM \"\$SLURM_JOB_ID\"' USR1 TERM$", text, re.MULTILINE)
    subprocess.run(["bash", "-n", str(SLURM_NODES)], check=True)


def _most_specific(files: list[Path]) -> str:
    """The multi-node script's own merge of the nodes' exit files (its `most_specific` function)."""
    text = SLURM_NODES.read_text()
    priority = re.search(r'^PRIORITY="([\d ]+)"$', text, re.MULTILINE)
    function = re.search(r"^most_specific\(\) \{.*?^\}$", text, re.MULTILINE | re.DOTALL)
    assert priority and function
    script = f'PRIORITY="{priority.group(1)}"\n{function.group(0)}\nmost_specific "$@"'
    return subprocess.run(
        ["bash", "-c", script, "merge", *map(str, files)], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_multinode_script_reports_the_most_specific_code_of_every_node(tmp_path: Path) -> None:
    """Each node's ranks write their own node's file (a rank on node 1 out of memory never reaches
    node 0's disk); the script merges the files in trainer/exit_codes.py's order."""
    text = SLURM_NODES.read_text()
    assert f'PRIORITY="{" ".join(map(str, E.PRIORITY))}"' in text  # the order, in step with the code
    assert 'export SPOTUNE_EXIT_FILE="$EXIT_DIR/node-$SLURM_NODEID"' in text

    def files(*codes: str) -> list[Path]:
        out = []
        for i, code in enumerate(codes):
            f = tmp_path / f"{'-'.join(codes)}-node-{i}"
            f.write_text(code + "\n")
            out.append(f)
        return out

    assert _most_specific(files("143", "5")) == "5"  # node 0 saved and stopped, node 1 ran out of memory
    assert _most_specific(files("143", "143", "1")) == "143"  # a rank whose collective broke: 1 loses
    assert _most_specific(files("0", "0")) == "0"
    assert _most_specific(files("134", "0")) == "1"  # a signal's code counts as an error
    assert _most_specific([tmp_path / "none-1", tmp_path / "none-2"]) == ""  # no file: torchrun's code stands
    for codes in (["143", "5"], ["0", "75"], ["3", "2", "143"]):  # the control: the Python rule agrees
        assert _most_specific(files(*codes)) == str(E.most_specific([int(c) for c in codes]))


def test_sbatch_accepts_the_multinode_script_on_as_many_nodes_as_there_are(slurm: dict[str, str]) -> None:
    one = ["sbatch", "--test-only", "--nodes=1", "--gres=gpu:1", str(SLURM_NODES)]
    done = subprocess.run(one, env=slurm, capture_output=True, text=True)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr
    # control: as written it asks for two nodes, which the single-node cluster does not have
    done = subprocess.run(["sbatch", "--test-only", str(SLURM_NODES)], env=slurm, capture_output=True, text=True)
    assert done.returncode != 0


FAKE_TORCHRUN = """\
# Stands in for one node's torchrun: records its arguments; the first run waits for SIGTERM and,
# as the main rank does, writes 143 to $SPOTUNE_EXIT_FILE, then exits 1 like torchrun; later runs finish.
n=$(( $(cat "$FAKE_DIR/runs" 2>/dev/null || echo 0) + 1 )); echo $n > "$FAKE_DIR/runs"
echo "run $n: $*" >> "$FAKE_DIR/log"
if [ "$n" -gt 1 ]; then echo 0 > "$SPOTUNE_EXIT_FILE"; exit 0; fi
trap 'echo "run $n: SIGTERM" >> "$FAKE_DIR/log"; echo 143 > "$SPOTUNE_EXIT_FILE"; exit 1' TERM
touch "$FAKE_DIR/running"
while :; do sleep 0.1; done
"""


def test_slurm_multinode_forwards_the_signal_through_srun_and_requeues_on_rank0s_143(
    slurm: dict[str, str], tmp_path: Path
) -> None:
    _stub(tmp_path, "fake-torchrun", FAKE_TORCHRUN)
    env = {**slurm, "FAKE_DIR": str(tmp_path), "RECIPE": "r.yaml", "CHECKPOINT_URL": "s3://b/run"}
    env["TORCHRUN"] = str(tmp_path / "fake-torchrun")
    cmd = ["sbatch", "--parsable", "--nodes=1", "--gres=gpu:1", f"--output={tmp_path}/job.out", str(SLURM_NODES)]
    job = subprocess.run([*cmd, "seed=1"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    job = job.split(";")[0]
    _wait_for(lambda: (tmp_path / "running").exists(), 60, "the first node's torchrun to start")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    _wait_for(lambda: _job(env, job).get("Restarts") == "1", 60, f"job {job} to be requeued")
    _rerun_requeued(env, job)
    host = socket.gethostname().split(".")[0]
    argv = (
        f"--nnodes 1 --node_rank 0 --nproc_per_node 1 --master_addr {host} --master_port 29500 "
        "-m trainer train --wait 300 r.yaml checkpoint.remote=s3://b/run seed=1"
    )
    assert (tmp_path / "log").read_text().splitlines() == [f"run 1: {argv}", "run 1: SIGTERM", f"run 2: {argv}"]
    out = (tmp_path / "job.out").read_text()
    assert "requeueing job" in out and "finished" in out  # 143 from the exit file, though torchrun exited 1
