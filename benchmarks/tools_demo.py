"""What tools are for in online RL, measured end to end: a tiny model learns to call a calculator for products it
cannot compute, then GRPO with the tool in the loop (grpo.tools) sharpens its calls. Held-out greedy accuracy with
the tool against the same model trained to answer alone, the share of episodes that call the tool correctly, the
curve and the CPU minutes. `make demo-tools` runs it; its last line is one JSON object.

    python benchmarks/tools_demo.py [--work runs/tools] [--seed 0] [--warmup 2000] [--out FILE] [key=value ...]

The task: "What is 347 x 582?" (two 3-digit numbers); the answer is the product. The tool: multiply(a, b).
- warm-up: --warmup conversations written as the template renders a tool call (the call, the tool's result, the
  answer copied from it), instruction-tuned into a byte-level Llama from random weights (4 x 128);
- without tools: the same model and steps on the same questions answered directly (it must multiply alone);
- GRPO: from the warm-up's export, grpo.tools=[calc.py:multiply], rewarded by exact match of the episode's last
  turn, on prompts none of which is held out (key=value arguments go to it).
A salted hash puts a tenth of all number pairs in the held-out split (400 prompts); every phase leaves them out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

from common import ROOT, children_cpu_s, cpu_name, emit, shardlm, sign_test

TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CALC = '''def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
'''
SYSTEM = "Tools: multiply "  # what the template writes for tools=[multiply]: the warm-up's conversations hold it
RUNS = ("warmup", "alone", "grpo")


def held_out(a: int, b: int, seed: int) -> bool:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{a}x{b}".encode(), digest_size=4).digest(), "little") % 10 == 0


def pairs(rng: random.Random, n: int, seed: int, heldout: bool) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if held_out(a, b, seed) == heldout:
            out.append((a, b))
    return out


def ask(a: int, b: int) -> str:
    return f"What is {a} x {b}?"


def call(a: int, b: int) -> str:
    return '<tool_call>{"name": "multiply", "arguments": ' + json.dumps({"a": a, "b": b}) + "}</tool_call>"


def write_task(work: Path, seed: int, warmup: int, prompts: int = 4000, heldout: int = 400) -> None:
    """tokenizer/ (bytes, ChatML's tokens, TEMPLATE), calc.py, warmup.jsonl (tool-calling conversations),
    alone.jsonl (the same questions answered directly), prompts.jsonl and heldout.jsonl (RL's {"prompt": [user],
    "answer"})."""
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    from shardlm.tokenizer import byte_tokenizer, set_chat_template

    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")  # ChatML's two special tokens: a turn ends at <|im_end|>
    tok.chat_template = TEMPLATE  # ChatML that renders Hermes tool calls, its tools as a system turn
    tok.save_pretrained(work / "tokenizer")
    (work / "calc.py").write_text(CALC)
    lines = {"warmup.jsonl": [], "alone.jsonl": []}
    for a, b in pairs(rng, warmup, seed, heldout=False):
        user = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask(a, b)}]
        lines["warmup.jsonl"].append({"messages": [*user, {"role": "assistant", "content": call(a, b)},
                                                   {"role": "tool", "content": str(a * b)},
                                                   {"role": "assistant", "content": str(a * b)}]})
        lines["alone.jsonl"].append({"messages": [*user, {"role": "assistant", "content": str(a * b)}]})
    lines["prompts.jsonl"] = [{"prompt": [{"role": "user", "content": ask(a, b)}], "answer": str(a * b), "a": a,
                               "b": b} for a, b in pairs(rng, prompts, seed, heldout=False)]
    lines["heldout.jsonl"] = [{"prompt": [{"role": "user", "content": ask(a, b)}], "answer": str(a * b), "a": a,
                               "b": b} for a, b in pairs(rng, heldout, seed, heldout=True)]
    for name, rows in lines.items():
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def score(export: Path, work: Path, tools: bool) -> dict:
    """Greedy episodes on the held-out prompts: exact match of the last turn, and (with tools) the share that call
    multiply once with the question's numbers and no failed call."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlm.config import GrpoConfig
    from shardlm.data.prompts import RLPrompt
    from shardlm.objectives.rl.multiturn import sample_episodes
    from shardlm.objectives.rl.rollout import sampling_params
    from shardlm.objectives.rl.sampling import TransformersSampler
    from shardlm.objectives.rl.tools import load_toolbox
    from shardlm.tokenizer import end_of_turn_id

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    rows = [json.loads(line) for line in (work / "heldout.jsonl").read_text().splitlines()]
    g = GrpoConfig(group=1, max_completion_length=160, temperature=1.0, tools=[f"{work / 'calc.py'}:multiply"])
    box = load_toolbox(g, tok) if tools else None
    eot = end_of_turn_id(tok)
    params = sampling_params(g, [eot, tok.eos_token_id], 0)
    params = type(params)(**{**params.__dict__, "temperature": 0.0})
    sampler = TransformersSampler(model, tok.eos_token_id, max_rows=100)
    right, calling = [], 0
    with torch.no_grad():
        for start in range(0, len(rows), 100):
            chunk = rows[start:start + 100]
            prompts = [RLPrompt(r["prompt"], {}) for r in chunk]
            if box is None:
                system = [{"role": "system", "content": SYSTEM}]  # the alone model was asked as the warm-up was
                ids = [tok.apply_chat_template(system + r["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"] for r in chunk]
                out = sampler.sample(ids, list(range(start, start + len(chunk))), params)
                answers = [tok.decode(c, skip_special_tokens=True).strip() for c in out.completions]
            else:
                ids = [tok.apply_chat_template(r["prompt"], tools=box.schemas, add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"] for r in chunk]
                ep = sample_episodes(sampler, tok, box, prompts, ids, list(range(start, start + len(chunk))), params,
                                     eot)
                answers = [str(m[-1]["content"]).strip() for m in ep.messages]
                for m, r in zip(ep.messages, chunk, strict=True):
                    calls = [c for turn in m if turn["role"] == "assistant" for c in turn.get("tool_calls", [])]
                    calling += len(calls) == 1 and calls[0]["function"]["arguments"] == {"a": r["a"], "b": r["b"]}
            right += [{"exact": a == r["answer"]} for a, r in zip(answers, chunk, strict=True)]
    out = {"accuracy": round(sum(x["exact"] for x in right) / len(right), 4), "rows": right}
    if tools:
        out["calls_correctly"] = round(calling / len(rows), 4)
    return out


def timed(*args: str) -> float:
    before = children_cpu_s()
    shardlm(*args)
    return children_cpu_s() - before


def curve(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "reward", "tools/call_frequency", "tools/failure_frequency", "tools/turns", "exact_match")
    return {split: [{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keep if k in r}
                    for r in records if r.get("split") == split] for split in ("train", "val")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(ROOT / "runs" / "tools"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2000, help="tool-calling conversations the warm-up trains on")
    ap.add_argument("--warmup-steps", type=int, default=400)
    ap.add_argument("--data-only", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value for the GRPO run")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    made = [name for name in RUNS if (work / name).exists()]
    if made and not args.data_only:
        raise SystemExit(f"{work} already holds this demo's runs ({', '.join(made)}): remove them (rm -r "
                         f"{' '.join(str(work / name) for name in made)}) or give another --work folder.")
    began = time.time()
    write_task(work, args.seed, args.warmup)
    if args.data_only:
        print(f"wrote {work}/warmup.jsonl, alone.jsonl, prompts.jsonl and heldout.jsonl (seed {args.seed})")
        return
    quiet = ("log.tensorboard=false", "log.progress=none")
    model = ["model.arch=llama", "model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.dropout=0.0",
             f"model.tokenizer={work / 'tokenizer'}", "data.seq_len=256"]
    sft = ["train.objective=sft", "train.batch_size=32", f"train.max_steps={args.warmup_steps}", "train.lr=3e-3",
           "train.warmup_steps=30", "train.eval_every=0", "data.val_fraction=0.02", f"train.seed={args.seed}",
           "train.sample_tokens=0"]
    cpu = {}
    for name, data in (("warmup", "warmup.jsonl"), ("alone", "alone.jsonl")):
        cpu[name] = timed("train", *model, *sft, f"data.train={work / data}", f"out_dir={work / name}", *quiet)
        shardlm("export", str(work / name), str(work / f"{name}-hf"))
    before, alone = score(work / "warmup-hf", work, True), score(work / "alone-hf", work, False)
    cpu["grpo"] = timed("train", f"model.name={work / 'warmup-hf'}", "train.objective=grpo",
                        f"data.train={work / 'prompts.jsonl'}", f"data.val={work / 'heldout.jsonl'}",
                        "data.seq_len=256", f"grpo.tools=[{work / 'calc.py'}:multiply]", "grpo.group=8",
                        "grpo.max_completion_length=160", "train.batch_size=128", "train.max_steps=40",
                        "train.lr=2e-4", "train.warmup_steps=5", "train.eval_every=10", "train.eval_batches=1",
                        "grpo.rewards=[exact_match]", f"train.seed={args.seed}", f"out_dir={work / 'grpo'}", *quiet,
                        *args.overrides)
    shardlm("export", str(work / "grpo"), str(work / "grpo-hf"))
    after = score(work / "grpo-hf", work, True)
    import torch

    out = {"benchmark": "tools_demo", "command": " ".join(["python", "benchmarks/tools_demo.py", *sys.argv[1:]]),
           "seed": args.seed, "warmup_conversations": args.warmup, "heldout": 400,
           "with_tools_before": before["accuracy"], "with_tools_after": after["accuracy"],
           "without_tools": alone["accuracy"],
           "calls_correctly_before": before["calls_correctly"], "calls_correctly_after": after["calls_correctly"],
           "sign_test_grpo": sign_test([before["rows"]], [after["rows"]]),
           "sign_test_tools_vs_alone": sign_test([alone["rows"]], [after["rows"]]),
           "cpu_minutes": {k: round(v / 60, 2) for k, v in cpu.items()},
           "wall_minutes": round((time.time() - began) / 60, 1), "curve": curve(work / "grpo"),
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__},
           "note": "greedy on the 400 held-out products (no phase trained on them); with tools: episodes whose tool "
                   "calls run (the last turn scored); without: the same model and steps trained to answer directly"}
    emit(out, args.out, compact=True)


if __name__ == "__main__":
    main()
