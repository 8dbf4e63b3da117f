"""Packing efficiency and prepare throughput on real SFT data (not a timed test).

Reads gpteacher-roleplay.json (alpaca layout, 3,146 examples) with the Llama 2 tokenizer
(llama2-tokenizer/), both from the data folder beside the repository (`DATA` and `TOKENIZER`
below), and never copies them. For seq_len 1024, 2048 and 4096 it prints:
- packing efficiency (real tokens / rows x seq_len) of the prepared dataset, of the lower
  bound (ceil(tokens / seq_len) rows), of plain best-fit-decreasing, and of the baseline:
  random batches of 8 padded to their longest;
- rows, and the ratio packed / baseline efficiency (= baseline padded tokens / packed tokens);
- cold prepare throughput (fresh cache dir, libraries already imported) in examples per second,
  and the time of a warm (reused) prepare;
- the cost of packing to the bound: cold prepare time / the same prepare had it stopped at the
  greedy packers (best-fit-decreasing and exact-fill), from the packers' own timings.

Run: .venv/bin/python benchmarks/packing.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import DataConfig  # noqa: E402
from trainer.data import prepare  # noqa: E402
from trainer.data.pack import best_fit_decreasing, fill_exact_decreasing, lower_bound_rows, pack_lengths  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "gpteacher-roleplay.json"
TOKENIZER = REPO.parent / "shared" / "data" / "llama2-tokenizer"
BATCH = 8
SEQ_LENS = (1024, 2048, 4096)


def _doc_lengths(train_path: Path) -> np.ndarray:
    """Document lengths recovered from the packed rows (a document starts where position_ids is 0)."""
    ds = datasets.load_from_disk(str(train_path)).with_format("numpy")
    pos, real = ds["position_ids"], ds["num_real"]
    lengths: list[int] = []
    for p, n in zip(pos, real, strict=False):
        starts = np.flatnonzero(p[:n] == 0)
        lengths.extend(np.diff(np.append(starts, n)).tolist())
    return np.asarray(lengths)


def main() -> int:
    for path in (DATA, TOKENIZER):
        if not path.exists():
            print(
                f"benchmarks/packing.py: {path} is absent; this benchmark needs gpteacher-roleplay.json "
                f"and llama2-tokenizer/ in {DATA.parent}.",
                file=sys.stderr,
            )
            return 2
    datasets.utils.logging.disable_progress_bar()
    # Import the heavy libraries first so "cold" measures a cleared cache, not interpreter start-up.
    import matplotlib.pyplot  # noqa: F401
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(TOKENIZER))
    print(
        f"data: {DATA.name}; tokenizer: {TOKENIZER.name}; baseline: random batches of {BATCH} padded to their longest"
    )
    # ratio = packed / baseline efficiency = baseline padded tokens / packed tokens for the same data
    header = (
        f"{'seq_len':>7} {'rows':>5} {'packed':>8} {'bound':>8} {'BFD only':>9} {'baseline':>9} {'ratio':>6} "
        f"{'cold ex/s':>9} {'warm s':>7} {'prep x':>6}"
    )
    print(header)
    for seq_len in SEQ_LENS:
        cfg = DataConfig(path=str(DATA), seq_len=seq_len, chat_template="alpaca")  # a base tokenizer: no template
        with tempfile.TemporaryDirectory() as cache:
            t = time.perf_counter()
            p = prepare(cfg, str(TOKENIZER), Path(cache), progress=False)
            cold = time.perf_counter() - t
            t = time.perf_counter()
            again = prepare(cfg, str(TOKENIZER), Path(cache), progress=False)
            warm = time.perf_counter() - t
            assert again.reused
            st = p.manifest["train"]
            lens = _doc_lengths(p.train_path)
        assert lens.sum() == st["real_tokens"] and lens.size == st["examples_out"]
        bfd_rows = len(best_fit_decreasing(lens, seq_len))
        bfd_eff = lens.sum() / (bfd_rows * seq_len)
        bound = lower_bound_rows(lens, seq_len)
        base = st["baseline"]["efficiency"]
        eff = st["packing_efficiency"]
        # What packing to the bound adds to prepare: pack_lengths against the greedy packers alone.
        t = time.perf_counter()
        pack_lengths(lens, seq_len)
        t_pack = time.perf_counter() - t
        t = time.perf_counter()
        best_fit_decreasing(lens, seq_len)
        fill_exact_decreasing(lens, seq_len)
        t_greedy = time.perf_counter() - t
        slowdown = cold / max(cold - t_pack + t_greedy, 1e-9)
        print(
            f"{seq_len:>7} {st['rows']:>5} {eff:>8.2%} {lens.sum() / (bound * seq_len):>8.2%} {bfd_eff:>9.2%} "
            f"{base:>9.2%} {eff / base:>5.2f}x {st['examples_in'] / cold:>9.0f} {warm:>7.2f} {slowdown:>5.2f}x"
        )
        print(
            f"{'':>7} algorithm={st['packing_algorithm']}, BFD rows={bfd_rows}, lower bound rows={bound}, "
            f"truncated={st['truncated']}, cold prepare {cold:.2f}s for {st['examples_in']} examples, "
            f"packing {t_pack:.2f}s (greedy packers alone {t_greedy:.2f}s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
