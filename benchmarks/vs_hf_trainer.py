"""shardlm vs Hugging Face Trainer: the same GPT-2, data blocks, batch, seq, precision and optimizer.

    python benchmarks/vs_hf_trainer.py                      # CPU: 6 x 384 GPT-2 (vocab 50257), seq 256, batch 8, fp32
    python benchmarks/vs_hf_trainer.py --gpu                # GPU: GPT-2 124M, seq 1024, batch 8, bf16
    python benchmarks/vs_hf_trainer.py --nproc 2            # both sides on 2 ranks (HF: its accelerate path)
    python benchmarks/vs_hf_trainer.py --gpu --batch 16 --hf-compile --extra parallel.compile=model  # both compiled
`--model L,H,C`, `--seq`, `--precision`, `--warmup` and `--tokenizer` override the defaults of either mode.
`--data` is WikiText-2's train split at ../shared/data/wikitext-2/train.txt where it exists, else the bundled
Tiny Shakespeare; the JSON names it.

Each side runs in its own process (tree), so peak RSS / peak CUDA memory are its own. The last line of
output is one JSON object with both sides' tokens/s, peak memory and final loss, `speedup` (shardlm
tokens/s / HF tokens/s) and `memory_ratio` (HF peak / shardlm peak).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import DATA_HELP, DEFAULT_DATA, ROOT, HFBlocks, shardlm_overrides


def settings(args) -> dict:
    """The benchmark's model, seq, batch, precision, steps: `--gpu` or CPU defaults, then explicit flags."""
    layers, heads, width = args.model or ((12, 12, 768) if args.gpu else (6, 6, 384))
    return {"model": {"n_layer": layers, "n_head": heads, "n_embd": width},
            "seq": args.seq or (1024 if args.gpu else 256), "batch": args.batch or 8,
            "precision": args.precision or ("bf16" if args.gpu else "fp32"), "steps": args.steps,
            "warmup": args.warmup if args.warmup is not None else (5 if args.gpu else 3),
            "tokenizer": args.tokenizer, "hf_compile": args.hf_compile, "vocab_multiple": args.vocab_multiple}


def peak_memory_gb() -> float:
    import torch

    from shardlm.observe.hardware import peak_memory_bytes

    return peak_memory_bytes(torch.device("cuda" if torch.cuda.is_available() else "cpu")) / 2**30


def run_shardlm(s: dict, data: str, extra: list[str]) -> dict:
    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, shardlm_overrides(s, data, extra)))
    times, loss = [], None
    tokens = trainer.global_batch * trainer.seq_len
    for _ in range(s["steps"]):
        began = time.perf_counter()
        out = trainer.train_step()
        loss_sum = trainer.dist.all_reduce_sum(out["loss_sum"].clone())
        loss = loss_sum.item() / tokens  # syncs the device, so the step time is real
        times.append(time.perf_counter() - began)
    steady = times[s["warmup"]:]
    return {"tokens_per_s": tokens * len(steady) / sum(steady), "final_loss": loss,
            "peak_memory_gb": peak_memory_gb(), "rank": trainer.dist.rank}


def run_hf(s: dict, data: str) -> dict:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from shardlm.config import load_config
    from shardlm.data import GlobalSampler, prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo
    from shardlm.models.hf_config import padded_vocab
    from shardlm.tokenizer import load_tokenizer

    cfg = load_config(None, shardlm_overrides(s, data, []))
    tok = load_tokenizer(s["tokenizer"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, _ = prepare_data(cfg.data, tok, Dist(LaunchInfo("single"), device))
    world = int(os.environ.get("WORLD_SIZE", 1))
    global_batch = s["batch"] * world
    sampler = GlobalSampler(len(train), cfg.train.seed)
    order = sampler.indices(0, global_batch * s["steps"])  # the same blocks, in the same order, as shardlm

    m = s["model"]
    torch.manual_seed(cfg.train.seed)
    vocab = padded_vocab(len(tok), s.get("vocab_multiple", 1))  # the same padded vocabulary as shardlm's
    config = GPT2Config(vocab_size=vocab, n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, use_cache=False, **m)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_args, **_kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.began = time.perf_counter()

        def on_step_end(self, *_args, **_kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.began)

    targs = TrainingArguments(
        output_dir="/tmp/hf-bench-run", per_device_train_batch_size=s["batch"], max_steps=s["steps"],
        learning_rate=6e-4, warmup_steps=2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        lr_scheduler_type="cosine", logging_steps=1, save_strategy="no", report_to=[], dataloader_drop_last=True,
        bf16=s["precision"] == "bf16", use_cpu=not torch.cuda.is_available(), seed=cfg.train.seed,
        torch_compile=s["hf_compile"],
        disable_tqdm=True, dataloader_num_workers=0, accelerator_config={"dispatch_batches": False},
        **({"fsdp": "full_shard"} if world > 1 and torch.cuda.is_available() else {}))
    trainer = Trainer(model=model, args=targs, train_dataset=HFBlocks(train, order), callbacks=[Timer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steady = times[s["warmup"]:]
    tokens = global_batch * s["seq"]
    return {"tokens_per_s": tokens * len(steady) / sum(steady), "final_loss": losses[-1] if losses else None,
            "peak_memory_gb": peak_memory_gb(), "rank": int(os.environ.get("RANK", 0)),
            "note": "HF Trainer on CPU with >1 rank is DDP (accelerate ignores FSDP on CPU)" if world > 1 else ""}


def launch(side: str, args, extra: list[str]) -> dict:
    """Run one side in its own process (tree) with the same flags; its RESULT line, parsed."""
    script = [str(Path(__file__).resolve()), "--side", side, "--steps", str(args.steps), "--data", args.data]
    flags = {"--batch": args.batch, "--seq": args.seq, "--precision": args.precision, "--warmup": args.warmup,
             "--tokenizer": args.tokenizer, "--vocab-multiple": args.vocab_multiple,
             "--model": ",".join(map(str, args.model)) if args.model else None}
    script += [x for k, v in flags.items() if v is not None for x in (k, str(v))]
    script += (["--gpu"] if args.gpu else []) + (["--hf-compile"] if args.hf_compile else [])
    script += [f"--extra={e}" for e in extra]
    cmd = [sys.executable, *script] if args.nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", *script]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return rows[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["shardlm", "hf"])
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--seq", type=int, default=0)
    p.add_argument("--model", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                   help="n_layer,n_head,n_embd (default: 12,12,768 with --gpu, else 6,6,384)")
    p.add_argument("--precision", default=None, help="fp32 | bf16 (default: bf16 with --gpu, else fp32)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of tokens/s (default 5 --gpu, else 3)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 (the GPT-2 BPE) or bytes (tiny vocabulary, for tests)")
    p.add_argument("--hf-compile", action="store_true", help="HF Trainer with torch_compile=True")
    p.add_argument("--vocab-multiple", type=int, default=1, help="both sides: vocabulary padded to this multiple")
    p.add_argument("--data", default=DEFAULT_DATA, help=DATA_HELP)
    p.add_argument("--extra", action="append", default=[], help="extra shardlm override, e.g. parallel.compile=model")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    s = settings(args)
    if args.side:
        result = run_shardlm(s, args.data, args.extra) if args.side == "shardlm" else run_hf(s, args.data)
        if result["rank"] == 0:
            print("RESULT " + json.dumps(result), flush=True)
        from shardlm.distributed.process_group import shutdown

        shutdown(0)
        return
    import torch

    ours, theirs = launch("shardlm", args, args.extra), launch("hf", args, [])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print(json.dumps({
        "benchmark": "vs_hf_trainer", "date": datetime.date.today().isoformat(), "device": device,
        "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "settings": s, "nproc": args.nproc,
        "data": args.data,
        "shardlm": ours, "hf_trainer": theirs,
        "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
        "memory_ratio": theirs["peak_memory_gb"] / ours["peak_memory_gb"],
    }))


if __name__ == "__main__":
    main()
