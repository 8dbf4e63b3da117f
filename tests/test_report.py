"""`spotune report` on a real run: killed inside a save (SIGKILL, a subprocess), preempted
(SIGTERM), resumed to the end with `spotune train`, which writes the report itself. The page
parses, every image is a real PNG (embedded and beside the page), the headline numbers are
the ledger's, a run in progress (heartbeat, torn last line) and a file:// URL work, a bad
RUN_DIR exits 2 naming the path; Chromium renders the page to a non-blank image."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import warm_start
import yaml
from PIL import Image

from trainer import builtin_assets
from trainer import config as C
from trainer.cli.main import main as spotune
from trainer.cli.world import estimate_for_run
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_FINISHED, EXIT_PREEMPTED
from trainer.plan.pilot import summarise
from trainer.report import REPORT_FILE, report_after_train, write_report
from trainer.report.load import load_run
from trainer.report.page import default_out, render
from trainer.report.plots import FIGURES, uploads
from trainer.report.totals import attempt_of
from trainer.restart.books.ledger import HEARTBEAT_FILE, LEDGER_FILE, Ledger
from trainer.urls import redact

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
STEPS = 12  # attempt 2 is stopped after step 5: a wide margin before the end
IN_PROGRESS_FILES = ("config.yaml", "metrics.jsonl", LEDGER_FILE, HEARTBEAT_FILE)


def _recipe(out: Path, model: Path, data: Path, cache: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(cache), "eval_fraction": 0.1},
        "train": {"max_steps": STEPS, "micro_batch_size": 2, "lr": 1e-2, "eval_every": 4},
        "checkpoint": {"every_steps": 3, "every_minutes": None},
        "metrics": {"progress": False, "log_every": 1, "warmup_steps": 1, "price_per_hour": 2.5},
    }


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # the line being written
    return [r["step"] for r in rows if "loss" in r]


def _until(cond: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Any]:
    """Three attempts of one run: SIGKILL inside the first save, SIGTERM, then to the end."""
    tmp = tmp_path_factory.mktemp("report")
    out, snapshot = tmp / "run", tmp / "in-progress"
    data = builtin_assets.write_dataset(tmp / "train.jsonl", n=40)
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out, tiny_llama, data, tmp / "cache")))

    # Attempt 1, `spotune train` in its own process: the save at step 3 stalls halfway
    # (test hook) and is SIGKILLed there, so steps 1-3 are never committed and are redone.
    env = {**os.environ, "SPOTUNE_TEST_SAVE_PAUSE": "120"}
    p = warm_start.start(["train", str(recipe)], tmp / "attempt1.log", env=env, new_session=False)
    try:
        _until(lambda: any((out / "checkpoints").glob("step-*.tmp-*")) or p.poll() is not None, "the first save")
        assert p.poll() is None, (tmp / "attempt1.log").read_text()
    finally:
        p.kill()
        p.wait()

    assert _steps(out) == [1, 2, 3]

    # Attempt 2, in this process, starts again from step 0: SIGTERM once it logged step 5. The
    # run directory is copied first: a snapshot of a run in progress (heartbeat present).
    def preempt() -> None:
        _until(lambda: len(_steps(out)) >= 3 + 5, "step 5 of the second attempt")
        snapshot.mkdir()
        for name in IN_PROGRESS_FILES:
            shutil.copy(out / name, snapshot / name)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a SIGTERM landing after train() is harmless
    try:
        sender = threading.Thread(target=preempt, daemon=True)
        sender.start()
        # metrics.report=false: the page this attempt would write is replaced by the next one's, and
        # every check below reads the last one's (or writes its own).
        code2 = spotune(["train", str(recipe), "metrics.report=false"])
        sender.join(timeout=60)
        # Attempt 3: the same command, to the end; it writes report.html.
        code3 = spotune(["train", str(recipe)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"out": out, "snapshot": snapshot, "codes": (code2, code3)}


class _Page(HTMLParser):
    """Collects images, the headline figures and the text; checks every element is closed."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.images: list[dict[str, str]] = []
        self.values: dict[str, str] = {}
        self.text: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.scripts += tag == "script"
        if tag == "img":
            self.images.append(a)
        if "data-key" in a:
            self.values[a["data-key"]] = a["data-value"]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(page: Path | str) -> _Page:
    parser = _Page()
    parser.feed(page if isinstance(page, str) else page.read_text())
    parser.close()
    assert parser.stack == [], f"unclosed elements: {parser.stack}"
    return parser


def _html(run_dir: Path | str) -> str:
    """The page write_report writes for `run_dir`, without its figures: the same load_run and
    render, none of the half-second matplotlib charts (for checks on the page's figures and text;
    the charts are checked where they are written)."""
    return render(load_run(str(run_dir)), {})


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / LEDGER_FILE).read_text().splitlines()]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG) and len(data) > 1000
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        return im.size


def test_train_writes_a_report_whose_figures_are_the_ledgers(real_run: dict[str, Any], tmp_path: Path) -> None:
    out = real_run["out"]
    assert real_run["codes"] == (EXIT_PREEMPTED, EXIT_FINISHED)
    rows = _ledger(out)
    assert [r["exit_reason"] for r in rows] == ["killed", "preempted", "finished"]
    page = _parse(out / REPORT_FILE)  # written by the last `spotune train` itself
    assert page.scripts == 0

    # Every image is embedded as a PNG data URI, equal to the PNG written beside the page.
    # (An SFT run has no rewards: the preference figure is left out.)
    assert [img["data-file"] for img in page.images] == [n for n in FIGURES if n != "preference.png"]
    assert not (out / "preference.png").exists()
    for img in page.images:
        head, b64 = img["src"].split(",", 1)
        assert head == "data:image/png;base64"
        embedded = base64.b64decode(b64, validate=True)
        assert embedded == (out / img["data-file"]).read_bytes()
        width, height = _png_size(embedded)
        assert width >= 800 and height >= 150

    # The headline numbers are the ledger's totals: the page was written before the last row
    # (so that the row counts the page's time too), from the heartbeat just before it.
    v = page.values
    page_time = rows[-1]["phases"]["report"] * rows[-1]["world_size"]
    device_s = sum(r["device_seconds"] for r in rows)
    assert float(v["gpu_hours"]) * 3600 == pytest.approx(device_s - page_time, abs=1e-3)  # phases keep 4 decimals
    assert float(v["cost"]) == pytest.approx(sum(r["cost"] for r in rows) * (device_s - page_time) / device_s, rel=1e-3)
    productive = sum(r["productive_seconds"] for r in rows)
    assert float(v["goodput"]) == pytest.approx(productive / (device_s - page_time), rel=1e-3)
    # `spotune report` afterwards reads the closed rows: exactly the ledger (repr round-trips a float).
    again = _parse(_html(out)).values
    assert float(again["gpu_hours"]) == device_s / 3600
    assert float(again["cost"]) == sum(r["cost"] for r in rows)
    assert float(again["goodput"]) == productive / device_s
    assert int(v["restarts"]) == 2 and v["status"] == "finished"
    losses = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert float(v["final_loss"]) == [r for r in losses if "loss" in r][-1]["loss"]
    text = " ".join(page.text)
    assert f"Finished at step {STEPS} of {STEPS}." in text
    assert "2 restart(s)" in text and "3 steps redone" in text  # steps 1-3, never committed before the kill
    restart_s = sum(r["lost_seconds"] for r in rows) + sum(r["startup_seconds"] for r in rows[1:])
    assert float(v["restart_cost"]) == pytest.approx(restart_s / 3600 * 2.5, rel=1e-12)


def test_report_reads_the_ledger_not_a_copy(real_run: dict[str, Any], tmp_path: Path) -> None:
    """Control: one more device-hour in ledger.jsonl moves the page's GPU-hours by exactly that."""
    run = tmp_path / "run"
    shutil.copytree(real_run["out"], run, ignore=shutil.ignore_patterns("checkpoints", "final", "*.png", "*.html"))
    before = _parse(_html(run)).values
    rows = _ledger(run)
    rows[-1]["device_seconds"] += 3600.0
    (run / LEDGER_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    after = _parse(_html(run)).values
    assert float(after["gpu_hours"]) == pytest.approx(float(before["gpu_hours"]) + 1.0, abs=1e-12)
    assert after["cost"] == before["cost"]  # the row's cost was not touched


def test_cli_report_of_a_run_in_progress_with_a_torn_line(
    real_run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap = real_run["snapshot"]
    run = tmp_path / "live"
    shutil.copytree(snap, run)
    torn_at = len((run / "metrics.jsonl").read_text().splitlines()) + 1
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.0, "tok')  # the row being written when we read
    assert spotune(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    printed = capsys.readouterr().out
    assert f"run report: {tmp_path / 'page' / REPORT_FILE}" in printed and "In progress at step" in printed
    page = _parse(tmp_path / "page" / REPORT_FILE)
    heartbeat = json.loads((run / HEARTBEAT_FILE).read_text())
    killed = _ledger(run)
    assert [r["exit_reason"] for r in killed] == ["killed"]
    live = (heartbeat["heartbeat_time"] - heartbeat["start_time"]) * heartbeat["world_size"]
    assert float(page.values["gpu_hours"]) == (killed[0]["device_seconds"] + live) / 3600
    assert page.values["status"] == "running" and int(page.values["restarts"]) == 1
    assert f"metrics.jsonl line {torn_at} is not complete JSON" in " ".join(page.text)


def test_a_run_still_starting_and_a_run_without_a_ledger(real_run: dict[str, Any], tmp_path: Path) -> None:
    """Ledger.open writes the heartbeat before the first step: the page says so. Metrics
    without any ledger (an older run) still give a page, which says what it cannot know."""
    starting = tmp_path / "starting"
    Ledger.open(starting, world_size=1, price_per_hour=1.0)
    page, summary = write_report(starting)
    assert summary.startswith("In progress at start-up, before step 1") and "No loss logged yet" in summary
    heartbeat = json.loads((starting / HEARTBEAT_FILE).read_text())
    expected = (heartbeat["heartbeat_time"] - heartbeat["start_time"]) / 3600
    assert float(_parse(page).values["gpu_hours"]) == expected
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(real_run["out"] / "metrics.jsonl", old)
    page, summary = write_report(old)
    assert summary.startswith("No ledger.jsonl: whether it finished, and its hours and cost, are unknown")
    assert _parse(page).values["status"] == "unknown"


def test_fsspec_url_reads_the_same_run(real_run: dict[str, Any], tmp_path: Path) -> None:
    """A file:// URL goes through fsspec.open like s3:// or gs:// would; same figures."""
    local_html = _html(real_run["out"])
    local = _parse(local_html).values
    page, summary = write_report(f"file://{real_run['out']}", tmp_path / "remote")
    assert page == tmp_path / "remote" / REPORT_FILE and f"Finished at step {STEPS} of {STEPS}." in summary
    assert _parse(page).values == local
    # the header too: the checkpoint, adapter config and manifest are found through fsspec
    local_facts = _facts(local_html)
    assert _facts(page.read_text()) == local_facts and {"adapter", "data_train", "batch"} <= set(local_facts)
    assert all(
        (tmp_path / "remote" / name).read_bytes().startswith(PNG) for name in FIGURES if name != "preference.png"
    )


def test_report_goes_beside_a_local_run_and_into_the_current_directory_for_a_remote_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_out(f"file://{tmp_path}/runs/a") == tmp_path / "runs" / "a"
    assert default_out("runs/a") == Path("runs/a")
    assert default_out("memory://bucket/runs/a/") == tmp_path / "report-a"  # fsspec's in-memory store


def test_shown_url_drops_credentials_and_signatures() -> None:
    assert redact("s3://key:secret@bucket/runs/a?X-Amz-Signature=abc") == "s3://bucket/runs/a"
    assert redact("https://host:8443/run?sig=1") == "https://host:8443/run"
    assert redact("/local/run") == "/local/run"


def test_pilot_forecast_sits_beside_the_actual(real_run: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(real_run["out"], run, ignore=shutil.ignore_patterns("checkpoints", "final", "*.png", "*.html"))
    html = write_report(run)[0].read_text()
    assert "Forecast beside the actual" not in html  # control: no pilot.json, no table
    # The page again as write_report writes it, with the charts it drew just now (they read neither
    # pilot.json nor estimate.json, only the metrics and the ledger, which stay as they are), and with none.
    drawn = {name: (run / name).read_bytes() for name in FIGURES if (run / name).is_file()}
    assert len(drawn) >= 3
    pilot = summarise(real_run["out"], warmup_steps=1, device="cpu (test)")  # pilot.py's own summary
    (run / "pilot").mkdir()
    (run / "pilot" / "pilot.json").write_text(json.dumps(pilot))
    html = render(load_run(str(run)), drawn)
    assert html.index("Where the time and money went") < html.index("Forecast beside the actual")
    assert html.index("Forecast beside the actual") < html.index("<h2>Training</h2>")
    # A page with fewer than three charts still has its forecast (it sat before the third chart).
    bare = render(load_run(str(run)), {})
    assert "Forecast beside the actual" in bare and "<h2>Training</h2>" not in bare
    assert f"<td>sustained tokens/s</td><td>{pilot['sustained_tokens_per_s']:,.0f}</td>" in html
    # `spotune estimate --json` saved beside it: its forecast for the machine the pilot measured.
    estimate = estimate_for_run(C.load(run / "config.yaml"), pilot_json=run / "pilot" / "pilot.json")
    (run / "estimate.json").write_text(json.dumps(estimate))
    option = estimate["options"][0]
    assert option["gpu"] == "cpu (test)" and option["pricing"] == "on-demand"
    html = render(load_run(str(run)), drawn)
    assert (
        f"<td>device-hours (estimate: cpu (test) ×1 on-demand)</td><td>{option['gpu_hours']['expected']:,.4g}</td>"
        in html
    )


def test_bad_run_dir_exits_2_naming_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-run"
    assert spotune(["report", str(missing)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert f"{missing} does not exist" in err and "output_dir" in err
    (tmp_path / "empty").mkdir()
    assert spotune(["report", str(tmp_path / "empty")]) == EXIT_BAD_INPUT
    assert f"{tmp_path / 'empty'} exists but holds no metrics.jsonl" in capsys.readouterr().err


def test_a_failing_report_is_only_a_warning(tmp_path: Path) -> None:
    said: list[str] = []
    assert report_after_train(tmp_path, said.append) is None
    assert len(said) == 1 and said[0].startswith("spotune: warning: no run report") and str(tmp_path) in said[0]


def _screenshot(chromium: str, url: str, png: Path, profile: Path) -> np.ndarray:
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            "--window-size=1280,2000",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    with Image.open(png) as im:
        return np.asarray(im.convert("L"), dtype=np.float64)


@pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)
def test_chromium_renders_the_page_offline(real_run: dict[str, Any], tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or ""
    shot = _screenshot(chromium, (real_run["out"] / REPORT_FILE).as_uri(), tmp_path / "page.png", tmp_path / "p1")
    assert shot.shape == (2000, 1280)
    assert shot.std() > 20 and len(np.unique(shot)) > 50  # text, cards and plots: far from blank
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    control = _screenshot(chromium, blank.as_uri(), tmp_path / "blank.png", tmp_path / "p2")
    assert control.std() < 1  # the check above can fail: an empty page is uniform


def test_uploads_are_read_from_the_metrics_rows_when_present(real_run: dict[str, Any], tmp_path: Path) -> None:
    """checkpoint.remote adds `remote_step` / `upload_seconds` to metrics rows: one upload each
    time remote_step advances, in the attempt that wrote the row."""
    run = tmp_path / "run"
    shutil.copytree(real_run["out"], run, ignore=shutil.ignore_patterns("checkpoints", "final", "*.png", "*.html"))
    assert uploads(load_run(str(run))) == []  # control: a run without a remote has none
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    before = load_run(str(run))
    owners = [getattr(attempt_of(before.attempts, r), "attempt", None) for r in train]
    # The remote copy advances at each attempt's first row (where the kills fall varies run to run).
    firsts = [i for i in range(len(train)) if i == 0 or owners[i] != owners[i - 1]]
    for i, r in enumerate(train):
        n = sum(1 for f in firsts if f <= i)
        r.update(remote_step=n, upload_seconds=0.5 + n)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    loaded = load_run(str(run))
    expected = [(train[i]["time"], owners[i], train[i]["upload_seconds"]) for i in firsts]
    assert uploads(loaded) == expected
    assert {a for _, a, _ in expected} == {1, 2, 3}


# ---------------------------------------------------------------------------- what was trained


def _facts(html: str) -> dict[str, str]:
    rows = re.findall(r'<tr data-fact="([a-z_]+)"><th>[^<]*</th><td>([^<]*)</td></tr>', html)
    return {k: unescape(v) for k, v in rows}


def test_header_says_what_was_trained(real_run: dict[str, Any], tiny_llama: Path) -> None:
    out = real_run["out"]
    html = (out / REPORT_FILE).read_text()
    facts = _facts(html)
    assert facts["model"] == f"{tiny_llama} (float32)"
    targets = json.loads((out / "final" / "adapter_config.json").read_text())["target_modules"]
    assert facts["adapter"] == f"LoRA, rank 4, alpha 8, dropout 0.05; targets: {', '.join(sorted(targets))}"
    (manifest_path,) = (out.parent / "cache").glob("*/manifest.json")  # data.cache_dir, outside the run
    manifest = json.loads(manifest_path.read_text())
    train = manifest["train"]
    how = f"(alpaca, chat template: {manifest['train']['chat_template']})"  # what `auto` chose, and the template
    # the data path relative to the run (a shared report keeps the machine's absolute paths out)
    shown = os.path.relpath(manifest["sources"]["train"], out)
    assert os.path.isabs(manifest["sources"]["train"]) and shown.startswith("..")
    assert facts["data"].startswith(f"{shown} {how}") and "seq_len 128" in facts["data"]
    assert manifest["sources"]["train"] not in html
    assert (
        f"in {train['rows']:,} rows; {train['real_tokens']:,} tokens, {train['trainable_tokens']:,} trained"
        in (facts["data_train"])
    )
    assert f"packing efficiency {train['packing_efficiency']:.1%}" in facts["data_train"]
    assert "data_eval" in facts  # eval_fraction 0.1
    rows = C.batch_split(C.load(out / "config.yaml").train, 1).global_rows
    assert facts["batch"] == f"{rows} rows × 128 tokens = {rows * 128:,} tokens per step"
    assert facts["lr_schedule"].startswith("0.01 peak, cosine after")
    assert facts["gpus"] == "1 × cpu (3 attempts)"  # every attempt's ledger row names its device
    assert facts["attempts"] == "3: killed, preempted, finished"
    assert [r["device"] for r in _ledger(out)] == ["cpu"] * 3
    assert facts["versions"].startswith("torch ")


def test_the_training_example_marks_exactly_the_trained_tokens(real_run: dict[str, Any]) -> None:
    import datasets
    from transformers import AutoTokenizer

    out = real_run["out"]
    html = (out / REPORT_FILE).read_text()
    example = re.search(r'<pre class="example" id="example">(.*?)</pre>', html, re.DOTALL)
    assert example is not None
    marked = "".join(unescape(m) for m in re.findall(r"<mark>(.*?)</mark>", example.group(1), re.DOTALL))
    everything = unescape(re.sub(r"</?mark>", "", example.group(1)))
    # read independently: the datasets library, the first document of the first packed row
    (manifest_path,) = (out.parent / "cache").glob("*/manifest.json")
    row = datasets.load_from_disk(str(manifest_path.parent / "train"))[0]
    end = next((i for i, p in enumerate(row["position_ids"]) if i and p == 0), len(row["input_ids"]))
    ids, labels = row["input_ids"][:end], row["labels"][:end]
    tok = AutoTokenizer.from_pretrained(str(out / "final"))
    assert everything == tok.decode(ids)
    assert marked == tok.decode([i for i, x in zip(ids, labels, strict=True) if x != -100]) and marked
    assert marked != everything  # control: the prompt is there and not marked


def test_learning_rate_and_grad_norm_are_plotted_from_the_rows(real_run: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(real_run["out"], run, ignore=shutil.ignore_patterns("checkpoints", "final", "*.png", "*.html"))
    assert list(FIGURES)[2:4] == ["loss.png", "optimizer.png"]  # beside the loss
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["lr"], float) and isinstance(r["grad_norm"], float) for r in rows if "loss" in r)
    facts = _facts(_html(run))
    # without checkpoints (none copied) the manifest is the newest one under data.cache_dir
    assert "data_train" in facts and "versions" not in facts
    draw = FIGURES["optimizer.png"][0]  # what write_report draws into optimizer.png
    before = draw(load_run(str(run)))
    _png_size(before)
    for r in rows:
        if "lr" in r:
            r["grad_norm"] *= 3.0  # control: the picture follows the data
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert draw(load_run(str(run))) != before


def test_a_live_run_shows_its_eta_and_projected_cost(real_run: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "live"
    shutil.copytree(real_run["snapshot"], run)
    values = _parse(_html(run)).values
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    live = [r for r in train if r["attempt"] == 2]
    assert float(values["projected_cost"]) == train[-1]["projected_cost"]
    expected = (STEPS - train[-1]["step"]) * sum(r["step_time_s"] for r in live) / len(live)
    assert float(values["eta"]) == pytest.approx(expected, rel=1e-12)
    finished = _parse(_html(real_run["out"])).values
    assert "eta" not in finished and "projected_cost" not in finished  # control: a finished run has none


def _two_attempts() -> Any:
    """A run logged every 5 steps, saving every 20: attempt 1 saves at 20 (its row 25 shows the pause),
    is preempted at 27 and saves there; attempt 2 resumes at 27 and finishes at 40, saving there."""
    from trainer.report.load import Attempt, RunData

    cfg = C.load(Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml", ["checkpoint.every_steps=20"])
    t0 = 1_800_000_000.0

    def row(step: int, attempt: int, paused: float, t: float) -> dict[str, Any]:
        return {"step": step, "loss": 1.0, "attempt": attempt, "paused_s": paused, "time": t0 + t, "lr": 1e-3,
                "tokens_per_s": 100.0, "sustained_tokens_per_s": 100.0, "data_stall_share": 0.1, "mfu": None,
                "peak_memory_gib": 0.5, "grad_norm": 1.0}  # fmt: skip

    rows = [row(s, 1, 2.0 if s >= 25 else 0.0, s) for s in (5, 10, 15, 20, 25)]
    rows += [row(s, 2, 0.0, 100 + s) for s in (30, 35, 40)]

    def attempt(n: int, start: float, end: float, reason: str, last: int, resumed: int) -> Attempt:
        return Attempt(n, t0 + start, t0 + end, 1, reason, end - start, 1.0, end - start - 3, 2.0, 0.0, None, last,
                       "cpu", resumed)  # fmt: skip

    attempts = [attempt(1, 0, 28, "preempted", 27, 0), attempt(2, 126, 141, "finished", 40, 27)]
    return RunData("run", cfg, rows, [], attempts)


def test_checkpoint_markers_sit_at_the_step_saved_and_the_last_save_is_shown() -> None:
    from trainer.report.plots import _saves

    steps = [step for _, step in _saves(_two_attempts())]
    assert steps == [20, 27, 40]  # not 25, the row after the save; the saves at exit are shown


def test_every_throughput_panel_has_step_ticks_and_the_stall_line_breaks_between_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from trainer.report import plots

    figures: list[Any] = []
    monkeypatch.setattr(plots, "_png", lambda fig: figures.append(fig) or b"")
    run = _two_attempts()
    plots.throughput(run)
    (fig,) = figures
    FigureCanvasAgg(fig).draw()
    tok, mfu, stall, mem = fig.axes
    for ax in (tok, stall, mem):
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert labels, ax.get_title()
    assert "no MFU" in " ".join(t.get_text() for t in mfu.texts)  # the CPU run's empty panel
    xs, _ = plots._per_attempt(run, run.train_rows, "step", "data_stall_share")
    gaps = [i for i, v in enumerate(xs) if v != v]
    assert len(gaps) == 1 and xs[gaps[0] - 1] == 25 and xs[gaps[0] + 1] == 30  # one line per attempt


def test_a_data_path_is_shown_relative_to_a_local_run_and_by_name_beside_a_remote_one() -> None:
    from trainer.report.trained import shown_path

    assert shown_path("/home/alice/data/chats.jsonl", "/home/alice/runs/mine") == "../../data/chats.jsonl"
    assert shown_path("/home/alice/data/chats.jsonl", "file:///home/alice/runs/mine") == "../../data/chats.jsonl"
    assert shown_path("/home/alice/data/chats.jsonl", "s3://bucket/runs/mine") == ".../chats.jsonl"
    assert shown_path("org/name@abc123", "/home/alice/runs/mine") == "org/name@abc123"  # control: a hub id as is
