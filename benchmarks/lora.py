"""LoRA (r=16) vs full fine-tuning in shardlm, and shardlm LoRA vs Hugging Face Trainer + PEFT.

    python benchmarks/lora.py                       # CPU: GPT-2 124M (random init), seq 512, batch 2, fp32
    python benchmarks/lora.py --batch 4 --steps 8   # other sizes; --gpu: bf16 on CUDA
    python benchmarks/lora.py --modes plain         # only without activation checkpointing

Two modes, each with all three sides: `plain` (no activation checkpointing anywhere) and `ac` (activation
checkpointing on every side: shardlm `parallel.activation_checkpointing=true`, HF `gradient_checkpointing=True`,
non-reentrant).

The base is GPT-2 124M (`GPT2Config()`) with random weights, saved with `save_pretrained` (plus the bundled
GPT-2 tokenizer) to a temporary folder that every side loads as its pretrained model. All three sides use
the same data blocks in the same order, batch, seq, precision, AdamW settings and LoRA settings
(r=16, alpha=32, dropout 0, targets c_attn, c_proj, c_fc: every attention and MLP projection).

Each side runs in its own process. tokens/s is tokens per step / the MEDIAN step time of the steps after
`--warmup` (this shared 2-core machine shows single steps 2-3x slower at random), `tokens_per_s_best` the
same with the fastest step (noise only adds time, so this is the quiet-machine figure); the step peak is measured
on one extra step after them (not timed): on CPU the bytes resident before the step (parameters, buffers,
optimizer state) plus the growth of peak RSS during it, with large blocks mmapped so that freed memory is
returned (shardlm.observe.hardware.StepPeak, used for both frameworks); on CUDA max_memory_allocated. The last line
of output is one JSON object with, per mode, every side, `lora_vs_full_peak` (LoRA step peak / full
fine-tuning's), `speedup_vs_hf_peft` (shardlm LoRA tokens/s / HF's) and `memory_vs_hf_peft` (shardlm LoRA
peak / HF's). HF's model keeps its config's `gelu_new`; shardlm computes the same tanh-GELU as one fused op.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from common import ROOT, HFBlocks

TARGETS = ["c_attn", "c_proj", "c_fc"]


def make_base(folder: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.tokenizer import load_tokenizer

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config()).save_pretrained(str(folder))
    load_tokenizer("gpt2").save_pretrained(str(folder))


def overrides(args, base: str, r: int) -> list[str]:
    return [f"model.name={base}", "model.dropout=0.0", f"data.train={args.data}", f"data.seq_len={args.seq}",
            f"data.cache_dir={args.cache}", f"train.batch_size={args.batch}", f"train.max_steps={args.steps + 10}",
            "train.lr=2e-4", "train.warmup_steps=2", "train.weight_decay=0.0", "train.grad_clip=1.0",
            f"parallel.precision={args.precision}", "parallel.compile=false", "train.sample_tokens=0",
            "train.eval_every=0", "log.tensorboard=false", "log.progress=none", "checkpoint.save_final=false",
            "checkpoint.every=0", f"parallel.activation_checkpointing={args.mode == 'ac'}", f"lora.r={r}",
            f"lora.alpha={2 * r}", "lora.dropout=0.0",
            f"lora.target_modules=[{','.join(TARGETS)}]", f"out_dir={tempfile.mkdtemp(prefix='shardlm-lora-bench-')}",
            *args.extra]


def run_shardlm(args, r: int) -> dict:
    from shardlm.config import load_config
    from shardlm.models.lora import count
    from shardlm.observe.hardware import measure_step_peak
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config(None, overrides(args, args.base, r)))
    times, loss = [], None
    tokens = trainer.global_batch * trainer.seq_len
    for _ in range(args.steps):
        began = time.perf_counter()
        out = trainer.train_step()
        loss = out["loss_sum"].item() / tokens  # syncs the device, so the step time is real
        times.append(time.perf_counter() - began)
    peak = measure_step_peak(trainer)
    trainable, total = count(trainer.model)
    return {"tokens_per_s": tokens / median(times[args.warmup:]),
            "tokens_per_s_best": tokens / min(times[args.warmup:]), "step_peak_gb": peak / 2**30,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "final_loss": loss,
            "trainable_params": trainable, "total_params": total, "step_times_s": times}


def run_hf_peft(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from shardlm.config import load_config
    from shardlm.data import GlobalSampler, prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo
    from shardlm.observe.hardware import StepPeak
    from shardlm.tokenizer import model_tokenizer

    cfg = load_config(None, overrides(args, args.base, 16))
    tok = model_tokenizer(cfg.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, _ = prepare_data(cfg.data, tok, Dist(LaunchInfo("single"), device))
    total_steps = args.steps + 1
    order = GlobalSampler(len(train), cfg.train.seed).indices(0, args.batch * total_steps)  # shardlm's blocks

    model = AutoModelForCausalLM.from_pretrained(args.base, attn_implementation="sdpa", dtype=torch.float32,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # = shardlm's
    model.config.use_cache = False
    torch.manual_seed(cfg.train.seed)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS,
                                             fan_in_fan_out=True, bias="none", task_type="CAUSAL_LM"))
    times: list[float] = []
    peak: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, _targs, state, _control, **kw):
            if state.global_step == args.steps:  # the extra, untimed step: memory
                self.meter = StepPeak(kw["model"], kw["optimizer"], device)
                self.meter.start()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.began = time.perf_counter()

        def on_step_end(self, _targs, state, _control, **_kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if state.global_step == args.steps + 1:
                peak["bytes"] = self.meter.stop()
            else:
                times.append(time.perf_counter() - self.began)

    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-lora-bench-"), per_device_train_batch_size=args.batch,
        max_steps=total_steps, learning_rate=2e-4, warmup_steps=2, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="cosine", logging_steps=1, save_strategy="no",
        report_to=[], dataloader_drop_last=True, bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(),
        seed=cfg.train.seed, disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=args.mode == "ac",
        gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer = Trainer(model=model, args=targs, train_dataset=HFBlocks(train, order), callbacks=[Timer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = args.batch * args.seq
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"tokens_per_s": tokens / median(times[args.warmup:]),
            "tokens_per_s_best": tokens / min(times[args.warmup:]), "step_peak_gb": peak["bytes"] / 2**30,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "final_loss": losses[-2] if len(losses) > 1 else None, "trainable_params": trainable,
            "total_params": sum(p.numel() for p in model.parameters()), "step_times_s": times}


def launch(side: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--base", args.base,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq", str(args.seq), "--precision", args.precision, "--mode", args.mode, "--data", args.data,
           "--cache", args.cache,
           *[f"--extra={e}" for e in args.extra]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{args.mode} {side}: {rows[0]['tokens_per_s']:.1f} tokens/s, step peak {rows[0]['step_peak_gb']:.2f} GiB",
          flush=True)
    return rows[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["full", "lora", "hf_peft"])
    p.add_argument("--mode", choices=["plain", "ac"], default="plain", help="(one side's mode)")
    p.add_argument("--modes", default="plain,ac", help="modes to run: plain, ac or both (default)")
    p.add_argument("--base", default=None, help="a saved base model folder (default: a random-init GPT-2 124M)")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--steps", type=int, default=8, help="timed steps incl. warm-up (one more is run for memory)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--precision", default=None, help="fp32 | bf16 (default: bf16 with --gpu, else fp32)")
    p.add_argument("--data", default="shakespeare")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "shardlm-lora-bench-cache"))
    p.add_argument("--extra", action="append", default=[], help="extra shardlm override (both shardlm sides)")
    args = p.parse_args(argv)
    args.precision = args.precision or ("bf16" if args.gpu else "fp32")
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        result = run_hf_peft(args) if args.side == "hf_peft" else run_shardlm(args, 16 if args.side == "lora" else 0)
        print("RESULT " + json.dumps(result), flush=True)
        from shardlm.distributed.process_group import shutdown

        shutdown(0)
        return
    import torch

    modes = {}
    with tempfile.TemporaryDirectory(prefix="gpt2-124m-random-") as tmp:
        if args.base is None:
            args.base = tmp
            make_base(Path(tmp))
        for mode in args.modes.split(","):
            args.mode = mode
            sides = {side: launch(side, args) for side in ("full", "lora", "hf_peft")}
            full, ours, hf = sides["full"], sides["lora"], sides["hf_peft"]
            modes[mode] = {
                "shardlm_full": full, "shardlm_lora": ours, "hf_trainer_peft": hf,
                "lora_vs_full_peak": ours["step_peak_gb"] / full["step_peak_gb"],
                "lora_vs_full_tokens_per_s": ours["tokens_per_s"] / full["tokens_per_s"],
                "speedup_vs_hf_peft": ours["tokens_per_s"] / hf["tokens_per_s"],
                "speedup_vs_hf_peft_best": ours["tokens_per_s_best"] / hf["tokens_per_s_best"],
                "lora_vs_full_tokens_per_s_best": ours["tokens_per_s_best"] / full["tokens_per_s_best"],
                "memory_vs_hf_peft": ours["step_peak_gb"] / hf["step_peak_gb"]}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    import peft
    import transformers

    print(json.dumps({
        "benchmark": "lora", "date": datetime.date.today().isoformat(), "device": device, "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__,
        "command": " ".join(["python", *sys.argv]),
        "settings": {"model": "GPT-2 124M (GPT2Config(), random init, loaded with from_pretrained)", "seq": args.seq,
                     "batch": args.batch, "precision": args.precision, "steps": args.steps, "warmup": args.warmup,
                     "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": TARGETS}, "data": args.data,
                     "optimizer": "AdamW lr 2e-4, betas (0.9, 0.95), clip 1.0", "dropout": 0.0,
                     "extra": args.extra},
        "modes": modes,
    }))


if __name__ == "__main__":
    main()
