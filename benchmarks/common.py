"""What the benchmark scripts share. Each script imports only this module and shardlm, never another script: one
script uses another by running it (`python benchmarks/NAME.py ...`) and reading the JSON it prints. The one
exception is a demo that extends another demo's flow: kto_demo.py and kto_labels.py reuse dpo_demo.py's and
dpo_pairs.py's functions (their runs, exact match, sampling and scoring), which stay where the DPO demo defines them.

A script runs as `python benchmarks/NAME.py` (or under torchrun), which puts this folder first on sys.path, so
`from common import ...` finds this file. Tests that test a script load it by its path (tests/test_gpu_check.py).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
# WikiText-2's train split where it exists beside the checkout, else the bundled Tiny Shakespeare
DATA = ROOT.parent / "shared" / "data" / "wikitext-2" / "train.txt"
DEFAULT_DATA = str(DATA if DATA.is_file() else "shakespeare")
DATA_HELP = ("training text (default: ../shared/data/wikitext-2/train.txt where it exists, else the bundled Tiny "
             "Shakespeare: shakespeare)")
SIZES = {"124M": (12, 12, 768), "350M": (24, 16, 1024), "774M": (36, 20, 1280), "1558M": (48, 25, 1600)}


def standard_template() -> str:
    """The chat template of the comparisons with TRL (benchmarks/sft.py, preference.py): Qwen2.5's own, ChatML with
    a default system message, with the `{% generation %}` markers TRL adds to it (trl/chat_templates, as TRL ships
    it): a stock template and TRL's own defaults, not one shaped to agree."""
    import importlib.resources

    return (importlib.resources.files("trl") / "chat_templates" / "qwen2_5_training.jinja").read_text()


def cpu_name() -> str:
    """The processor's name for a benchmark's record: `lscpu`'s Model name, else /proc/cpuinfo's, else platform's."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    info = Path("/proc/cpuinfo")
    if info.exists():
        return next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                     if line.startswith("model name")), platform.processor())
    return platform.processor()


def dims(size: str) -> tuple[int, int, int]:
    """(n_layer, n_head, n_embd) of a named GPT-2 size (SIZES) or of `LxHxC`, e.g. `2x2x64`."""
    return SIZES[size] if size in SIZES else tuple(int(x) for x in size.split("x"))  # type: ignore[return-value]


def gpt2_overrides(size: str, seq: int, batch: int, precision: str, data: str, extra: list[str]) -> list[str]:
    """shardlm's overrides for a GPT-2 of `size` from scratch on GPT-2 BPE (benchmarks/mfu.py's measurement),
    `extra` last (they win)."""
    layers, heads, width = dims(size)
    return [f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={width}",
            f"model.n_positions={seq}", "model.tokenizer=gpt2", f"data.seq_len={seq}",
            f"data.train={data}", f"train.batch_size={batch}", "train.max_steps=1000000",
            f"parallel.precision={precision}", "log.tensorboard=false",
            "out_dir=/tmp/shardlm-mfu", *extra]


def shardlm_overrides(s: dict, data: str, extra: list[str]) -> list[str]:
    """shardlm's side of a comparison with HF Trainer (the settings `s` of benchmarks/vs_hf_trainer.py): no
    dropout, AdamW as HF's, no evaluation, sample, TensorBoard or final checkpoint."""
    m = s["model"]
    return [f"model.n_layer={m['n_layer']}", f"model.n_head={m['n_head']}", f"model.n_embd={m['n_embd']}",
            f"model.n_positions={s['seq']}", f"model.tokenizer={s.get('tokenizer', 'gpt2')}", "model.dropout=0.0",
            f"model.vocab_multiple={s.get('vocab_multiple', 1)}",
            f"data.train={data}", f"data.seq_len={s['seq']}", f"train.batch_size={s['batch']}",
            f"train.max_steps={s['steps']}",
            "train.lr=6e-4", "train.warmup_steps=2", "train.weight_decay=0.1", "train.grad_clip=1.0",
            f"parallel.precision={s['precision']}", "train.sample_tokens=0", "train.eval_every=0",
            "log.tensorboard=false", "log.progress=none", "checkpoint.save_final=false",
            "out_dir=/tmp/shardlm-bench-run", *extra]


def example_run_overrides(s: dict, folder: Path, work: Path, steps: int, data: list[str]) -> list[str]:
    """shardlm's side of a comparison with TRL (benchmarks/sft.py, preference.py: the settings `s`) on the model in
    `folder`: `data` (the files and their handling), then AdamW (0.9, 0.95) without decay, clip 1, fp32, nothing
    but the steps (no evaluation, sample, TensorBoard or final checkpoint)."""
    return [f"model.name={folder}", *data, f"data.seq_len={s['seq']}", f"data.cache_dir={work / 'shardlm-cache'}",
            f"train.batch_size={s['batch']}", f"train.max_steps={steps}", f"train.lr={s['lr']}",
            f"train.warmup_steps={s['lr_warmup']}", "train.weight_decay=0.0", "train.beta1=0.9", "train.beta2=0.95",
            "train.grad_clip=1.0", f"train.seed={s['seed']}", "train.eval_batches=0", "train.eval_every=0",
            "train.sample_tokens=0", "parallel.precision=fp32", "log.tensorboard=false", "log.progress=none",
            "checkpoint.save_final=false", f"out_dir={work / 'shardlm-run'}"]


class HFBlocks:
    """shardlm's blocks in shardlm's order as an HF Trainer dataset (HF shifts the labels inside the model)."""

    def __init__(self, blocks, order):
        self.blocks, self.order = blocks, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        row = self.blocks.get([self.order[i]])[0]
        return {"input_ids": row[:-1], "labels": row[:-1]}


def cap_memory(cap_gb: float | None) -> None:
    """Let this process allocate at most `cap_gb` GiB of CUDA memory (no-op on CPU or without a cap)."""
    import torch

    if cap_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 2**30 / total))


def tail(proc: subprocess.CompletedProcess, chars: int = 2500) -> str:
    """A failed subprocess in a few lines: its exit code, the end of its stdout and of its stderr."""
    return f"exit {proc.returncode}: " + (proc.stdout[-chars // 2:] + "\n" + proc.stderr[-chars:]).strip()


def shardlm(*args: str) -> str:
    """`python -m shardlm ARGS` from the repository root: its stdout, or the run's tail as the exit message."""
    proc = subprocess.run([sys.executable, "-m", "shardlm", *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"shardlm {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def emit(out: dict, path: str | None, compact: bool = False) -> None:
    """Print a result as JSON, and write it indented to `path` when one is given (--out). `compact`: printed as one
    line, the last of the output (what a script that runs another reads)."""
    import json

    text = json.dumps(out, indent=1)
    if path:
        Path(path).write_text(text + "\n")
    print(json.dumps(out, separators=(",", ":")) if compact else text)


def children_cpu_s() -> float:
    """CPU seconds of the finished child processes (the trainings a demo ran)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---- the chat demos' held-out scoring (distill_demo, dpo_demo, kto_demo) -----------------------------------
def heldout_answers(export: Path, heldout: int) -> list[dict]:
    """The first `heldout` chat_tasks_heldout prompts: each one's task and whether the export's greedy answer equals
    the reference, by shardlm's own exact-match code (shardlm.inference.exact_match, `shardlm eval --exact-match`'s
    rule), the task read from the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlm.config import DataConfig
    from shardlm.inference.exact_match import held_out_examples, score

    sys.path.insert(0, str(ROOT / "shardlm" / "assets" / "chat_tasks"))
    from make_pairs import parse

    examples = held_out_examples("chat_tasks_heldout", "validation", DataConfig(), None, heldout)
    tok = AutoTokenizer.from_pretrained(export)
    with torch.no_grad():
        scored = score(AutoModelForCausalLM.from_pretrained(export), tok, examples, quiet=True)
    out = []
    for example, s in zip(examples, scored, strict=True):
        last = max(i for i, m in enumerate(example.messages) if m["role"] == "assistant")
        out.append({"task": parse(example.messages[last - 1]["content"])[0], "exact": bool(s.exact)})
    return out


def exact_rate(rows: list[dict]) -> float:
    return sum(r["exact"] for r in rows) / len(rows)


def per_task(rows: list[dict]) -> dict:
    """{task: "right/prompts"} of heldout_answers' rows."""
    tasks: dict[str, list[int]] = {}
    for r in rows:
        right = tasks.setdefault(r["task"], [0, 0])
        right[0] += r["exact"]
        right[1] += 1
    return {task: f"{hits}/{n}" for task, (hits, n) in sorted(tasks.items())}


def sign_test(base: list[list[dict]], new: list[list[dict]]) -> dict:
    """Prompts right only with the new arm (gained) against right only with the base (lost), pooled over the pairs
    of runs (a prompt counted once per pair); two-sided exact binomial p at 1/2."""
    pairs = [(b, a) for bs, ns in zip(base, new, strict=True) for b, a in zip(bs, ns, strict=True)]
    gained = sum(not b["exact"] and a["exact"] for b, a in pairs)
    lost = sum(b["exact"] and not a["exact"] for b, a in pairs)
    n = gained + lost
    tail = sum(math.comb(n, k) for k in range(0, min(gained, lost) + 1)) / 2**n if n else 1.0
    return {"gained": gained, "lost": lost, "p_two_sided": float(f"{min(1.0, 2 * tail):.3g}")}


# ---- the versus-a-peer harness (grpo_vs_trl, distill_vs_trl): each side a child process of the script ----------
def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time): on a shared machine the CPU time is the steadier."""
    return time.perf_counter(), time.process_time()


def launch_side(script: str, side: str, s: dict, work: Path) -> dict:
    """Run `script --side SIDE` as a child with the settings `s` (its threads, offline hubs) and return the JSON it
    printed on its `RESULT ` line, with the child's wall seconds."""
    import json

    cmd = [sys.executable, str(Path(script).resolve()), "--side", side, "--work", str(work),
           "--settings", json.dumps(s)]
    env = {**os.environ, "OMP_NUM_THREADS": str(s["threads"]), "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not rows:
        raise SystemExit(f"{side} failed: {tail(proc)}")
    print(f"{side}: {time.perf_counter() - began:.0f}s", file=sys.stderr, flush=True)
    return {**rows[0], "process_s": time.perf_counter() - began}


def trl_machine(threads: int) -> dict:
    """The machine and the versions a comparison with TRL ran on."""
    import torch
    import transformers
    import trl

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": threads,
            "load_average_at_end": list(os.getloadavg()), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "python": platform.python_version()}
