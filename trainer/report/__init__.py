"""`spotune report RUN_DIR`: report.html and its PNGs from a run directory (local or an fsspec URL).

load.py reads the run into typed records, totals.py derives the headline figures (from the
ledger), plots.py draws the PNGs, page.py writes the self-contained page. Importing this
package stays cheap (the CLI imports it for every command): matplotlib and jinja2 load only
when a report is written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.report.load import REPORT_FILE, ReportError


def write_report(run_dir: str | Path, out: Path | None = None) -> tuple[Path, str]:
    """Read `run_dir`, write report.html and the PNGs into `out` (default: beside the run);
    returns the page's path and the plain-text summary. ReportError names a bad `run_dir`."""
    from trainer.report.page import write_report as write

    return write(run_dir, out)


def report_after_train(run_dir: Path, message: Callable[[str], None]) -> Path | None:
    """Write the report at the end of `train`; a failure is a warning, never the run's exit code."""
    try:
        page, _ = write_report(run_dir)
    except Exception as e:  # the adapter and the ledger are already safe; the page is a convenience
        message(f"spotune: warning: no run report ({type(e).__name__}: {e}); try `spotune report {run_dir}`")
        return None
    return page  # train's closing summary names it


__all__ = ["REPORT_FILE", "ReportError", "report_after_train", "write_report"]
