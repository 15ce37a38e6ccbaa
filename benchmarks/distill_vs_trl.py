"""shardlm's distillation step vs TRL 1.16's GKDTrainer (off-policy) on CPU: the same teacher/student pair and data.

    python benchmarks/distill_vs_trl.py                       # 6x192 teacher, 2x192 student, 320 examples, 1 thread
    python benchmarks/distill_vs_trl.py --teacher runs/chat_teacher-hf --examples 640

Setup: two GPT-2s over shardlm's byte tokenizer with ChatML (259 tokens, chat_tiny's), saved as Hugging Face
folders: the teacher (`--teacher`: an exported run such as `runs/chat_teacher-hf`, else a random 6 x 192 one) and a
random 2 x 192 student (chat_tiny with 2 layers, the demo's). Data: the first `--examples` conversations of
shardlm/assets/chat_tasks/train.jsonl (`{"messages": [...]}`), the answers the targets on both sides (the last
assistant turn with the template's closing `<|im_end|>` and newline).

- shardlm: `shardlm train`'s loop (`Trainer.train_step`, train.objective=distill, distill.beta 0.5,
  temperature 1, alpha 1: the JSD alone, the live teacher, on_policy 0), its defaults otherwise: the examples
  packed into 256-token rows (`--rows` a step), the chunked loss (no full logits of either model for the batch).
- TRL: `trl.experimental.gkd.GKDTrainer` with `lmbda=0` (every step on the data: off-policy), beta 0.5, its
  defaults otherwise (DataCollatorForChatML: each example its own row, left-padded to the batch's longest;
  `generalized_jsd_loss` on the full logits of both models; its loss takes temperature 1, GKDConfig's temperature
  being the sampling one), `--examples-per-step` examples a step (the examples `--rows` packed rows hold, about),
  `gradient_checkpointing=False` and `bf16=False` (SFTConfig's defaults are True; shardlm runs fp32 without
  activation checkpointing, so both sides do the same work).
Both: about one epoch over the same examples (shardlm: ceil(rows / --rows) steps, so a row may come twice; each side
counts the targets it trained on), AdamW (lr `--lr`, betas 0.9/0.999, no decay, clip 1, constant), fp32, one
process, `--threads` torch threads; the first step is left out of the rates (warm-up). Rates: target tokens
(answer tokens trained on) per second, wall clock and per CPU-second (the steadier on a shared machine).

Three child processes, one at a time, so each peak RSS (`ru_maxrss`) is its own: `shardlm`, `trl`, then `loss`:
the same inputs to both, shardlm's `Trainer` with `data.packing=false` (each example its own right-padded row, which
a plain Hugging Face forward reads exactly) takes its first step; TRL's `compute_loss` on the same rows
(labels = the targets, shifted as TRL shifts them), both untrained. TRL's loss is a per-target mean (batchmean
over the answer tokens), and shardlm's `distill/loss` record is its JSD per target: the two are compared.

The last line of output is one JSON object; `speedup` is shardlm / TRL target tokens per second (wall clock) and
`memory_ratio` shardlm / TRL peak RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, launch_side, now, peak_rss_gb, rss_gb, trl_machine

DATA = ROOT / "shardlm" / "assets" / "chat_tasks" / "train.jsonl"
TEACHER = {"n_layer": 6, "n_head": 4, "n_embd": 192}
STUDENT = {"n_layer": 2, "n_head": 4, "n_embd": 192}


def make_model(folder: Path, shape: dict, seed: int) -> None:
    """A random GPT-2 of `shape` over the byte tokenizer with ChatML (chat_tiny's), saved with its tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.tokenizer import byte_tokenizer, set_chat_template

    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tok), n_positions=256, bos_token_id=tok.eos_token_id,
                        eos_token_id=tok.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def write_data(s: dict, work: Path) -> None:
    with open(DATA) as f:
        lines = [next(f) for _ in range(s["examples"])]
    (work / "train.jsonl").write_text("".join(lines))


# ---- shardlm ---------------------------------------------------------------------------------------------------
def shardlm_trainer(s: dict, work: Path, extra: list[str]):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    return Trainer.from_config(load_config(None, [
        f"model.name={s['student']}", "model.dropout=0.0", f"data.train={work / 'train.jsonl'}",
        f"data.val={work / 'train.jsonl'}", f"data.cache_dir={work / 'shardlm-cache'}", f"data.seq_len={s['seq']}",
        "train.objective=distill", f"distill.teacher={s['teacher']}", f"distill.beta={s['beta']}",
        "distill.temperature=1.0", "distill.alpha=1.0", f"train.batch_size={s['rows']}", "train.max_steps=100000",
        f"train.lr={s['lr']}", "train.schedule=constant", "train.warmup_steps=0", "train.weight_decay=0.0",
        "train.beta1=0.9", "train.beta2=0.999", "train.grad_clip=1.0", f"train.seed={s['seed']}",
        "train.eval_every=0", "train.sample_tokens=0", "train.log_every=1000", "parallel.precision=fp32",
        "log.tensorboard=false", "log.progress=none", "checkpoint.save_final=false",
        f"out_dir={work / 'shardlm-run'}", *extra]))


def shardlm_side(s: dict, work: Path) -> dict:
    """One epoch of `Trainer.train_step` over the packed rows."""
    trainer = shardlm_trainer(s, work, [])
    from shardlm.objectives.lm import blocks

    steps = -(-len(blocks(trainer.run.train)) // s["rows"])
    rss_before = rss_gb()
    ends, targets, losses = [now()], [], []
    for _ in range(steps):
        out = trainer.train_step()
        targets.append(int(out["targets"]))
        losses.append(float(out["loss_sum"]) / max(int(out["targets"]), 1))
        ends.append(now())
    return rates(ends, targets, losses, rss_before)


def rates(ends: list, targets: list[int], losses: list[float], rss_before: float) -> dict:
    wall, cpu = ends[-1][0] - ends[1][0], ends[-1][1] - ends[1][1]
    n = sum(targets[1:])
    return {"target_tokens_per_s": n / wall, "target_tokens_per_cpu_s": n / cpu, "timed_steps": len(targets) - 1,
            "targets": sum(targets), "step_s": [round(b[0] - a[0], 3) for a, b in zip(ends, ends[1:], strict=False)],
            "losses_per_target": [round(x, 6) for x in losses], "rss_before_first_step_gb": rss_before,
            "peak_rss_gb": peak_rss_gb()}


# ---- TRL -------------------------------------------------------------------------------------------------------
def trl_trainer(s: dict, work: Path, collate_counts: list[int] | None = None):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML

    tok = AutoTokenizer.from_pretrained(s["student"])
    tok.pad_token = tok.pad_token or tok.eos_token  # the collator pads; the byte tokenizer has no pad token
    collator = DataCollatorForChatML(tokenizer=tok, max_length=1024)

    def collate(examples):
        batch = collator(examples)
        if collate_counts is not None:  # the targets GKD's loss counts: labels after its shift
            collate_counts.append(int((batch["labels"][:, 1:] != -100).sum()))
        return batch

    args = GKDConfig(output_dir=str(work / "trl"), lmbda=0.0, beta=s["beta"], per_device_train_batch_size=s["per_step"],
                     gradient_accumulation_steps=1, learning_rate=s["lr"], lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
                     num_train_epochs=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                     bf16=False, gradient_checkpointing=False, seed=s["seed"], dataloader_num_workers=0,
                     disable_tqdm=True)
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    return GKDTrainer(model=s["student"], teacher_model=s["teacher"], args=args, data_collator=collate,
                      train_dataset=Dataset.from_list(rows), processing_class=tok)


def trl_side(s: dict, work: Path) -> dict:
    from transformers import TrainerCallback

    counts: list[int] = []
    trainer = trl_trainer(s, work, counts)
    ends: list = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *_args, **_kwargs):
            ends.append(now())

        def on_step_end(self, *_args, **_kwargs):
            ends.append(now())

    trainer.add_callback(Clock())
    rss_before = rss_gb()
    trainer.train()
    logs = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    return rates(ends, counts[:len(ends) - 1], logs, rss_before)


def loss_side(s: dict, work: Path) -> dict:
    """The first step's loss on the same inputs: shardlm's Trainer (packing off: one example a row, padded on the
    right) and TRL's compute_loss on those rows, both from the untrained student."""
    import torch

    trainer = shardlm_trainer(s, work, ["data.packing=false"])
    from shardlm.objectives.lm import blocks

    batch = trainer._batch(blocks(trainer.run.train), trainer.indices(trainer.position, 0))
    out = trainer.train_step()
    from shardlm.objectives.distill.step import RECORDS

    targets = int(out["targets"])
    ours = {k: float(v) / targets for k, v in zip(RECORDS, out["stats"].tolist(), strict=True)}  # sums: per target
    # unpacked rows are right-padded and the padding restarts the positions: a real token's position is its column
    real = batch.positions == torch.arange(batch.inputs.size(1))[None, :]
    labels = torch.full_like(batch.inputs, -100)  # TRL shifts: labels[t + 1] is what logits[t] predicts
    labels[:, 1:] = batch.targets[:, :-1]
    inputs = {"input_ids": batch.inputs, "attention_mask": real.long(), "labels": labels}
    trl = trl_trainer(s, work)
    trl.model.train()
    with torch.no_grad():
        theirs = float(trl.compute_loss(trl.model, inputs))
    shardlm_loss = float(out["loss_sum"]) / targets
    return {"trl_loss_per_target": theirs, "shardlm_loss_per_target": shardlm_loss,
            "shardlm_records": ours, "abs_diff": abs(theirs - shardlm_loss), "targets": targets,
            "rows": int(batch.inputs.size(0))}


# ---- the parent ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=["shardlm", "trl", "loss"], help="(children) which side to run")
    p.add_argument("--work", help="(children) the benchmark's temporary folder")
    p.add_argument("--settings", help="(children) the settings as JSON")
    p.add_argument("--teacher", default=None, help="the teacher's folder (default: a random 6 x 192 GPT-2)")
    p.add_argument("--examples", type=int, default=320, help="conversations: one epoch over them")
    p.add_argument("--rows", type=int, default=8, help="shardlm: packed 256-token rows a step")
    p.add_argument("--examples-per-step", type=int, default=32, help="TRL: examples a step (8 rows hold ~32)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every child")
    p.add_argument("--out", help="write the JSON here too")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.side:
        import torch

        s, work = json.loads(args.settings), Path(args.work)
        torch.set_num_threads(s["threads"])
        run = {"shardlm": shardlm_side, "trl": trl_side, "loss": loss_side}[args.side]
        print("RESULT " + json.dumps(run(s, work)), flush=True)
        return
    began, load_start = time.perf_counter(), list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="shardlm-distill-bench-") as tmp:
        work = Path(tmp)
        s = {"examples": args.examples, "rows": args.rows, "per_step": args.examples_per_step, "seq": 256,
             "lr": args.lr, "seed": args.seed, "threads": args.threads, "beta": 0.5, "temperature": 1.0,
             "lmbda": 0.0, "precision": "fp32", "student": str(work / "student"),
             "teacher": str(Path(args.teacher).resolve()) if args.teacher else str(work / "teacher")}
        if not args.teacher:
            make_model(work / "teacher", TEACHER, args.seed + 1)
        make_model(work / "student", STUDENT, args.seed)
        write_data(s, work)
        ours = launch_side(__file__, "shardlm", s, work)
        theirs = launch_side(__file__, "trl", s, work)
        loss = launch_side(__file__, "loss", s, work)
    s["teacher"] = args.teacher or f"random GPT-2 {TEACHER}"
    s["student"] = f"random GPT-2 {STUDENT}"
    out = {"benchmark": "distill vs trl", "date": datetime.date.today().isoformat(),
           "machine": trl_machine(args.threads),
           "command": " ".join(["python", "benchmarks/distill_vs_trl.py", *sys.argv[1:]]), "settings": s,
           "shardlm": ours, "trl": theirs, "first_step_loss": loss,
           "speedup": ours["target_tokens_per_s"] / theirs["target_tokens_per_s"],
           "speedup_cpu_time": ours["target_tokens_per_cpu_s"] / theirs["target_tokens_per_cpu_s"],
           "memory_ratio": ours["peak_rss_gb"] / theirs["peak_rss_gb"],
           "wall_s": time.perf_counter() - began, "load_average_at_start": load_start}
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
