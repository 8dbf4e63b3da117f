"""How progress reaches a person: a bar on a terminal, plain lines in a log file.

A scheduler (Slurm, Kubernetes, SkyPilot, nohup) captures stderr into a file, where a tqdm
bar is one ever-growing line of carriage returns. So where stderr is not a terminal, progress
is written as whole lines, one every `LINE_SECONDS` at most. Used by the training console
(trainer/training/console.py), model downloads (trainer/model/load.py) and datasets' bars (prepare,
the estimate's sample), so it imports nothing of trainer/.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

LINE_SECONDS = 5.0
"""A download's progress line at most this often (tqdm's `mininterval`) when stderr is a file."""

LINE_FORMAT = "{desc}: {percentage:.0f}% {n_fmt}/{total_fmt} at {rate_fmt}, ETA {remaining}"
"""tqdm's `bar_format` for a progress line: no bar glyphs, which a log file shows as noise."""


def is_terminal(stream: IO[str] | None = None) -> bool:
    """Whether `stream` (stderr by default, where progress goes) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Lines:
    """A file for tqdm that turns its redraws ("\\r" + the bar) into whole lines."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        out = sys.stderr if self.stream is None else self.stream  # read late: pytest swaps stderr
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                out.write(part.strip() + "\n")
        out.flush()
        return len(text)

    def flush(self) -> None:
        (sys.stderr if self.stream is None else self.stream).flush()

    def isatty(self) -> bool:  # tqdm would disable itself on a file it thinks is not a terminal
        return True


def hub_download_bar(stream: IO[str] | None = None) -> type[Any]:
    """The tqdm class for huggingface_hub downloads (`tqdm_class=` of `from_pretrained`): the
    hub's own bar on a terminal, else the same class writing a line every `LINE_SECONDS`.
    It subclasses the hub's tqdm, so HF_HUB_DISABLE_PROGRESS_BARS and the hub's group switches
    still apply."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    if is_terminal(stream):
        return hub_tqdm

    class LineBar(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("disable") is None:  # None is tqdm's "off unless a terminal"
                kwargs["disable"] = False
            kwargs.update(file=Lines(stream), mininterval=LINE_SECONDS, bar_format=LINE_FORMAT, dynamic_ncols=False)
            super().__init__(*args, **kwargs)

    return LineBar


@contextmanager
def datasets_bars(enabled: bool) -> Iterator[None]:
    """datasets' progress bars follow a global switch: set it for this call, then restore it (`prepare`
    shows them when asked; the estimate's sample never does)."""
    from datasets.utils import logging as datasets_logging

    was = datasets_logging.is_progress_bar_enabled()
    (datasets_logging.enable_progress_bar if enabled else datasets_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (datasets_logging.enable_progress_bar if was else datasets_logging.disable_progress_bar)()
