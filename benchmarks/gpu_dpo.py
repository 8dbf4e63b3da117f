"""spotune's DPO step against TRL's DPOTrainer (PEFT, reference = adapters disabled) on the Llama-3.1-8B shape.

One command on a CUDA machine (a few minutes on one H100, no downloads):
    .venv/bin/python benchmarks/gpu_dpo.py --json runs/bench-gpu-dpo.json
`--tiny`: the same code on CPU with a tiny Llama (tests/test_gpu_dpo_bench.py keeps it working).

What it runs, in one process, on the same pairs per optimizer step:
- the Llama-3.1-8B architecture with random bf16 weights (benchmarks/gpu.py's `make_model`), LoRA r16
  on every linear layer, dropout 0, bf16 autocast, beta 0.1, sigmoid loss;
- pairs whose prompt and answer lengths come from the shipped GPTeacher length sample (prompt, then
  its answer as chosen and another row's answer as rejected), random token ids;
- spotune: the pairs packed into rows of `--seq` tokens (chosen and rejected side by side as two
  documents, trainer/data/pairs.py's layout), trainer.model.preference's objective (reference forward
  under no_grad with adapters disabled, then the policy, per-token log-probs through the chunked head),
  loss per pair over the step;
- TRL: DPOTrainer's own `compute_loss` (its collator pads chosen and rejected to the batch's longest,
  its fused LM head, the same disabled-adapter reference) over micro-batches of `--trl-pairs` pairs,
  with the same AdamW; the trainer's own loop is not used, so both sides time the step alone.

For each: pairs/s, real tokens/s (both sequences, padding excluded), step time, peak memory, MFU with
the reference forward counted (trainer/model/flops.py `reference_forward_flops`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu  # noqa: E402
import gpu_hf  # noqa: E402

from trainer import builtin_assets  # noqa: E402
from trainer.config import AdapterConfig, ModelConfig  # noqa: E402
from trainer.data.pack import pack_lengths  # noqa: E402
from trainer.data.template import IGNORE_INDEX  # noqa: E402
from trainer.model import flops  # noqa: E402
from trainer.model.load import build  # noqa: E402
from trainer.model.preference import Preference  # noqa: E402
from trainer.training.batches import to_device  # noqa: E402

Pair = tuple[list[int], list[int], list[int]]  # prompt, chosen answer, rejected answer (token ids)


def make_pairs(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[Pair]:
    """`n` pairs from the shipped length sample, each fitting one row of `seq_len` (both sequences)."""
    sample = json.loads((gpu.CONFIGS / "lengths-gpteacher-roleplay.json").read_text())
    rng = random.Random(seed)
    out: list[Pair] = []
    while len(out) < n:
        i, j = rng.randrange(len(sample["lengths"])), rng.randrange(len(sample["lengths"]))
        prompt = sample["prompt_lengths"][i]
        chosen, rejected = sample["lengths"][i] - prompt, max(1, sample["lengths"][j] - sample["prompt_lengths"][j])
        if 2 * prompt + chosen + rejected <= seq_len and chosen > 0:
            out.append(tuple([rng.randrange(3, vocab) for _ in range(k)] for k in (prompt, chosen, rejected)))  # type: ignore[misc]
    return out


def spotune_micros(pairs: list[Pair], seq_len: int, mbs: int) -> list[dict[str, Any]]:
    """The pairs packed into rows (two documents each, chosen first), as micro-batches of `mbs` rows."""
    bins, _ = pack_lengths([2 * len(p) + len(c) + len(r) for p, c, r in pairs], seq_len)
    rows, per_row = [], []
    for b in bins:
        docs = []
        for k in b:
            prompt, chosen, rejected = pairs[k]
            for answer in (chosen, rejected):
                docs.append((prompt + answer, [IGNORE_INDEX] * len(prompt) + answer))
        rows.append(docs)
        per_row.append(len(b))
    return [gpu.to_micro(rows[at : at + mbs], seq_len, per_row[at : at + mbs]) for at in range(0, len(rows), mbs)]


def run_spotune(path: Path, steps: list[list[Pair]], args: argparse.Namespace) -> list[float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = ModelConfig(name_or_path=str(path), dtype="float32" if args.tiny else "bfloat16")
    model = build(model_cfg, AdapterConfig(r=16, alpha=32, dropout=0.0), device=device, autocast=device.type == "cuda")
    model = model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=device.type == "cuda")
    objective = Preference("dpo", beta=0.1)
    model.train()
    times = []
    for pairs in steps:
        micros = [to_device(m, device) for m in spotune_micros(pairs, args.seq, args.mbs)]
        counts = torch.tensor([0, 0, 0, len(pairs), 1], device=device)
        gpu_hf.sync()
        start = time.perf_counter()
        for micro in micros:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss, _ = objective.loss(model, micro, counts)
            (loss / len(pairs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpu_hf.sync()
        times.append(time.perf_counter() - start)
    del model, opt
    return times


def run_trl(path: Path, steps: list[list[Pair]], args: argparse.Namespace) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if args.tiny else torch.bfloat16)
    # Nothing is tokenised but the stub row below (the pairs are ids already): any tokenizer with a pad token.
    tokenizer = AutoTokenizer.from_pretrained(builtin_assets.build_tokenizer(args.work / "tokenizer"))
    config = DPOConfig(
        output_dir=str(args.work / "trl"),
        beta=0.1,
        bf16=device.type == "cuda",
        use_cpu=device.type != "cuda",
        report_to=[],
        max_length=None,
        gradient_checkpointing=False,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    stub = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # the trainer wants one; unused
    trainer = DPOTrainer(base, args=config, train_dataset=stub, processing_class=tokenizer, peft_config=lora)
    model = trainer.model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=device.type == "cuda")
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id or 0)
    model.train()
    times = []
    for pairs in steps:
        examples = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs]
        batches = [collate(examples[i : i + args.trl_pairs]) for i in range(0, len(examples), args.trl_pairs)]
        batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
        gpu_hf.sync()
        start = time.perf_counter()
        for batch in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = trainer.compute_loss(model, batch)
            (loss * len(batch["input_ids"]) / 2 / len(pairs)).backward()  # TRL's batch mean -> per pair over the step
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpu_hf.sync()
        times.append(time.perf_counter() - start)
    del trainer, model, opt
    return times


def summarise(times: list[float], steps: list[list[Pair]], args: argparse.Namespace, peak: float | None) -> dict:
    from transformers import LlamaConfig

    shape = flops.model_shape(LlamaConfig.from_pretrained(args.work / "model"))
    kept = list(zip(times, steps, strict=True))[args.warmup :]
    seconds = sum(t for t, _ in kept)
    seqs = [s for _, pairs in kept for p, c, r in pairs for s in ((p, c), (p, r))]
    real = sum(len(p) + len(a) for p, a in seqs)
    doc_sq = sum((len(p) + len(a)) ** 2 for p, a in seqs)
    labelled = sum(len(a) for _, a in seqs)
    work = flops.mfu_flops(shape, real, doc_sq, flops.lora_params(shape, 16), head_tokens=labelled)[flops.MFU]
    work += flops.reference_forward_flops(shape, real, doc_sq, labelled)
    return {
        "pairs_per_s": sum(len(pairs) for _, pairs in kept) / seconds,
        "tokens_per_s": real / seconds,
        "step_seconds": seconds / len(kept),
        "mfu": work / seconds / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "first_step_seconds": times[0],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny Llama on CPU, a few steps (CI)")
    ap.add_argument("--model", type=Path, default=gpu.CONFIGS / "llama-3.1-8b.json", help="a Llama config.json")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per side (default 10, tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the figures (default 2, tiny 1)")
    ap.add_argument("--seq", type=int, default=None, help="spotune: tokens per packed row (default 4096, tiny 256)")
    ap.add_argument("--pairs", type=int, default=None, help="pairs per optimizer step (default 32, tiny 6)")
    ap.add_argument("--mbs", type=int, default=1, help="spotune: rows per micro-batch")
    ap.add_argument("--trl-pairs", type=int, default=2, help="TRL: pairs per micro-batch (its per-device batch)")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.seq = args.seq or (256 if args.tiny else 4096)
    args.pairs = args.pairs or (6 if args.tiny else 32)
    with tempfile.TemporaryDirectory(prefix="spotune-bench-dpo-") as tmp:
        args.work = Path(tmp)
        path = gpu.make_model(args.work, args.tiny, args.model)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        pairs = make_pairs(args.steps * args.pairs, args.seq, vocab)
        steps = [pairs[i * args.pairs : (i + 1) * args.pairs] for i in range(args.steps)]
        peak = gpu.metrics.resolve_peak_flops(None, None, torch.device("cuda")) if torch.cuda.is_available() else None
        gpu.free()
        result: dict[str, Any] = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        result["spotune"] = summarise(run_spotune(path, steps, args), steps, args, peak)
        gpu.free()
        result["trl"] = summarise(run_trl(path, steps, args), steps, args, peak)
        gpu.free()
    result["setup"] = {k: str(v) for k, v in vars(args).items() if k != "work"}
    ratio = result["spotune"]["pairs_per_s"] / result["trl"]["pairs_per_s"]
    print(f"pairs/s spotune {result['spotune']['pairs_per_s']:.2f}, TRL DPOTrainer {result['trl']['pairs_per_s']:.2f}")
    print(f"pairs/s ratio spotune / TRL: {ratio:.2f}")
    for side in ("spotune", "trl"):
        mem = result[side]["peak_memory_gib"]
        print(
            f"{side}: step {result[side]['step_seconds']:.3f} s, peak memory {'n/a' if mem is None else f'{mem:.1f} GiB'}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
