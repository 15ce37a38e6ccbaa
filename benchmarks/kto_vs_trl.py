"""shardlm's KTO vs TRL 1.16's KTOTrainer on CPU: the same tiny model, the same labelled examples, TRL's defaults.

    python benchmarks/kto_vs_trl.py --out benchmarks/results/kto_vs_trl_cpu.json   # 256 pairs, 8 a step, 20 steps
    python benchmarks/kto_vs_trl.py --steps 4 --pairs 32                             # a smoke run
    python benchmarks/kto_vs_trl.py --reference precomputed                          # both sides precompute it

Model: preference.py's tiny random Qwen2 (4 x 256, `initializer_range=0.3`, tied embeddings) over the GPT-2 BPE
tokenizer plus ChatML's `<|im_start|>`/`<|im_end|>`, with the stock template (Qwen2.5's, with TRL's generation
markers: common.standard_template), saved in a temporary folder. Data: the first `--pairs` pairs of
shardlm/assets/chat_tasks/pairs_train.jsonl unpaired as TRL's unpaired preference format, conversational: each
pair gives `{"prompt": [...], "completion": [chosen], "label": true}` and the same with `[rejected]`, `false`; the
records shuffled once (`random.Random(0)`), so a batch mixes labels and prompts. Both sides read that one file.

- shardlm: `train.objective=kto` with preference's defaults (beta 0.1, weights 1.0, kto_loss_type kto),
  `data.packing=false` (one example a row: its completion and its mismatched one, right-padded) and
  `train.batch_size=--batch`, so a step has exactly `--batch` examples, as TRL's; `preference.reference=--reference`.
- TRL: `KTOTrainer` with `KTOConfig`'s defaults (beta 0.1, desirable/undesirable weight 1.0, loss_type "kto",
  the sequential sampler, max_length 1024, `precompute_ref_log_probs` off: a live reference model, which is
  `--reference`'s default), `per_device_train_batch_size=--batch`, `gradient_checkpointing=False` and
  `bf16=False` (KTOConfig's defaults are True; shardlm runs fp32 without activation checkpointing).
Both: the mismatched (KL) completion of each record is the one of the record before it within runs of `--batch`
records (TRL's rotation, which shardlm copies), AdamW (lr `--lr`: KTOConfig's 1e-6, betas 0.9/0.95, no decay,
clip 1, constant), fp32, one process, `--threads` torch threads. shardlm draws its rows in a seeded shuffle, TRL
in file order: the throughput runs see different (equally shaped) batches.

Three child processes (common.launch_side), one at a time, so each peak RSS (`ru_maxrss`) is its own:
`shardlm` and `trl` time `--steps` optimizer steps (rates leave out the first `--warmup`: it holds shardlm's
reference precompute when precomputed; TRL's runs in its __init__). Rates: examples/s and example tokens/s (the
examples' prompt + completion tokens; padding and the KL sequences not counted), wall clock and per CPU-second.
`loss`: the first step's loss on one batch, shardlm's Trainer (its first step's records) against TRL's
`compute_loss` (`_compute_loss`) on the same records with the same KL completions, from the same weights. With
policy = reference every KTO loss is 1 - sigmoid(0) = 0.5 and the KL point is 0, so that check is done twice:
from the initial model (loss 0.5 on both; the policies' summed log-probabilities compared), and from a moved
policy against the initial model as reference, where loss, KL point and rewards are not trivial: the initial
weights plus seeded noise (`--move` x each tensor's std) with the final norm's weight x 0.8 (softer logits raise
every completion's log-probability, so the KL point is well above its clamp at 0). TRL takes the KL reference
point per micro-batch, shardlm per optimizer step (over its micro-batches and ranks); with grad_accum 1 on one
process, as here, the two coincide. The token ids of the batch's sequences (completion and KL) are compared too.

The output is one JSON object (common.emit); `speedup` is shardlm / TRL examples per second (wall clock) and
`memory_ratio` shardlm / TRL peak RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from common import (
    ROOT,
    emit,
    example_run_overrides,
    launch_side,
    now,
    peak_rss_gb,
    rss_gb,
    standard_template,
    trl_machine,
)

PAIRS = ROOT / "shardlm" / "assets" / "chat_tasks" / "pairs_train.jsonl"
GPT2 = ROOT / "shardlm" / "assets" / "gpt2-tokenizer"


def make_model(work: Path, s: dict) -> None:
    """preference.py's tiny Qwen2 and tokenizer in work/model, and work/moved: the same moved off it."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(GPT2))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<|endoftext|>", standard_template()
    m = s["model"]
    config = Qwen2Config(vocab_size=len(tok), hidden_size=m["hidden"], num_hidden_layers=m["layers"],
                         num_attention_heads=m["heads"], num_key_value_heads=m["heads"],
                         intermediate_size=m["intermediate"], max_position_embeddings=1024, initializer_range=0.3,
                         tie_word_embeddings=True, use_cache=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(s["seed"])
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    with torch.no_grad():  # seeded noise, and softer logits: every completion gains, so the KL point is > 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * s["move"] * p.std())
        model.model.norm.weight.mul_(s["soften"])
    model.save_pretrained(work / "moved")
    tok.save_pretrained(work / "moved")


def write_data(s: dict, work: Path) -> None:
    """TRL's unpaired format: each pair a desirable and an undesirable record, shuffled once."""
    with open(PAIRS) as f:
        pairs = [json.loads(next(f)) for _ in range(s["pairs"])]
    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]
    random.Random(0).shuffle(rows)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2 * s["batch"]]))


# ---- shardlm ---------------------------------------------------------------------------------------------------
def shardlm_trainer(s: dict, work: Path, model: str, out: str):
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    s = {**s, "lr_warmup": 0}
    return Trainer.from_config(load_config(None, [*example_run_overrides(s, work / model, work, s["steps"], [
        f"data.train={work / 'train.jsonl'}", f"data.val={work / 'val.jsonl'}", "data.packing=false",
        "train.objective=kto", f"preference.reference={s['reference']}"]), "train.schedule=constant",
        f"out_dir={work / out}"]))


def step_rows(trainer) -> tuple:
    """(the training rows, the units of the step about to run): one example a unit."""
    from shardlm.objectives.preference.reference import pair_rows

    rows = pair_rows(trainer.run.train, "training")
    idx = trainer.sampler.indices(trainer.position, trainer.global_batch)
    return rows, [k for r in idx for k in rows.rows[int(r)]]


def shardlm_side(s: dict, work: Path) -> dict:
    trainer = shardlm_trainer(s, work, "model", "shardlm-run")
    rss_before = rss_gb()
    ends, examples, tokens, losses = [now()], [], [], []
    for _ in range(s["steps"]):
        rows, units = step_rows(trainer)
        tokens.append(int(rows.seq_lengths[units, 0].sum()))  # the examples' own sequences, not the KL ones
        out = trainer.train_step()
        examples.append(int(out["targets"]))  # KTO's targets: the step's examples
        losses.append(float(out["loss_sum"]) / int(out["targets"]))
        ends.append(now())
    return {**rates(s, ends, examples, tokens, losses, rss_before), "truncated": rows.truncated,
            "dropped": rows.dropped}


def rates(s: dict, ends: list, examples: list[int], tokens: list[int], losses: list[float], rss_before: float) -> dict:
    """Rates over the steps after the first `warmup`: ends[i + 1] is when step i ended (ends[0]: before the first)."""
    w = s["warmup"]
    wall, cpu = ends[-1][0] - ends[w][0], ends[-1][1] - ends[w][1]
    n, t = sum(examples[w:]), sum(tokens[w:])
    return {"examples_per_s": n / wall, "examples_per_cpu_s": n / cpu, "example_tokens_per_s": t / wall,
            "example_tokens_per_cpu_s": t / cpu, "timed_steps": len(examples) - w, "examples_per_step": examples,
            "step_s": [round(b[0] - a[0], 3) for a, b in zip(ends, ends[1:], strict=False)],
            "losses": [round(x, 6) for x in losses], "rss_before_first_step_gb": rss_before,
            "peak_rss_gb": peak_rss_gb()}


# ---- TRL -------------------------------------------------------------------------------------------------------
def trl_trainer(s: dict, work: Path, policy: str, reference: str | None = None, counter: dict | None = None):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(output_dir=str(work / "trl-run"), per_device_train_batch_size=s["batch"],
                     gradient_accumulation_steps=1, max_steps=s["steps"], learning_rate=s["lr"],
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95,
                     max_grad_norm=1.0, precompute_ref_log_probs=s["reference"] == "precomputed",
                     gradient_checkpointing=False, bf16=False, use_cpu=True, logging_steps=1, save_strategy="no",
                     report_to="none", seed=s["seed"], dataloader_num_workers=0, disable_tqdm=True)

    class Counting(KTOTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if counter is not None and model.training:
                counter["examples"] += len(inputs["label"])
                counter["tokens"] += int(inputs["attention_mask"].sum())
            return super().compute_loss(model, inputs, *a, **kw)

    data = load_dataset("json", data_files=str(work / "train.jsonl"), split="train", cache_dir=str(work / "hf"))
    ref = AutoModelForCausalLM.from_pretrained(work / reference) if reference else None
    return Counting(model=str(work / policy), ref_model=ref, args=args, train_dataset=data,
                    processing_class=AutoTokenizer.from_pretrained(work / policy))


def trl_side(s: dict, work: Path) -> dict:
    from transformers import TrainerCallback

    counter = {"examples": 0, "tokens": 0}
    ends, seen = [], [(0, 0)]

    class Clock(TrainerCallback):
        def on_train_begin(self, *_a, **_kw):
            ends.append(now())

        def on_step_end(self, *_a, **_kw):
            ends.append(now())
            seen.append((counter["examples"], counter["tokens"]))

    trainer = trl_trainer(s, work, "model", counter=counter)
    trainer.add_callback(Clock())
    rss_before = rss_gb()
    trainer.train()
    examples, tokens = ([b[i] - a[i] for a, b in zip(seen, seen[1:], strict=False)] for i in (0, 1))
    losses = [x["loss"] for x in trainer.state.log_history if "loss" in x]
    return rates(s, ends, examples, tokens, losses, rss_before)


# ---- the first step's loss on one batch ------------------------------------------------------------------------
def first_step(s: dict, work: Path, policy: str, ref_trainer=None) -> tuple[dict, object]:
    """shardlm's first step from `policy` (reference: the initial model's, `ref_trainer`'s when given) and TRL's
    _compute_loss on the same records, with the same reference; and shardlm's trainer (its reference)."""
    import torch

    trainer = shardlm_trainer(s, work, policy, f"loss-{policy}")
    if ref_trainer is not None:  # the initial model's reference values (precomputed) or frozen copy (live)
        o, r = trainer.objective, ref_trainer.objective
        o.reference, o.frozen, o.ready = r.reference, r.frozen, True
    rows, units = step_rows(trainer)
    records = [int(x) for x in rows.examples.records[0::2][rows.ids[units]]]
    ids = [[rows.examples.example(2 * int(rows.ids[k]) + j)[0].tolist() for j in (0, 1)] for k in units]
    out = trainer.train_step()
    ours = {"loss": float(out["loss_sum"]) / int(out["targets"]), **out["stats"]}
    trl = trl_trainer(s, work, policy, reference="model" if ref_trainer is not None else None)
    trl.model.train()
    examples = [trl.train_dataset[i] for i in records]
    with torch.no_grad():
        loss = float(trl.compute_loss(trl.model, trl.data_collator(examples)))
    theirs = {"loss": loss, **{k: v[-1] for k, v in trl._metrics["train"].items()}}
    same = sum([e["prompt_ids"] + e["completion_ids"], e["prompt_ids"] + e["KL_completion_ids"]] == x
               for e, x in zip(examples, ids, strict=True))
    keys = ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    return {"policy": policy, "records": records, "shardlm": {k: ours[k] for k in keys},
            "trl": {k: theirs.get(k) for k in keys}, "same_ids_completion_and_kl": f"{same}/{len(examples)}",
            "abs_diff": {k: abs(ours[k] - theirs[k]) for k in keys if k in theirs}}, trainer


def loss_side(s: dict, work: Path) -> dict:
    initial, trainer = first_step(s, work, "model")
    return {"initial": initial, "moved": first_step(s, work, "moved", ref_trainer=trainer)[0]}


# ---- the parent ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=["shardlm", "trl", "loss"], help="(children) which side to run")
    p.add_argument("--work", help="(children) the benchmark's temporary folder")
    p.add_argument("--settings", help="(children) the settings as JSON")
    p.add_argument("--pairs", type=int, default=256, help="the first N pairs of pairs_train.jsonl: 2N records")
    p.add_argument("--batch", type=int, default=8, help="examples a step, both sides")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the rates")
    p.add_argument("--reference", choices=["live", "precomputed"], default="live",
                   help="live: TRL's default (precompute_ref_log_probs=False); precomputed: shardlm's default")
    p.add_argument("--lr", type=float, default=1e-6, help="KTOConfig's default")
    p.add_argument("--move", type=float, default=0.1, help="the moved policy's noise, in each tensor's std")
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
    s = {"model": {"family": "qwen2", "hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024},
         "pairs": args.pairs, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
         "reference": args.reference, "lr": args.lr, "move": args.move, "soften": 0.8, "seed": args.seed,
         "threads": args.threads, "seq": 512, "beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0,
         "loss_type": "kto", "precision": "fp32"}
    with tempfile.TemporaryDirectory(prefix="shardlm-kto-bench-") as tmp:
        work = Path(tmp)
        make_model(work, s)
        write_data(s, work)
        ours = launch_side(__file__, "shardlm", s, work)
        theirs = launch_side(__file__, "trl", s, work)
        loss = launch_side(__file__, "loss", s, work)
    emit({"benchmark": "kto vs trl", "date": datetime.date.today().isoformat(), "machine": trl_machine(args.threads),
          "command": " ".join(["python", "benchmarks/kto_vs_trl.py", *sys.argv[1:]]), "settings": s,
          "data": {"source": "shardlm/assets/chat_tasks/pairs_train.jsonl", "records": 2 * args.pairs,
                   "format": "conversational unpaired (prompt, completion, label), shuffled by random.Random(0)",
                   "chat_template": "Qwen2.5's with TRL's generation markers (trl/chat_templates/"
                                    "qwen2_5_training.jinja), both sides"},
          "shardlm": ours, "trl": theirs, "first_step_loss": loss,
          "speedup": ours["examples_per_s"] / theirs["examples_per_s"],
          "speedup_cpu_time": ours["examples_per_cpu_s"] / theirs["examples_per_cpu_s"],
          "memory_ratio": ours["peak_rss_gb"] / theirs["peak_rss_gb"],
          "wall_s": time.perf_counter() - began, "load_average_at_start": load_start}, args.out)


if __name__ == "__main__":
    main()
