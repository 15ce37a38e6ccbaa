"""Peak memory and time of one forward + backward of distillation's loss: chunked (shardlm.models.distill_loss)
against whole logits (`full_distill_loss`: both models' (positions x vocab) logits and autograd, as TRL's
GKDTrainer computes them), on CPU.

Each variant runs in a fresh child process (`--child VARIANT`): random student and teacher hidden states and heads
(GPT-2's vocabulary, a 768-wide student, a 1024-wide teacher, seq 512 x batch 4, every position a target), one
forward + backward measured for its peak resident memory above what was resident before it (Linux's VmHWM, reset
through /proc/self/clear_refs just before), then two more timed. The gradients' own memory (hidden and head) is
in both. Prints one JSON object and writes it to benchmarks/results/distill_memory_cpu.json (--out).

    python benchmarks/distill_memory.py                # full, chunks of 1024 and 256 positions
    python benchmarks/distill_memory.py --batch 8 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, cpu_name


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(args: argparse.Namespace) -> dict:
    import torch

    from shardlm.models.distill_loss import LiveTeacher, distill_loss

    torch.manual_seed(0)
    n, v = args.batch * args.seq, args.vocab
    hidden = torch.randn(n, args.student).requires_grad_()
    weight = (0.02 * torch.randn(v, args.student)).requires_grad_()
    teacher = LiveTeacher(torch.randn(n, args.teacher), 0.02 * torch.randn(v, args.teacher))
    targets = torch.randint(0, v, (n,))
    chunk = 0 if args.child == "full" else int(args.child)

    def step() -> float:
        hidden.grad = weight.grad = None
        began = time.perf_counter()
        loss, _ = distill_loss(hidden, weight, None, targets, teacher, beta=0.5, temperature=1.0, alpha=0.5,
                               vocab=v, chunk_size=chunk)
        (loss / n).backward()
        return time.perf_counter() - began

    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    first = step()
    peak = (_status_kb("VmHWM") - before) * 1024
    seconds = min(step() for _ in range(2))
    return {"variant": args.child, "chunk_size": chunk, "peak_bytes": peak, "peak_gib": round(peak / 2**30, 3),
            "first_seconds": round(first, 2), "seconds": round(seconds, 2),
            "tokens_per_s": round(n / seconds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--student", type=int, default=768, help="student hidden width")
    p.add_argument("--teacher", type=int, default=1024, help="teacher hidden width")
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="chunk sizes (positions)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distill_memory_cpu.json"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    shape = [f"--batch={args.batch}", f"--seq={args.seq}", f"--vocab={args.vocab}", f"--student={args.student}",
             f"--teacher={args.teacher}"]
    runs = []
    for variant in ["full", *map(str, args.chunks)]:
        out = subprocess.run([sys.executable, __file__, *shape, f"--child={variant}"], capture_output=True,
                             text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    full = runs[0]["peak_bytes"]
    for r in runs[1:]:
        r["peak_vs_full"] = round(r["peak_bytes"] / full, 3)
        r["time_vs_full"] = round(r["seconds"] / runs[0]["seconds"], 3)
    result = {"what": "one forward + backward of distill_loss (beta 0.5, temperature 1, alpha 0.5: the JSD, the "
                      "next-token loss and both entropies), peak resident memory above the inputs",
              "positions": args.batch * args.seq, "batch": args.batch, "seq": args.seq, "vocab": args.vocab,
              "student_hidden": args.student, "teacher_hidden": args.teacher, "cpu": cpu_name(),
              "goal": "chunked peak <= 0.5 x full", "runs": runs}
    text = json.dumps(result, indent=1)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
