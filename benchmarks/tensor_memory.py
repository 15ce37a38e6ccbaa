"""Per-rank memory under tensor parallelism: on 2 CPU ranks (gloo), FSDP2 alone against `parallel.tensor=2`, the
same Llama-shaped model and the same rows per rank per micro-step. Each rank counts, over one training step, the
bytes of its parameters' local shards, of its optimizer state and of what autograd keeps for the backward (every
tensor packed by a saved-tensors hook, each storage once: the activations), and `shardlm estimate`'s figures for the
same config beside them. Prints one JSON object.

    python benchmarks/tensor_memory.py [--layers 4 --width 1024 --heads 16 --seq 1024 --batch 2] [--out FILE]

Why these counts and not RSS: on a CPU, RSS mixes in the allocator's caches and gloo's buffers, which move by more
than the difference measured; what autograd keeps is exact, and is what TP divides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {"fsdp": [], "tensor_2": ["parallel.tensor=2"]}


def overrides(a: argparse.Namespace, out: str) -> list[str]:
    return ["model.arch=llama", f"model.n_layer={a.layers}", f"model.n_embd={a.width}", f"model.n_head={a.heads}",
            f"model.n_kv_head={a.heads}", f"data.seq_len={a.seq}", f"model.n_positions={a.seq}",
            f"train.batch_size={a.batch}", "train.max_steps=2", "train.eval_every=0", "train.sample_tokens=0",
            "checkpoint.every=0", "checkpoint.save_final=false", "log.tensorboard=false", "log.progress=none",
            "parallel.compile=false", "parallel.fsdp=true", f"out_dir={out}"]


def measure(args: list[str]) -> dict:
    """Run under torchrun: one step of the Trainer, counted on this rank."""
    import torch

    from shardlm.config import load_config
    from shardlm.distributed.shards import local_shard
    from shardlm.training.trainer import Trainer

    trainer = Trainer.from_config(load_config("shakespeare_tiny", args))
    trainer.train_step()  # the optimizer state exists from here on
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):  # FSDP2's gathered weights and TP's split ones are parameters
            storage = local_shard(t).untyped_storage()  # a DTensor activation: this rank's piece
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train_step()
    state = [v for s in trainer.run.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    row = {"parameters_gib": sum(local_shard(p).nbytes for p in trainer.model.parameters()) / 2**30,
           "optimizer_state_gib": sum(local_shard(t).nbytes for t in state) / 2**30,
           "activations_gib": sum(saved.values()) / 2**30}
    torch.distributed.destroy_process_group()
    return row


def estimated(a: argparse.Namespace, extra: list[str]) -> dict:
    from shardlm.config import load_config
    from shardlm.preflight.estimate import estimate
    from shardlm.tokenizer import model_tokenizer

    cfg = load_config("shakespeare_tiny", [*overrides(a, "unused"), *extra])
    est = estimate(cfg, model_tokenizer(cfg.model), 2)
    return {k: round(v / 2**30, 4) for k, v in est.components.items()} | {"peak_gib": round(est.peak_bytes / 2**30, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--rank-side", nargs="*", help="internal: measure under torchrun with these overrides")
    a = ap.parse_args()
    if a.rank_side is not None:
        row = measure(a.rank_side)
        print("RESULT " + json.dumps({"rank": int(os.environ.get("RANK", 0)), **row}), flush=True)
        return
    import torch
    from common import emit

    rows = {}
    with tempfile.TemporaryDirectory(prefix="shardlm-tp-memory-") as tmp:
        for name, extra in VARIANTS.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--rank-side", *overrides(a, str(Path(tmp) / name)), *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            found = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not found:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
            rank0 = next(r for r in found if r["rank"] == 0)
            rows[name] = {k: round(v, 4) for k, v in rank0.items() if k != "rank"} | {"estimate": estimated(a, extra)}
    base = rows["fsdp"]
    ratios = {k: round(rows["tensor_2"][k] / base[k], 3) for k in ("parameters_gib", "optimizer_state_gib",
                                                                    "activations_gib")}
    out = {"benchmark": "tensor_memory", "command": " ".join(["python", "benchmarks/tensor_memory.py", *sys.argv[1:]]),
           "model": {"arch": "llama", "layers": a.layers, "width": a.width, "heads": a.heads, "mlp": "Llama's",
                     "seq": a.seq, "rows_per_rank": a.batch, "precision": "fp32"},
           "ranks": 2, "rows": rows, "tensor_2_vs_fsdp": ratios,
           "machine": {"device": "cpu (gloo)", "cores": os.cpu_count(), "torch": torch.__version__},
           "note": "rank 0's counts over one step: parameters and optimizer state are the local shards' bytes; "
                   "activations are the storages autograd saved for the backward (each once, weights excluded)"}
    emit(out, a.out, compact=True)


if __name__ == "__main__":
    main()
