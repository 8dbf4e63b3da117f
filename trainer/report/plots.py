"""The report's PNGs, drawn with matplotlib's object API (`Figure`, Agg canvas).

No pyplot: pyplot keeps global figures and a global backend, and the report also runs at
the end of `train` inside the user's process. Every function takes the records of
load.py and returns the PNG bytes, so the page can embed them and write them beside it.
"""

from __future__ import annotations

import io
import math
from datetime import datetime, timezone
from typing import Any

import matplotlib.dates as mdates
from matplotlib.figure import Figure

from trainer.report.load import RunData, finite
from trainer.report.totals import attempt_of, hours_unit, redone_by_attempt

DPI = 100
COLORS = {
    "startup": "#b8b8b8",
    "productive": "#3b7dd8",
    "checkpoint": "#8e5bd6",
    "lost": "#e0453a",
    "other": "#f2c14e",
    "train": "#3b7dd8",
    "eval": "#e07b39",
    "cost": "#2a9d5c",
}
LEGEND = {
    "startup": "start-up",
    "productive": "productive (kept)",
    "checkpoint": "saving",
    "lost": "lost (redone later)",
    "other": "other (eval, final/, exit)",
}
END_MARK = {  # exit reason -> marker and colour at the end of the attempt's bar
    "finished": ("o", "#2a9d5c"),
    "preempted": ("v", "#e09b1a"),
    "budget": ("s", "#e09b1a"),
    "killed": ("X", "#d0312d"),
    "error": ("X", "#7f1d1d"),
    "aborted": ("X", "#7f1d1d"),
    "bad_steps": ("X", "#7f1d1d"),
    "running": (">", "#3b7dd8"),
}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _series(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(float(r[x]), float(r[y])) for r in rows if finite(r.get(x)) and finite(r.get(y))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _per_attempt(run: RunData, rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """Like `_series`, with a gap (NaN) where one attempt ends and the next begins: a line
    never joins a killed attempt's last step to the resumed attempt's first."""
    xs: list[float] = []
    ys: list[float] = []
    previous: Any = None
    last_step = -math.inf
    for r in rows:
        if not (finite(r.get(x)) and finite(r.get(y))):
            continue
        # the row's own attempt number where it has one (a killed attempt may have no ledger row to match)
        number = r.get("attempt")
        owner = number if isinstance(number, int) else attempt_of(run.attempts, r)
        step = float(r["step"]) if finite(r.get("step")) else last_step
        if xs and (owner != previous or step < last_step):  # a new attempt, or steps trained again
            xs.append(math.nan)
            ys.append(math.nan)
        previous, last_step = owner, step
        xs.append(float(r[x]))
        ys.append(float(r[y]))
    return xs, ys


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666", wrap=True)
    # this panel's ticks only: set_xticks([]) on an axis shared with other panels would clear theirs too
    ax.tick_params(bottom=False, labelbottom=False, left=False, labelleft=False)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def timeline(run: RunData) -> bytes:
    """Processes (one lane per attempt), steps reached and cost so far, on one wall-clock axis."""
    fig = Figure(figsize=(11, 6.6), layout="tight")
    ax_p, ax_s, ax_c = fig.subplots(3, 1, sharex=True, height_ratios=[1.4, 1.2, 1.0])
    _processes(ax_p, run)
    _steps(ax_s, run)
    _cost(ax_c, run)
    ax_c.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax_c.xaxis.get_major_locator()))
    ax_c.set_xlabel("wall clock (UTC)")
    for ax in (ax_p, ax_s, ax_c):
        ax.grid(alpha=0.3)
    return _png(fig)


def _processes(ax_p: Any, run: RunData) -> None:
    """The timeline's top panel: one lane per attempt, start-up then training, how it ended, uploads."""
    attempts = run.attempts
    redone = redone_by_attempt(run)
    sent = uploads(run)
    if not attempts:  # text only: clearing the ticks of a shared date axis would clear them all
        ax_p.text(0.5, 0.5, "no ledger.jsonl rows yet", ha="center", va="center", transform=ax_p.transAxes)
    for lane, a in enumerate(attempts):
        startup = a.startup_seconds / a.world_size
        span = max(a.end - a.start, 1e-3)
        day = 86400.0  # broken_barh on a date axis takes days
        ax_p.broken_barh(
            [(mdates.date2num(_dt(a.start)), min(startup, span) / day)],
            (lane - 0.35, 0.7),
            color=COLORS["startup"],
        )
        ax_p.broken_barh(
            [(mdates.date2num(_dt(a.start + startup)), max(span - startup, 0.0) / day)],
            (lane - 0.35, 0.7),
            color=COLORS["productive"],
            hatch="//" if a.running else None,
            alpha=0.85,
        )
        marker, color = END_MARK.get(a.exit_reason, ("X", "#7f1d1d"))
        ax_p.plot([_dt(a.end)], [lane], marker=marker, color=color, markersize=11, markeredgecolor="white")
        bits = [f"#{a.attempt} {a.exit_reason}"]
        if redone.get(a.attempt):
            bits.append(f"redid {redone[a.attempt]} steps")
        if a.lost_seconds:
            bits.append(f"lost {_duration(a.lost_seconds)}")
        bits.append(f"saving {_duration(a.checkpoint_seconds)}")
        upload_s = [s for _, attempt, s in sent if attempt == a.attempt]
        if upload_s:
            bits.append(f"{len(upload_s)} uploads {_duration(sum(upload_s))}")
        if a.cost is not None:
            bits.append(f"${a.cost:,.2f}")
        ax_p.annotate(
            " · ".join(bits), (_dt(a.start), lane - 0.4), fontsize=8, va="bottom", ha="left", annotation_clip=False
        )
    lanes = {a.attempt: i for i, a in enumerate(attempts)}
    for t, attempt, _ in sent:
        ax_p.plot([_dt(t)], [lanes[attempt]], marker="^", color=COLORS["checkpoint"], markersize=7)
    ax_p.set_yticks(range(len(attempts)), [f"#{a.attempt}" for a in attempts])
    ax_p.set_ylim(len(attempts) - 0.5, -0.85)  # first attempt on top; room for each lane's label
    ax_p.set_title("Processes: grey start-up, blue training; ▼ preempted, ✕ killed/error, ● finished, ▲ upload")


def _steps(ax_s: Any, run: RunData) -> None:
    """The timeline's middle panel: each logged step, steps trained again, checkpoints."""
    seen: set[int] = set()
    ok: list[tuple[datetime, float]] = []
    again: list[tuple[datetime, float]] = []
    for r in run.train_rows:
        if not finite(r.get("time")):
            continue
        (again if int(r["step"]) in seen else ok).append((_dt(r["time"]), r["step"]))
        seen.add(int(r["step"]))
    if ok:
        ax_s.plot(*zip(*ok, strict=True), ".", color=COLORS["train"], markersize=4, label="step")
    if again:
        ax_s.plot(*zip(*again, strict=True), ".", color=COLORS["lost"], markersize=6, label="step trained again")
    saves = _saves(run)
    if saves:
        ax_s.plot(*zip(*saves, strict=True), "|", color=COLORS["checkpoint"], markersize=12, label="checkpoint/eval")
    ax_s.set_ylabel("step")
    if ok:
        ax_s.legend(loc="upper left", fontsize=8)


def _cost(ax_c: Any, run: RunData) -> None:
    """The timeline's bottom panel: cost (or device-hours) so far, per log step and per attempt."""
    xs, ys = _series(run.train_rows, "time", "cost")
    unit = hours_unit([a.device for a in run.attempts])
    label, key = ("cost so far ($)", "cost") if xs else (f"{unit} so far", "device_hours")
    xs, ys = _series(run.train_rows, "time", key)
    if xs:
        ax_c.plot([_dt(x) for x in xs], ys, ".-", color=COLORS["cost"], markersize=3, label="at each log step")
    ends, running = [], 0.0
    for a in run.attempts:
        running += (a.cost or 0.0) if key == "cost" else a.device_seconds / 3600.0
        ends.append((_dt(a.end), running))
    if ends:
        ax_c.plot(*zip(*ends, strict=True), "D", color="black", markersize=5, label="ledger, end of attempt")
        ax_c.legend(loc="upper left", fontsize=8)
    ax_c.set_ylabel(label)


SAVED_AT_EXIT = ("preempted", "finished", "budget")
"""Exit reasons whose attempt saved at its last step (a checkpoint on the notice, final/ at the end)."""


def _saves(run: RunData) -> list[tuple[datetime, float]]:
    """Where each attempt paused (checkpoint or evaluation; `paused_s` grew) at the step it paused after.

    A row says only that a pause happened since the attempt's previous row: the step is the multiple of
    `checkpoint.every_steps` since the previous row's step, inclusive (a save by steps), else the row's own (a save by minutes, or an
    evaluation: the latest it can be); its time is read off the line between the two rows. An attempt
    that saved as it ended (SAVED_AT_EXIT) has its last save at its last step and end, after every row."""
    every = run.config.checkpoint.every_steps if run.config is not None else None
    out = []
    prev: dict[int, tuple[float, float, float]] = {}  # attempt -> (paused_s, step, time) of its previous row
    last: dict[int, float] = {}
    for r in run.train_rows:
        a = attempt_of(run.attempts, r)
        if a is None or not finite(r.get("paused_s")) or not finite(r.get("time")):
            continue
        paused, step, t = float(r["paused_s"]), float(r["step"]), float(r["time"])
        before = prev.get(a.attempt, (0.0, float(a.resumed_from or 0), a.start))
        if paused > before[0]:
            at = step
            if every:
                multiple = step // every * every
                at = multiple if multiple >= before[1] else step  # a row is logged before its step's save
            span = step - before[1]
            when = before[2] + (t - before[2]) * ((at - before[1]) / span if span > 0 else 1.0)
            out.append((_dt(when), at))
            last[a.attempt] = at
        prev[a.attempt] = (paused, step, t)
    for a in run.attempts:
        if a.exit_reason in SAVED_AT_EXIT and a.last_step is not None and last.get(a.attempt) != a.last_step:
            out.append((_dt(a.end), float(a.last_step)))
    return out


def uploads(run: RunData) -> list[tuple[float, int, float]]:
    """(time, attempt, seconds) each time `remote_step` advanced in the metrics rows: a
    checkpoint reached the remote store, in the `upload_seconds` that row reports."""
    out = []
    last = None
    for r in run.train_rows:
        step = r.get("remote_step")
        if step is not None and step != last and finite(r.get("time")):
            a = attempt_of(run.attempts, r)
            if a is not None:
                seconds = float(r["upload_seconds"]) if finite(r.get("upload_seconds")) else 0.0
                out.append((float(r["time"]), a.attempt, seconds))
        last = step
    return out


def hours(run: RunData) -> bytes:
    """Where each attempt's paid device time went, as stacked bars."""
    fig = Figure(figsize=(11, 0.6 * len(run.attempts) + 1.6), layout="tight")
    ax = fig.subplots()
    if not run.attempts:
        _empty(ax, "no ledger.jsonl rows yet")
        return _png(fig)
    scale, unit = _unit(max(a.device_seconds for a in run.attempts))
    labels = []
    for i, a in enumerate(run.attempts):
        parts = [
            ("startup", a.startup_seconds),
            ("productive", a.productive_seconds),
            ("checkpoint", a.checkpoint_seconds),
            ("lost", a.lost_seconds),
        ]
        parts.append(("other", max(0.0, a.device_seconds - sum(s for _, s in parts))))
        left = 0.0
        for name, seconds in parts:
            label = LEGEND.get(name, name) if i == 0 else None
            ax.barh(i, seconds / scale, left=left, color=COLORS[name], label=label)
            left += seconds / scale
        labels.append(f"#{a.attempt} {a.exit_reason}")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"device-{unit}")
    ax.legend(ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def _unit(seconds: float) -> tuple[float, str]:
    if seconds < 120:
        return 1.0, "seconds"
    if seconds < 7200:
        return 60.0, "minutes"
    return 3600.0, "hours"


def loss(run: RunData) -> bytes:
    """Loss (and eval loss) against step and against device-hours (GPU-hours on GPUs)."""
    fig = Figure(figsize=(11, 3.6), layout="tight")
    ax_step, ax_hours = fig.subplots(1, 2, sharey=True)
    hours_at = {int(r["step"]): r["device_hours"] for r in run.train_rows if finite(r.get("device_hours"))}
    rows = run.train_rows
    ax_step.plot(*_per_attempt(run, rows, "step", "loss"), ".-", color=COLORS["train"], lw=1.2, label="train loss")
    ax_hours.plot(*_per_attempt(run, rows, "device_hours", "loss"), ".-", color=COLORS["train"], lw=1.2)
    ex, ey = _series(run.eval_rows, "step", "eval_loss")
    if ex:
        ax_step.plot(ex, ey, "o-", color=COLORS["eval"], label="eval loss")
        pts = [(hours_at[int(s)], y) for s, y in zip(ex, ey, strict=True) if int(s) in hours_at]
        if pts:
            ax_hours.plot(*zip(*pts, strict=True), "o-", color=COLORS["eval"])
    ax_step.set_xlabel("step")
    ax_hours.set_xlabel(f"{hours_unit([a.device for a in run.attempts])} (devices x wall time, every attempt)")
    ax_hours.set_title("one segment per attempt: redone steps appear again, at the hours paid twice", fontsize=9)
    ax_step.set_title("loss by step", fontsize=9)
    ax_step.set_ylabel("loss")
    ax_step.legend(fontsize=8)
    for ax in (ax_step, ax_hours):
        ax.grid(alpha=0.3)
    return _png(fig)


def throughput(run: RunData) -> bytes:
    """Tokens/s, MFU, data-stall share and peak memory against step."""
    fig = Figure(figsize=(11, 5.6), layout="tight")
    (ax_tok, ax_mfu), (ax_stall, ax_mem) = fig.subplots(2, 2, sharex=True)
    rows = run.train_rows
    ax_tok.plot(*_series(rows, "step", "tokens_per_s"), ".", color="#9bbce8", markersize=4, label="since last row")
    sustained = _per_attempt(run, rows, "step", "sustained_tokens_per_s")
    ax_tok.plot(*sustained, "-", color=COLORS["train"], label="sustained (per attempt)")
    ax_tok.set_title("real tokens/s", fontsize=10)
    ax_tok.legend(fontsize=8)
    x, y = _series(rows, "step", "mfu")
    has_mfu = bool(x)
    if x:
        ax_mfu.plot(x, [v * 100 for v in y], ".", color="#9bbce8", markersize=4)
        sx, sy = _per_attempt(run, rows, "step", "sustained_mfu")
        ax_mfu.plot(sx, [v * 100 for v in sy], "-", color=COLORS["train"])
        ax_mfu.set_title("MFU (%)", fontsize=10)
    else:
        ax_mfu.set_title("MFU", fontsize=10)
        _empty(ax_mfu, "no MFU: the device's peak FLOP/s is unknown\n(CPU, or set metrics.gpu / metrics.peak_flops)")
    x, y = _per_attempt(run, rows, "step", "data_stall_share")
    ax_stall.plot(x, [v * 100 for v in y], ".-", color=COLORS["other"], markersize=4)
    ax_stall.set_title("data stall (% of step time)", fontsize=10)
    ax_stall.set_ylim(bottom=0)
    ax_mem.plot(*_per_attempt(run, rows, "step", "peak_memory_gib"), ".-", color=COLORS["checkpoint"], markersize=4)
    ax_mem.set_title("peak memory (GiB; CPU: peak RSS)", fontsize=10)
    for ax in (ax_stall, ax_mem):
        ax.set_xlabel("step")
    for ax in (ax_tok, ax_mfu, ax_stall, ax_mem):
        if ax is not ax_mfu or has_mfu:  # a shared x axis shows its step labels on the lower row only
            ax.tick_params(labelbottom=True)
            ax.grid(alpha=0.3)
    return _png(fig)


def optimizer(run: RunData) -> bytes:
    """The learning rate the schedule gave each step, and the gradient norm before clipping."""
    fig = Figure(figsize=(11, 3.2), layout="tight")
    ax_lr, ax_norm = fig.subplots(1, 2, sharex=True)
    rows = run.train_rows
    ax_lr.plot(*_per_attempt(run, rows, "step", "lr"), ".-", color=COLORS["train"], markersize=3)
    ax_lr.set_title("learning rate", fontsize=10)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    x, y = _per_attempt(run, rows, "step", "grad_norm")
    ax_norm.plot(x, y, ".-", color=COLORS["eval"], markersize=3, label="grad norm (before clipping)")
    clip = run.config.train.max_grad_norm if run.config is not None else None
    if clip and x:
        ax_norm.axhline(clip, color="#666", lw=1, ls="--", label=f"clipped to {clip:g} (train.max_grad_norm)")
    ax_norm.set_title("gradient norm", fontsize=10)
    ax_norm.legend(fontsize=8)
    for ax in (ax_lr, ax_norm):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return _png(fig)


def preference(run: RunData) -> bytes:
    """A preference run's reward margin and reward accuracy against step, training and held out;
    b"" for a run without rewards (SFT), which the page leaves out."""
    rows = run.train_rows
    if not any(finite(r.get("rewards/margins")) for r in rows):
        return b""
    fig = Figure(figsize=(11, 3.2), layout="tight")
    ax_margin, ax_accuracy = fig.subplots(1, 2, sharex=True)
    for ax, name, title in (
        (ax_margin, "rewards/margins", "reward margin (chosen - rejected)"),
        (ax_accuracy, "rewards/accuracies", "reward accuracy (share of pairs ranked right)"),
    ):
        ax.plot(*_per_attempt(run, rows, "step", name), ".-", color=COLORS["train"], markersize=3, label="train")
        ex, ey = _series(run.eval_rows, "step", f"eval_{name}")
        if ex:
            ax.plot(ex, ey, "o-", color=COLORS["eval"], label="eval")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_margin.axhline(0.0, color="#666", lw=1, ls="--")
    ax_accuracy.set_ylim(-0.02, 1.02)
    return _png(fig)


FIGURES = {
    "timeline.png": (timeline, "Timeline: processes, steps and cost on one clock"),
    "hours.png": (hours, "Where the paid device time went, per attempt"),
    "loss.png": (loss, "Loss against step and against device-hours"),
    "optimizer.png": (optimizer, "Learning rate and gradient norm against step"),
    "throughput.png": (throughput, "Throughput, MFU, data stall and memory"),
    "preference.png": (preference, "Reward margin and reward accuracy (preference objectives)"),
}
"""File name -> (drawing function, caption), in page order; a function with nothing to draw returns b""."""
SECTIONS = {
    "Where the time and money went": ("timeline.png", "hours.png"),
    "Training": ("loss.png", "optimizer.png", "throughput.png", "preference.png"),
}
"""The page's headings, each over its figures; the forecast table sits between the two, whatever was drawn."""
assert [name for names in SECTIONS.values() for name in names] == list(FIGURES), "each figure in one section"
