"""Per-step overhead on a tiny model: `shardlm train` against a minimal hand-written PyTorch loop.

    python benchmarks/small_model.py                        # 5 alternating pairs of runs, 300 steps each
    python benchmarks/small_model.py --threads 1            # one thread each: CPU time barely moves under load
    python benchmarks/small_model.py --fused                # the minimal loop with fused AdamW too
    python benchmarks/small_model.py --minimal-activation gelu_new   # ... with GPT-2's own 7-op GELU

The model is a sub-1M-parameter byte-level GPT-2 (4 layers x 128 wide, 4 heads, vocab 257, seq 64, batch 12,
fp32, dropout 0) on the bundled Tiny Shakespeare, one process. At this size the model's own work is tens of
milliseconds per step on a CPU, so every per-step cost of a trainer shows.

- shardlm side: `shardlm train <overrides>` in its own process (`shardlm.cli.main`, the console script's
  entry point), with the defaults for everything that runs per step: metrics.jsonl and TensorBoard scalars
  every `train.log_every`=25 steps, console lines, fused AdamW, `train.loss_chunk_size` null (auto: the plain
  loss here). Only validation during training (`train.eval_every=0`: once, at the end) and the final sample
  (`train.sample_tokens=0`) are off; both run outside the timed window. Wall steps/s come from the `time_s`
  of its metrics.jsonl records; a hook on `MetricsLog.write` (one `time.process_time()` per record) adds the
  process CPU time at each record.
- minimal side: the same GPT-2 config (`shardlm.models.hf_config.model_config`) and init seed, the same batches in the
  same order (shardlm's TokenBlocks + GlobalSampler, stacked before the loop), `torch.optim.AdamW` with
  the same betas, weight-decay groups and warmup + cosine schedule (LambdaLR), and per step nothing but
  `model(input_ids, labels, shift_labels).loss` (HF's own loss) -> backward -> clip_grad_norm_ -> step ->
  scheduler step -> zero_grad.

Both sides exclude the first `--warmup` steps. Runs alternate (shardlm, minimal, minimal, shardlm, ...);
before each, the script waits (up to `--max-wait` s) until the CPUs are less than `--quiet` busy, records the
share other processes used during the run (`other_cpu`), and reruns it (up to `--retries` times) when that
share exceeds `--max-other`: on 2 cores a busy neighbour slows both OpenMP threads many-fold. The last line
is one JSON object: per side the median steps/s (wall clock, and per CPU-second of the process) with min/max
over the repeats, `ratio` (median shardlm / median minimal, wall), the per-pair ratios, and both sides'
training loss per 25-step interval and final validation loss on the same 96 held-out blocks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128}
SEQ, BATCH, LOG_EVERY, EVAL_BATCHES = 64, 12, 25, 8


def overrides(args, out_dir: str) -> list[str]:
    """The shardlm config of both sides; everything not named is shardlm's default."""
    return [f"model.n_layer={MODEL['n_layer']}", f"model.n_head={MODEL['n_head']}", f"model.n_embd={MODEL['n_embd']}",
            "model.tokenizer=bytes", "model.dropout=0.0", "data.train=shakespeare", f"data.seq_len={SEQ}",
            f"train.batch_size={BATCH}", f"train.max_steps={args.steps}", f"train.log_every={LOG_EVERY}",
            f"train.eval_batches={EVAL_BATCHES}", "train.eval_every=0", "train.sample_tokens=0",
            "parallel.precision=fp32", f"out_dir={out_dir}", *args.extra]


def rates(args, wall: dict[int, float], cpu: dict[int, float]) -> dict:
    """Steady-state steps/s from the clocks read after steps warmup, warmup + 25, ..., steps."""
    w, n = args.warmup, args.steps
    return {"steps_per_s": (n - w) / (wall[n] - wall[w]), "steps_per_cpu_s": (n - w) / (cpu[n] - cpu[w]),
            "interval_steps_per_s": [round(LOG_EVERY / (wall[s] - wall[s - LOG_EVERY]), 2)
                                     for s in range(w + LOG_EVERY, n + 1, LOG_EVERY)]}


# ---- the minimal loop (its own process) -------------------------------------------------------------
def run_minimal(args) -> dict:
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel

    from shardlm.config import load_config
    from shardlm.data import GlobalSampler, eval_shares, prepare_data
    from shardlm.distributed.process_group import Dist, LaunchInfo
    from shardlm.models.hf_config import model_config
    from shardlm.tokenizer import model_tokenizer

    cfg = load_config(None, overrides(args, "/tmp/unused"))
    t = cfg.train
    tok = model_tokenizer(cfg.model)
    train, val = prepare_data(cfg.data, tok, Dist(LaunchInfo("single"), torch.device("cpu")))
    order = GlobalSampler(len(train), t.seed).indices(0, BATCH * args.steps)
    batches = train.get(order).view(args.steps, BATCH, SEQ + 1)  # the same blocks, in the same order
    inputs, labels = batches[..., :-1].contiguous(), batches[..., 1:].contiguous()

    hf_cfg = model_config(cfg, tok)  # the same config and seeded init as shardlm's
    if args.minimal_activation:  # e.g. gelu_new, GPT-2's own (shardlm runs it as the fused gelu_pytorch_tanh)
        hf_cfg.activation_function = args.minimal_activation
    torch.manual_seed(t.seed)
    model = GPT2LMHeadModel(hf_cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), **({"fused": True} if args.fused else {}))

    def lr_factor(step: int) -> float:  # linear warmup, cosine to min_lr_ratio (shardlm's schedule)
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, args.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses, wall, cpu = [], {}, {}
    for i in range(args.steps):
        loss = model(input_ids=inputs[i], labels=labels[i], shift_labels=labels[i]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (i + 1) % LOG_EVERY == 0:  # the clocks at the steps where shardlm writes a record
            wall[i + 1], cpu[i + 1] = time.perf_counter(), time.process_time()

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():  # shardlm's end-of-training validation: the same blocks, mean token loss
        for indices in eval_shares(len(val), 0, 1, BATCH, EVAL_BATCHES):
            x = val.get(indices[indices >= 0])
            y = x[:, 1:].contiguous()
            total += model(input_ids=x[:, :-1], labels=y, shift_labels=y).loss.item() * y.numel()
            count += y.numel()
    step_losses = torch.stack(losses).double().numpy()
    intervals = [{"step": s, "loss": float(np.mean(step_losses[s - LOG_EVERY:s]))}
                 for s in range(LOG_EVERY, args.steps + 1, LOG_EVERY)]
    return {**rates(args, wall, cpu), "train_loss": intervals, "val_loss": total / count}


# ---- the shardlm side: the CLI in its own process ---------------------------------------------------
def run_shardlm(args) -> None:
    """`shardlm train`, observed: the process CPU time at each training record goes to stdout."""
    from shardlm import cli
    from shardlm.observe import metrics

    write = metrics.MetricsLog.write

    def observed(self, record: dict) -> None:
        write(self, record)
        if record.get("split") == "train":
            print(f"CPUMARK {record['step']} {time.process_time()}", flush=True)

    metrics.MetricsLog.write = observed
    cli.main(["train", *overrides(args, args.out)])


def shardlm_result(args, out_dir: Path, stdout: str) -> dict:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if r["split"] == "train"}
    val = [r for r in records if r["split"] == "val"]
    cpu = {int(s): float(c) for s, c in (x.split()[1:] for x in stdout.splitlines() if x.startswith("CPUMARK "))}
    return {**rates(args, {s: r["time_s"] for s, r in train.items()}, cpu),
            "train_loss": [{"step": s, "loss": r["loss"]} for s, r in sorted(train.items())],
            "val_loss": val[-1]["loss"] if val else None}


# ---- orchestration ----------------------------------------------------------------------------------
def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def wait_quiet(threshold: float, max_wait: float) -> float:
    """Wait until the CPUs are less than `threshold` busy over 2 s (we are idle meanwhile); returns that share."""
    deadline = time.time() + max_wait
    while True:
        b0, t0 = cpu_jiffies()
        time.sleep(2.0)
        b1, t1 = cpu_jiffies()
        busy = (b1 - b0) / max(1, t1 - t0)
        if busy < threshold or time.time() > deadline:
            return busy


def launch_once(side: str, args) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    out_dir = Path(tempfile.mkdtemp(prefix=f"small-model-{side}-"))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--out", str(out_dir),
           "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--fused"] if args.fused else []),
           *([f"--minimal-activation={args.minimal_activation}"] if args.minimal_activation else []),
           *[f"--extra={e}" for e in args.extra]]
    busy_before = wait_quiet(args.quiet, args.max_wait)
    child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    b0, t0 = cpu_jiffies()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    b1, t1 = cpu_jiffies()
    child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if side == "shardlm":
        result = shardlm_result(args, out_dir, proc.stdout)
    else:
        result = json.loads(next(x[7:] for x in proc.stdout.splitlines() if x.startswith("RESULT ")))
    shutil.rmtree(out_dir, ignore_errors=True)
    own = (child1.ru_utime + child1.ru_stime - child0.ru_utime - child0.ru_stime) * os.sysconf("SC_CLK_TCK")
    result["other_cpu"] = max(0.0, (b1 - b0 - own) / max(1, t1 - t0))  # share of all CPUs used by others
    result["busy_before"] = busy_before
    return result


def launch(side: str, args) -> dict:
    """One run of `side`, rerun (up to --retries times) while others used more than --max-other of the CPUs."""
    for attempt in range(args.retries + 1):
        result = launch_once(side, args)
        result["discarded_runs"] = attempt
        print(f"{side}: {result['steps_per_s']:.2f} steps/s, {result['steps_per_cpu_s']:.2f} per CPU-s "
              f"(others used {result['other_cpu']:.0%} of the CPUs)", file=sys.stderr, flush=True)
        if result["other_cpu"] <= args.max_other:
            break
    return result


def summary(runs: list[dict]) -> dict:
    wall, cpu = [r["steps_per_s"] for r in runs], [r["steps_per_cpu_s"] for r in runs]
    return {"steps_per_s": statistics.median(wall), "min": min(wall), "max": max(wall),
            "runs": [round(x, 2) for x in wall], "steps_per_cpu_s": statistics.median(cpu),
            "cpu_runs": [round(x, 2) for x in cpu], "other_cpu": [round(r["other_cpu"], 3) for r in runs],
            "discarded_runs": sum(r["discarded_runs"] for r in runs),
            "train_loss": runs[0]["train_loss"], "val_loss": runs[0]["val_loss"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["shardlm", "minimal"], help="internal: run one side in this process")
    p.add_argument("--out", help="internal: the shardlm side's out_dir")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50, help="first steps left out of steps/s (a multiple of 25)")
    p.add_argument("--repeats", type=int, default=5, help="pairs of runs, alternating shardlm / minimal")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of both sides; 0 = torch's default")
    p.add_argument("--quiet", type=float, default=0.15, help="wait until the CPUs are less busy than this share")
    p.add_argument("--max-wait", type=float, default=300.0, help="seconds to wait for quiet before each run")
    p.add_argument("--max-other", type=float, default=0.1, help="rerun a run when others used more of the CPUs")
    p.add_argument("--retries", type=int, default=3, help="reruns of one run at most")
    p.add_argument("--fused", action="store_true", help="the minimal loop with fused AdamW too (attribution)")
    p.add_argument("--minimal-activation", default="", help="the minimal loop's GPT-2 activation_function "
                   "instead of shardlm's (attribution), e.g. gelu_new")
    p.add_argument("--extra", action="append", default=[], help="extra shardlm override for both sides")
    args = p.parse_args()
    if args.warmup % LOG_EVERY or not LOG_EVERY <= args.warmup < args.steps or args.steps % LOG_EVERY:
        raise SystemExit(f"--warmup and --steps must be multiples of {LOG_EVERY} with warmup < steps")
    if args.side:
        sys.path.insert(0, str(ROOT))
        if args.side == "shardlm":
            run_shardlm(args)
        else:
            print("RESULT " + json.dumps(run_minimal(args)), flush=True)
        return
    import torch
    import transformers

    runs: dict[str, list[dict]] = {"shardlm": [], "minimal": []}
    for i in range(args.repeats):
        for side in ("shardlm", "minimal") if i % 2 == 0 else ("minimal", "shardlm"):
            runs[side].append(launch(side, args))
    ours, theirs = summary(runs["shardlm"]), summary(runs["minimal"])
    pairs = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs["shardlm"], runs["minimal"], strict=True)]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(ours["train_loss"], theirs["train_loss"], strict=True)]
    print(json.dumps({
        "benchmark": "small_model", "date": datetime.date.today().isoformat(),
        "device": f"cpu ({os.cpu_count()} cores)", "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": args.threads or torch.get_num_threads(), "command": " ".join(["python", *sys.argv]),
        "settings": {"model": MODEL, "vocab": 257, "seq": SEQ, "batch": BATCH, "steps": args.steps,
                     "warmup_excluded": args.warmup, "repeats": args.repeats, "minimal_fused_adamw": args.fused,
                     "minimal_activation": args.minimal_activation or "as shardlm's",
                     "shardlm_overrides": overrides(args, "TMP")},
        "shardlm": ours, "minimal": theirs,
        "ratio": ours["steps_per_s"] / theirs["steps_per_s"],
        "ratio_pairs": [round(x, 3) for x in pairs],
        "ratio_cpu": ours["steps_per_cpu_s"] / theirs["steps_per_cpu_s"],
        "max_train_loss_diff": max(diffs),
        "val_loss_diff": abs(ours["val_loss"] - theirs["val_loss"]),
    }))


if __name__ == "__main__":
    main()
