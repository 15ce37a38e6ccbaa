"""shardlm vs TRL's SFTTrainer on chat examples: the same model, data, chat template, answers-only loss and packing.

    python benchmarks/sft.py --threads 1             # CPU: tiny Qwen2 (4 x 256), seq 256, 4 rows a step, 30 steps
    python benchmarks/sft.py --steps 60 --seq 512 --batch 2 --keep /tmp/sft-bench

Setup: a random-weight Qwen2 (hidden 256, 4 layers, 4 heads, `initializer_range=0.3` so that a wrong mask shows
in the loss) saved with the GPT-2 tokenizer plus ChatML's `<|im_start|>`/`<|im_end|>` (EOS `<|im_end|>`, pad
`<|endoftext|>`) and a standard template: Qwen2.5's (ChatML with a default system message) with the
`{% generation %}` markers TRL ships for it (common.standard_template: its blocks hold the line break after
`<|im_start|>assistant`, the answer, `<|im_end|>` and the newline after it). Data: shardlm/assets/chat_tasks
train.jsonl / val.jsonl (`{"messages": [...]}`).

- shardlm: `model.name=FOLDER` (its tokenizer and template), `data.packing=true`, its defaults otherwise
  (answers-only loss, `data.answer_end=template`: the template's generation blocks are the targets).
- TRL: `SFTTrainer` on the same folder with `assistant_only_loss=True` and `packing=True` (default BFD strategy,
  so padding-free), its defaults otherwise: transformers' `return_assistant_tokens_mask` of the same template.

Four child processes, one at a time, so each peak RSS (`ru_maxrss`) is its own:
1. `--side X --mode eval` (both): the validation loss of the untrained model, the mean over every target token
   of val.jsonl (shardlm: `Trainer.evaluate()` with `train.eval_batches=0`; TRL: `trainer.evaluate()` with one
   eval batch holding the whole packed val set, and the same recomputed over its collated rows one by one). Each
   also writes every val example's ids and target mask: the parent compares them example by example.
2. `--side X --mode train` (both): `--steps` optimizer steps of `--batch` packed rows of `--seq` tokens (same lr,
   AdamW betas, clip, seed). Step times are taken end to end (batch loading included); the first `--warmup`
   steps are left out. Reported: target tokens/s, real tokens/s (example tokens, no padding), all positions/s
   (what the model computes on, padding included), padding fraction, peak RSS.

The last line of output is one JSON object; `speedup` is shardlm / TRL target tokens/s and `memory_ratio` is
shardlm peak RSS / TRL peak RSS (the goal on CPU: speedup >= 1.5 at memory_ratio <= 0.7).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from common import ROOT, cpu_name, example_run_overrides, standard_template, tail

DATA = ROOT / "shardlm" / "assets" / "chat_tasks"
GPT2 = ROOT / "shardlm" / "assets" / "gpt2-tokenizer"


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def make_model(folder: Path, s: dict) -> None:
    """The tiny Qwen2 and its tokenizer (ChatML special tokens, the standard template) saved in `folder`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(GPT2))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = standard_template()
    m = s["model"]
    config = Qwen2Config(vocab_size=len(tok), hidden_size=m["hidden"], num_hidden_layers=m["layers"],
                         num_attention_heads=m["heads"], num_key_value_heads=m["heads"],
                         intermediate_size=m["intermediate"], max_position_embeddings=s["seq"],
                         initializer_range=0.3, tie_word_embeddings=True, use_cache=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(s["seed"])
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


# ---- shardlm ---------------------------------------------------------------------------------------------------
def shardlm_trainer(s: dict, folder: Path, work: Path, steps: int):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    overrides = example_run_overrides(s, folder, work, steps, [
        f"data.train={DATA / 'train.jsonl'}", f"data.val={DATA / 'val.jsonl'}", "data.format=auto",
        "data.packing=true"])
    return Trainer.from_config(load_config(None, overrides))


def shardlm_eval(s: dict, folder: Path, work: Path) -> dict:
    import numpy as np

    trainer = shardlm_trainer(s, folder, work, steps=1)
    metrics = trainer.evaluate()
    val = trainer.run.val
    examples = []
    for k in range(len(val.examples)):
        ids, mask = val.examples.example(k)
        examples.append({"ids": ids.tolist(), "mask": np.asarray(mask, dtype=int).tolist()})
    (work / "shardlm_examples.json").write_text(json.dumps(examples))
    return {"val_loss": metrics["loss"], "val_targets": metrics["tokens"], "val_rows": len(val),
            "val_examples": len(val.ids), "peak_rss_gb": peak_rss_gb()}


def shardlm_train(s: dict, folder: Path, work: Path) -> dict:
    import numpy as np

    trainer = shardlm_trainer(s, folder, work, steps=s["steps"])
    train = trainer.run.train
    ends, targets, real, positions, losses = [now()], [], [], [], []
    for _ in range(s["steps"]):
        rows = trainer.sampler.indices(trainer.position, trainer.global_batch)
        real.append(int(sum(int(train.lengths[train.rows[int(r)]].sum()) for r in rows)))
        positions.append(trainer.global_batch * trainer.seq_len)
        out = trainer.train_step()
        losses.append(out["loss_sum"].item() / out["targets"])  # .item() syncs: the step is done
        targets.append(out["targets"])
        ends.append(now())
    return {**throughput(s, ends, targets, real, positions), "first_loss": losses[0], "final_loss": losses[-1],
            "train_rows": len(train), "padding_fraction_train_set": 1 - train.positions_used / (len(train) * s["seq"]),
            "peak_rss_gb": peak_rss_gb(), "rows_per_step": trainer.global_batch,
            "mean_examples_per_row": float(np.mean([len(r) for r in train.rows]))}


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time, all threads): on a shared machine the CPU time is the steadier."""
    return time.perf_counter(), time.process_time()


def throughput(s: dict, ends: list[tuple[float, float]], targets: list[int], real: list[int],
               positions: list[int]) -> dict:
    """Rates over the steps after the warmup: ends[i + 1] is when step i ended (ends[0]: before the first)."""
    w = s["warmup"]
    seconds, cpu_seconds = ends[-1][0] - ends[w][0], ends[-1][1] - ends[w][1]
    t, r, p = sum(targets[w:]), sum(real[w:]), sum(positions[w:])
    return {"steps": len(targets), "timed_steps": len(targets) - w, "seconds": seconds,
            "target_tokens_per_s": t / seconds, "real_tokens_per_s": r / seconds, "all_tokens_per_s": p / seconds,
            "padding_fraction": 1 - r / p, "target_tokens_per_step": t / (len(targets) - w),
            "real_tokens_per_step": r / (len(targets) - w), "positions_per_step": p / (len(targets) - w),
            "step_s_median": sorted(b[0] - a[0] for a, b in pairwise(ends[w:]))[(len(targets) - w) // 2],
            "cpu_seconds": cpu_seconds, "target_tokens_per_cpu_s": t / cpu_seconds}


# ---- TRL -------------------------------------------------------------------------------------------------------
def trl_trainer(s: dict, folder: Path, work: Path, steps: int, callbacks=(), counter: dict | None = None):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(folder)  # the folder's template, generation markers included
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    data = load_dataset("json", data_files={"train": str(DATA / "train.jsonl"), "val": str(DATA / "val.jsonl")},
                        cache_dir=str(work / "hf-datasets"))
    args = SFTConfig(
        output_dir=str(work / "trl-run"), assistant_only_loss=True, packing=True, max_length=s["seq"],
        per_device_train_batch_size=s["batch"], per_device_eval_batch_size=100_000,  # one eval batch: the whole set
        max_steps=steps, learning_rate=s["lr"], warmup_steps=s["lr_warmup"], weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1}, seed=s["seed"], data_seed=s["seed"], logging_steps=10,
        save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
        dataloader_num_workers=0)

    class Counting(SFTTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if counter is not None and model.training:
                counter["targets"] += int((inputs["labels"][:, 1:] != -100).sum())
                counter["real"] += int(inputs["input_ids"].numel())  # padding-free: one row, no padding
            return super().compute_loss(model, inputs, *a, **kw)

    return Counting(model=model, args=args, train_dataset=data["train"], eval_dataset=data["val"],
                    processing_class=tok, callbacks=list(callbacks))


def trl_eval(s: dict, folder: Path, work: Path) -> dict:
    import torch

    trainer = trl_trainer(s, folder, work, steps=1)
    val = trainer.eval_dataset
    metrics = trainer.evaluate()
    # the same loss recomputed from the collated rows one at a time: sum of -log p over targets / their count
    model, total, count = trainer.model.eval(), 0.0, 0
    with torch.no_grad():
        for i in range(len(val)):
            batch = trainer.data_collator([val[i]])
            out = model(**batch, fused_lm_head=True)
            total += float(-out.log_probs.double().sum())
            count += int(out.label_mask.sum())
    examples = []
    for row in val:
        at = 0
        for n in row["seq_lengths"]:
            ids, labels = row["input_ids"][at:at + n], row["labels"][at:at + n]
            examples.append({"ids": ids, "mask": [int(x != -100) for x in labels]})
            at += n
    (work / "trl_examples.json").write_text(json.dumps(examples))
    return {"val_loss": metrics["eval_loss"], "val_loss_rowwise": total / count, "val_targets": count,
            "val_rows": len(val), "val_examples": len(examples), "peak_rss_gb": peak_rss_gb()}


def trl_train(s: dict, folder: Path, work: Path) -> dict:
    from transformers import TrainerCallback

    ends: list[tuple[float, float]] = []
    counter = {"targets": 0, "real": 0}
    seen: list[tuple[int, int]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_a, **_kw):
            ends.append(now())

        def on_step_end(self, *_a, **_kw):
            ends.append(now())
            seen.append((counter["targets"], counter["real"]))

    trainer = trl_trainer(s, folder, work, s["steps"], callbacks=[Clock()], counter=counter)
    result = trainer.train()
    targets = [b[0] - a[0] for a, b in pairwise([(0, 0), *seen])]
    real = [b[1] - a[1] for a, b in pairwise([(0, 0), *seen])]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    train = trainer.train_dataset
    lengths = [sum(x) for x in train["seq_lengths"]]
    return {**throughput(s, ends, targets, real, real), "first_logged_loss": losses[0] if losses else None,
            "final_logged_loss": losses[-1] if losses else None, "train_loss": result.training_loss,
            "train_rows": len(train), "padding_fraction_train_set": 0.0,
            "mean_row_fill": sum(lengths) / (len(lengths) * s["seq"]), "peak_rss_gb": peak_rss_gb(),
            "rows_per_step": s["batch"],
            "mean_examples_per_row": sum(len(x) for x in train["seq_lengths"]) / len(train)}


# ---- the comparison --------------------------------------------------------------------------------------------
def compare_examples(work: Path) -> dict:
    """Every val example's ids and target mask, shardlm's against TRL's (TRL's are in BFD order: matched by ids).
    A target is token i >= 1 with mask 1 (the first token of an example is never a target on either side)."""
    ours = json.loads((work / "shardlm_examples.json").read_text())
    theirs: dict[tuple, list[list[int]]] = {}
    for e in json.loads((work / "trl_examples.json").read_text()):
        theirs.setdefault(tuple(e["ids"]), []).append(e["mask"])
    same_ids = same_mask = 0
    first_diff = None
    for k, e in enumerate(ours):
        masks = theirs.get(tuple(e["ids"]))
        if not masks:
            first_diff = first_diff or {"example": k, "why": "ids", "shardlm_ids": e["ids"]}
            continue
        same_ids += 1
        if e["mask"][1:] in [m[1:] for m in masks]:
            same_mask += 1
        else:
            first_diff = first_diff or {"example": k, "why": "mask", "ids": e["ids"], "shardlm_mask": e["mask"],
                                        "trl_mask": masks[0]}
    first = ours[0]
    return {"examples": len(ours), "same_ids": same_ids, "same_target_mask": same_mask, "first_difference": first_diff,
            "first_example": {"ids": first["ids"], "shardlm_mask": first["mask"],
                              "trl_mask": (theirs.get(tuple(first["ids"])) or [None])[0]}}


def launch(side: str, mode: str, args, work: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--mode", mode, "--work", str(work),
           *[x for k, v in vars(args).items() if k in FLAGS for x in (f"--{k.replace('_', '-')}", str(v))]]
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    env = {**os.environ, **threads, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "SHARDLM_CACHE": str(work / "shardlm-cache")}
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{side} {mode} failed: {tail(proc)}")
    print(f"{side} {mode}: {time.perf_counter() - began:.0f}s", file=sys.stderr, flush=True)
    return rows[0]


FLAGS = ("steps", "warmup", "batch", "seq", "lr", "lr_warmup", "seed", "hidden", "layers", "heads", "intermediate",
         "threads")


def settings(args) -> dict:
    return {"model": {"family": "qwen2", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                      "intermediate": args.intermediate, "initializer_range": 0.3, "tied_embeddings": True},
            "seq": args.seq, "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "lr_warmup": args.lr_warmup, "seed": args.seed, "threads": args.threads, "precision": "fp32",
            "attention": "sdpa"}


def machine(threads: int) -> dict:
    import torch
    import transformers
    import trl

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
            "load_average_1m_at_end": os.getloadavg()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=["shardlm", "trl"])
    p.add_argument("--mode", choices=["eval", "train"])
    p.add_argument("--work", help="(children) the benchmark's temporary folder")
    p.add_argument("--keep", help="make the temporary folder here and keep it (model, examples, runs)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    p.add_argument("--batch", type=int, default=4, help="packed rows per optimizer step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=5, help="linear learning-rate warmup steps (both)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in every child (0: torch's default, one per core); 1 gives per-core rates that "
                        "a busy machine disturbs least")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    s = settings(args)
    if args.side:
        work = Path(args.work)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        run = {("shardlm", "eval"): shardlm_eval, ("shardlm", "train"): shardlm_train,
               ("trl", "eval"): trl_eval, ("trl", "train"): trl_train}[args.side, args.mode]
        print("RESULT " + json.dumps(run(s, work / "model", work)), flush=True)
        return
    began, load_start = time.perf_counter(), os.getloadavg()[0]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardlm-sft-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        make_model(work / "model", s)
        ours_eval, theirs_eval = launch("shardlm", "eval", args, work), launch("trl", "eval", args, work)
        examples = compare_examples(work)
        ours, theirs = launch("shardlm", "train", args, work), launch("trl", "train", args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    diff = abs(ours_eval["val_loss"] - theirs_eval["val_loss"])
    print(json.dumps({
        "benchmark": "sft", "date": datetime.date.today().isoformat(), "machine": machine(args.threads),
        "command": " ".join(["python", "benchmarks/sft.py", *sys.argv[1:]]), "settings": s,
        "data": {"train": "shardlm/assets/chat_tasks/train.jsonl", "val": "shardlm/assets/chat_tasks/val.jsonl",
                 "chat_template": "Qwen2.5's with TRL's generation markers (trl/chat_templates/"
                                  "qwen2_5_training.jinja), both sides"},
        "val_before_training": {"shardlm": ours_eval, "trl": theirs_eval, "abs_diff": diff, "agree_1e-4": diff <= 1e-4,
                                "targets_equal": ours_eval["val_targets"] == theirs_eval["val_targets"],
                                "examples": examples},
        "train": {"shardlm": ours, "trl": theirs},
        "speedup": ours["target_tokens_per_s"] / theirs["target_tokens_per_s"],
        "speedup_real_tokens": ours["real_tokens_per_s"] / theirs["real_tokens_per_s"],
        "speedup_cpu_time": ours["target_tokens_per_cpu_s"] / theirs["target_tokens_per_cpu_s"],
        "memory_ratio": ours["peak_rss_gb"] / theirs["peak_rss_gb"],
        "wall_s": time.perf_counter() - began, "load_average_1m_at_start": load_start,
    }))


if __name__ == "__main__":
    main()
