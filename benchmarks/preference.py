"""shardlm vs TRL's DPOTrainer on chat preference pairs: the same model, pairs, chat template, beta and DPO loss.

    python benchmarks/preference.py                  # CPU: tiny Qwen2 (4 x 256), seq 256, 4 packed rows, 20 steps
    python benchmarks/preference.py --steps 60 --batch 2 --keep /tmp/dpo-bench

Setup: the random-weight Qwen2 of benchmarks/sft.py (hidden 256, 4 layers, 4 heads, `initializer_range=0.3`), the
GPT-2 tokenizer plus ChatML's `<|im_start|>`/`<|im_end|>`, and sft.py's standard template (Qwen2.5's, with TRL's
generation markers: common.standard_template). TRL scores everything after the prompt's rendering, `<|im_end|>` and
the newline after it included; shardlm scores what instruction tuning trains on the same conversation, which
under its default (`data.answer_end=template`) is the same tokens.
Data: conversational pairs made in the temporary folder from shardlm/assets/chat_tasks train.jsonl / val.jsonl:
`prompt` = the messages before the last assistant turn, `chosen` = [that turn], `rejected` = [a plausible wrong
answer] (digits: one digit off by one; letters: two different characters swapped, or one letter shifted;
deterministic, `random.Random(0)`).

- shardlm: `train.objective=dpo`, `preference.beta`, `data.format=auto` (detects the pairs), `data.packing=true`
  (both sides of a pair in one row, pairs packed best-fit into `--seq`-token rows; each side at most seq/2
  tokens), `train.batch_size=--batch` rows a step; the reference is precomputed once by the initial model.
- TRL: `DPOTrainer` with `DPOConfig(loss_type="sigmoid", beta, precompute_ref_log_probs=True,
  max_length=seq/2 (TRL truncates each sequence, prompt + answer, to it), gradient_checkpointing=False (TRL's
  default is True; shardlm's activation checkpointing is off by default), bf16=False)`;
  `per_device_train_batch_size` = shardlm's mean pairs per step (rounded), so both train on about as many pairs a
  step. TRL 1.16 ignores `padding_free` ("temporarily unavailable since the DPO refactor") and has no packing for
  DPO: each batch is 2 x pairs sequences right-padded to the longest.

Four child processes, one at a time, so each peak RSS (`ru_maxrss`) is its own:
1. `--mode eval` (both): the validation DPO loss of the untrained model over all val pairs (shardlm:
   `Trainer.evaluate()` with `train.eval_batches=0`; TRL: `trainer.evaluate()`); both are ln 2 as policy ==
   reference, so the per-pair answer log-probabilities are compared too: shardlm's precomputed reference
   (`reference-KEY.npy` beside each example cache: (pairs, 2) = chosen, rejected) against TRL's precomputed
   `ref_chosen_logps` / `ref_rejected_logps`, for every train and val pair, and the token ids and prompt length
   of every pair. The time each side takes to precompute its reference (train + val) is reported.
2. `--mode train` (both): `--steps` optimizer steps (same lr, schedule, AdamW betas, clip, seed); both read the
   reference their eval child computed (shardlm its `reference-KEY.npy`, TRL the saved `ref_*_logps` columns in
   place of a second precompute), so neither process pays for it; step times end to end, the first `--warmup`
   left out. Reported: pairs/s, target (answer) tokens/s, real tokens/s (tokens of
   the sequences, no padding), all positions/s (padding included), peak RSS (before the final evaluation), the
   loss of the first and last step, and the validation loss and reward accuracy after training.

The last line of output is one JSON object; `speedup` is shardlm / TRL pairs/s and `memory_ratio` is shardlm peak
RSS / TRL peak RSS of the training processes (the goal on CPU: speedup >= 1.5 at memory_ratio <= 0.7).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
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


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time, all threads): on a shared machine the CPU time is the steadier."""
    return time.perf_counter(), time.process_time()


def make_model(folder: Path, s: dict) -> None:
    """The tiny Qwen2 and its tokenizer (ChatML special tokens, the standard template) saved in `folder`
    (benchmarks/sft.py's)."""
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


# ---- the pairs -------------------------------------------------------------------------------------------------
def wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: a digit off by one, two different characters swapped, or a letter shifted."""
    chars = list(answer)
    digits = [i for i, c in enumerate(chars) if c.isdigit()]
    if digits and len(digits) == len(chars):
        i = rng.choice(digits)
        d = int(chars[i])
        chars[i] = str(d + 1 if d == 0 else d - 1 if d == 9 else d + rng.choice((-1, 1)))
        return "".join(chars)
    swaps = [(i, j) for i in range(len(chars)) for j in range(i + 1, len(chars)) if chars[i] != chars[j]]
    if swaps:
        i, j = rng.choice(swaps)
        chars[i], chars[j] = chars[j], chars[i]
        return "".join(chars)
    i = rng.randrange(len(chars))
    c = chars[i]
    if c.isalpha():
        base = ord("a") if c.islower() else ord("A")
        chars[i] = chr(base + (ord(c) - base + 1) % 26)
    else:
        chars[i] = "x" if c != "x" else "y"
    return "".join(chars)


def make_pairs(src: Path, dst: Path, rng: random.Random, limit: int = 0) -> int:
    """{prompt, chosen, rejected} conversations from {messages} records (the first `limit`; 0 = all): the last
    assistant turn is the answer."""
    n = 0
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            if limit and n >= limit:
                break
            messages = json.loads(line)["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            answer = messages[last]["content"]
            bad = wrong(answer, rng)
            assert bad != answer, answer
            fout.write(json.dumps({"prompt": messages[:last], "chosen": [{"role": "assistant", "content": answer}],
                                   "rejected": [{"role": "assistant", "content": bad}]}) + "\n")
            n += 1
    return n


# ---- shardlm ---------------------------------------------------------------------------------------------------
def shardlm_trainer(s: dict, folder: Path, work: Path, steps: int):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    overrides = example_run_overrides(s, folder, work, steps, [
        f"data.train={work / 'train_pairs.jsonl'}", f"data.val={work / 'val_pairs.jsonl'}", "data.format=auto",
        f"data.packing={str(s['packing']).lower()}", "train.objective=dpo", f"preference.beta={s['beta']}",
        "preference.label_smoothing=0.0"])
    return Trainer.from_config(load_config(None, overrides))


def shardlm_eval(s: dict, folder: Path, work: Path) -> dict:
    import numpy as np

    from shardlm.objectives.preference.pairs import reference_source
    from shardlm.objectives.preference.reference import prepare_reference, reference_key

    trainer = shardlm_trainer(s, folder, work, steps=1)
    began = time.perf_counter()
    # what the first evaluate / step would do
    trainer.objective.reference = prepare_reference(reference_source(trainer))
    reference_s = time.perf_counter() - began
    metrics = trainer.evaluate()
    key = reference_key(trainer.run)
    out = {}
    for split, rows in (("train", trainer.run.train), ("val", trainer.run.val)):
        ex = rows.examples
        ref = np.load(Path(ex.meta["folder"]) / f"reference-{key}.npy")
        np.save(work / f"shardlm_ref_{split}.npy", ref)
        if split == "val":  # ids and prompt length of every val pair
            pairs = []
            for k in range(len(ex)):
                (c, cm), (r, _) = ex.example(2 * k), ex.example(2 * k + 1)
                pairs.append({"chosen": c.tolist(), "rejected": r.tolist(), "prompt_len": int(np.argmax(cm))})
            (work / "shardlm_val_pairs.json").write_text(json.dumps(pairs))
        out[f"{split}_rows"] = len(rows)
        out[f"{split}_pairs"] = len(rows.ids)
        out[f"{split}_mean_pairs_per_row"] = float(np.mean(rows.row_units))
        out[f"{split}_truncated"], out[f"{split}_dropped"] = rows.truncated, rows.dropped
        out[f"{split}_longest_side"] = int(rows.seq_lengths.max())
    return {"val": metrics, "reference_s": reference_s, "reference_file": f"reference-{key}.npy", **out,
            "peak_rss_gb": peak_rss_gb()}


def shardlm_train(s: dict, folder: Path, work: Path) -> dict:
    trainer = shardlm_trainer(s, folder, work, steps=s["steps"])
    train = trainer.run.train
    ends, pairs, targets, real, positions, losses = [now()], [], [], [], [], []
    for _ in range(s["steps"]):
        rows = trainer.sampler.indices(trainer.position, trainer.global_batch)
        real.append(int(sum(int(train.lengths[train.rows[int(r)]].sum()) for r in rows)))
        positions.append(trainer.global_batch * trainer.seq_len if train.packed else
                         trainer.global_batch * max(int(train.lengths[train.rows[int(r)]].sum()) for r in rows))
        targets.append(train.targets(rows))
        out = trainer.train_step()
        losses.append(out["loss_sum"].item() / out["targets"])  # .item() syncs: the step is done; targets = pairs
        pairs.append(out["targets"])
        ends.append(now())
    peak = peak_rss_gb()
    after = trainer.evaluate()
    return {**throughput(s, ends, pairs, targets, real, positions), "first_loss": losses[0], "final_loss": losses[-1],
            "losses": losses, "val_after": {k: after[k] for k in ("loss", "rewards/accuracy", "rewards/margin")},
            "peak_rss_gb": peak, "peak_rss_gb_with_final_eval": peak_rss_gb(), "rows_per_step": trainer.global_batch}


def throughput(s: dict, ends: list[tuple[float, float]], pairs: list[int], targets: list[int], real: list[int],
               positions: list[int]) -> dict:
    """Rates over the steps after the warmup: ends[i + 1] is when step i ended (ends[0]: before the first)."""
    w = s["warmup"]
    n = len(pairs) - w
    seconds, cpu_seconds = ends[-1][0] - ends[w][0], ends[-1][1] - ends[w][1]
    p, t, r, a = sum(pairs[w:]), sum(targets[w:]), sum(real[w:]), sum(positions[w:])
    return {"steps": len(pairs), "timed_steps": n, "seconds": seconds, "pairs_per_s": p / seconds,
            "target_tokens_per_s": t / seconds, "real_tokens_per_s": r / seconds, "all_tokens_per_s": a / seconds,
            "padding_fraction": 1 - r / a, "pairs_per_step": p / n, "real_tokens_per_step": r / n,
            "positions_per_step": a / n,
            "step_s_median": sorted(b[0] - a_[0] for a_, b in pairwise(ends[w:]))[n // 2],
            "cpu_seconds": cpu_seconds, "pairs_per_cpu_s": p / cpu_seconds}


# ---- TRL -------------------------------------------------------------------------------------------------------
def trl_trainer(s: dict, folder: Path, work: Path, steps: int, callbacks=(), counter: dict | None = None,
                timing: dict | None = None, reuse_reference: bool = False):
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    data = load_dataset("json", data_files={"train": str(work / "train_pairs.jsonl"),
                                            "val": str(work / "val_pairs.jsonl")}, cache_dir=str(work / "hf-datasets"))
    args = DPOConfig(
        output_dir=str(work / "trl-run"), loss_type="sigmoid", beta=s["beta"], label_smoothing=0.0,
        precompute_ref_log_probs=True, max_length=s["seq"] // 2, gradient_checkpointing=False,
        per_device_train_batch_size=s["trl_batch"], per_device_eval_batch_size=s["eval_batch"],
        precompute_ref_batch_size=s["eval_batch"], max_steps=steps, learning_rate=s["lr"],
        warmup_steps=s["lr_warmup"], weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1}, seed=s["seed"],
        data_seed=s["seed"], logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
        bf16=False, disable_tqdm=True, dataloader_num_workers=0)

    class Counting(DPOTrainer):
        def _precompute_ref_logps(self, dataset, name, batch_size):
            import numpy as np
            from datasets import Dataset, concatenate_datasets

            saved = work / f"trl_ref_{'val' if name == 'eval' else name}.npy"
            if reuse_reference and saved.is_file():  # the eval child's: shardlm's train child reads its file too
                ref = np.load(saved)
                columns = Dataset.from_dict({"ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]})
                return concatenate_datasets([dataset, columns], axis=1)
            began = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            if timing is not None:
                timing[name] = time.perf_counter() - began
            return out

        def compute_loss(self, model, inputs, *a, **kw):
            if counter is not None and model.training:
                counter["pairs"] += int(inputs["input_ids"].shape[0]) // 2
                counter["targets"] += int(inputs["completion_mask"].sum())
                counter["real"] += int(inputs["attention_mask"].sum())
                counter["positions"] += int(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, *a, **kw)

    return Counting(model=model, args=args, train_dataset=data["train"], eval_dataset=data["val"],
                    processing_class=tok, callbacks=list(callbacks))


def trl_eval(s: dict, folder: Path, work: Path) -> dict:
    import numpy as np

    timing: dict = {}
    began = time.perf_counter()
    trainer = trl_trainer(s, folder, work, steps=1, timing=timing)
    init_s = time.perf_counter() - began
    metrics = trainer.evaluate()
    for split, ds in (("train", trainer.train_dataset), ("val", trainer.eval_dataset)):
        np.save(work / f"trl_ref_{split}.npy",
                np.stack([np.asarray(ds["ref_chosen_logps"]), np.asarray(ds["ref_rejected_logps"])], axis=1))
    val = trainer.eval_dataset
    pairs = [{"chosen": p + c, "rejected": p + r, "prompt_len": len(p)}
             for p, c, r in zip(val["prompt_ids"], val["chosen_ids"], val["rejected_ids"], strict=True)]
    (work / "trl_val_pairs.json").write_text(json.dumps(pairs))
    return {"val": metrics, "reference_s": sum(timing.values()), "reference_s_by_split": timing,
            "init_s_with_tokenization_and_reference": init_s, "train_pairs": len(trainer.train_dataset),
            "val_pairs": len(val), "peak_rss_gb": peak_rss_gb()}


def trl_train(s: dict, folder: Path, work: Path) -> dict:
    from transformers import TrainerCallback

    ends: list[tuple[float, float]] = []
    counter = {"pairs": 0, "targets": 0, "real": 0, "positions": 0}
    seen: list[tuple[int, ...]] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_a, **_kw):
            ends.append(now())

        def on_step_end(self, *_a, **_kw):
            ends.append(now())
            seen.append(tuple(counter.values()))

    trainer = trl_trainer(s, folder, work, s["steps"], callbacks=[Clock()], counter=counter, reuse_reference=True)
    trainer.train()
    peak = peak_rss_gb()
    per_step = [[b[i] - a[i] for a, b in pairwise([(0, 0, 0, 0), *seen])] for i in range(4)]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = trainer.evaluate()
    return {**throughput(s, ends, *per_step), "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
            "val_after": {k: after.get(f"eval_{k}") for k in ("loss", "rewards/accuracies", "rewards/margins")},
            "peak_rss_gb": peak, "peak_rss_gb_with_final_eval": peak_rss_gb(), "rows_per_step": 2 * s["trl_batch"]}


# ---- the comparison --------------------------------------------------------------------------------------------
def compare(work: Path) -> dict:
    """Per-pair reference log-probabilities (train and val) and the val pairs' ids, shardlm's against TRL's."""
    import numpy as np

    out: dict = {}
    for split in ("train", "val"):
        a, b = np.load(work / f"shardlm_ref_{split}.npy"), np.load(work / f"trl_ref_{split}.npy")
        if a.shape != b.shape:
            out[split] = {"shapes": [list(a.shape), list(b.shape)]}
            continue
        diff = np.abs(a - b)
        rel = diff / np.maximum(np.abs(b), 1e-12)
        k = int(np.argmax(rel.max(1)))
        out[split] = {"pairs": len(a), "max_abs_diff": float(diff.max()), "max_rel_diff": float(rel.max()),
                      "mean_abs_diff": float(diff.mean()), "agree_1e-4_rel": bool(rel.max() <= 1e-4),
                      "worst_pair": {"index": k, "shardlm": a[k].tolist(), "trl": b[k].tolist()},
                      "mean_logp": {"shardlm": a.mean(0).tolist(), "trl": b.mean(0).tolist()}}
    ours = json.loads((work / "shardlm_val_pairs.json").read_text())
    theirs = json.loads((work / "trl_val_pairs.json").read_text())
    same = sum(x == y for x, y in zip(ours, theirs, strict=False))
    first = next((k for k, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
    out["val_ids"] = {"pairs": [len(ours), len(theirs)], "same_ids_and_prompt_len": same, "first_difference":
                      None if first is None else {"pair": first, "shardlm": ours[first], "trl": theirs[first]}}
    return out


def launch(side: str, mode: str, s: dict, work: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--mode", mode, "--work", str(work),
           "--settings", json.dumps(s)]
    threads = {"OMP_NUM_THREADS": str(s["threads"])} if s["threads"] else {}
    env = {**os.environ, **threads, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "SHARDLM_CACHE": str(work / "shardlm-cache"), "TQDM_DISABLE": "1"}
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{side} {mode} failed: {tail(proc)}")
    print(f"{side} {mode}: {time.perf_counter() - began:.0f}s", file=sys.stderr, flush=True)
    return {**rows[0], "process_s": time.perf_counter() - began}


def settings(args) -> dict:
    return {"model": {"family": "qwen2", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                      "intermediate": args.intermediate, "initializer_range": 0.3, "tied_embeddings": True},
            "seq": args.seq, "batch": args.batch, "train_pairs": args.train_pairs, "packing": not args.no_packing,
            "trl_batch": args.trl_batch, "eval_batch": args.eval_batch, "threads": args.threads,
            "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
            "lr_warmup": args.lr_warmup, "seed": args.seed, "beta": args.beta, "loss": "dpo (TRL sigmoid)",
            "precision": "fp32", "attention": "sdpa"}


def machine(threads: int) -> dict:
    import torch
    import transformers
    import trl

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
            "load_average_at_end": list(os.getloadavg()), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=["shardlm", "trl"])
    p.add_argument("--mode", choices=["eval", "train"])
    p.add_argument("--work", help="(children) the benchmark's temporary folder")
    p.add_argument("--settings", help="(children) the settings as JSON")
    p.add_argument("--keep", help="make the temporary folder here and keep it (model, pairs, runs)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--train-pairs", type=int, default=400,
                   help="pairs made from the first N conversations of train.jsonl (0 = all 6,000): both sides score "
                        "every training pair with the initial model before the first step")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    p.add_argument("--batch", type=int, default=4, help="shardlm: rows of --seq tokens per optimizer step")
    p.add_argument("--no-packing", action="store_true", help="shardlm: one pair per row (data.packing=false)")
    p.add_argument("--trl-batch", type=int, default=0,
                   help="TRL pairs per step; 0 = shardlm's mean pairs per step over the training set, rounded")
    p.add_argument("--eval-batch", type=int, default=50, help="TRL: pairs per eval / reference batch")
    p.add_argument("--seq", type=int, default=256, help="shardlm row length; each side of a pair <= seq/2 (TRL's "
                                                         "max_length)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=5, help="linear learning-rate warmup steps (both)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in every child (0: torch's default, one per core); 1 gives per-core rates that "
                        "a busy machine disturbs least")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.side:
        work = Path(args.work)
        s = json.loads(args.settings)
        if s["threads"]:
            import torch

            torch.set_num_threads(s["threads"])
        run = {("shardlm", "eval"): shardlm_eval, ("shardlm", "train"): shardlm_train,
               ("trl", "eval"): trl_eval, ("trl", "train"): trl_train}[args.side, args.mode]
        print("RESULT " + json.dumps(run(s, work / "model", work)), flush=True)
        return
    s = settings(args)
    began, load_start = time.perf_counter(), list(os.getloadavg())
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shardlm-dpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        make_model(work / "model", s)
        rng = random.Random(0)
        counts = {split: make_pairs(DATA / f"{split}.jsonl", work / f"{split}_pairs.jsonl", rng,
                                    args.train_pairs if split == "train" else 0) for split in ("train", "val")}
        ours_eval = launch("shardlm", "eval", s, work)
        if not s["trl_batch"]:
            per_step = s["batch"] * (ours_eval["train_mean_pairs_per_row"] if s["packing"] else 1)
            s["trl_batch"] = max(1, round(per_step))
        theirs_eval = launch("trl", "eval", s, work)
        agreement = compare(work)
        ours, theirs = launch("shardlm", "train", s, work), launch("trl", "train", s, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    loss_diff = abs(ours_eval["val"]["loss"] - theirs_eval["val"]["eval_loss"])
    logp_diff = abs(ours_eval["val"]["logps/chosen"] - theirs_eval["val"]["eval_logps/chosen"])
    print(json.dumps({
        "benchmark": "preference (dpo)", "date": datetime.date.today().isoformat(), "machine": machine(s["threads"]),
        "command": " ".join(["python", "benchmarks/preference.py", *sys.argv[1:]]), "settings": s,
        "data": {"train": "pairs from shardlm/assets/chat_tasks/train.jsonl", "val": "... val.jsonl",
                 "pairs": counts,
                 "chat_template": "Qwen2.5's with TRL's generation markers (trl/chat_templates/"
                                  "qwen2_5_training.jinja), both sides",
                 "rejected": "digit off by one / two characters swapped / a letter shifted, random.Random(0)"},
        "val_before_training": {"shardlm": ours_eval, "trl": theirs_eval, "loss_abs_diff": loss_diff,
                                "loss_agree_1e-4": loss_diff <= 1e-4, "mean_chosen_logp_abs_diff": logp_diff},
        "reference_logps": agreement,
        "train": {"shardlm": ours, "trl": theirs},
        "speedup": ours["pairs_per_s"] / theirs["pairs_per_s"],
        "speedup_real_tokens": ours["real_tokens_per_s"] / theirs["real_tokens_per_s"],
        "speedup_cpu_time": ours["pairs_per_cpu_s"] / theirs["pairs_per_cpu_s"],
        "memory_ratio": ours["peak_rss_gb"] / theirs["peak_rss_gb"],
        "reference_precompute_s": {"shardlm": ours_eval["reference_s"], "trl": theirs_eval["reference_s"]},
        "wall_s": time.perf_counter() - began, "load_average_at_start": load_start,
    }))


if __name__ == "__main__":
    main()
