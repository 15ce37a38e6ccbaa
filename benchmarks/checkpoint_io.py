"""Checkpoint save/load time and peak memory for GPT-2 124M + AdamW state, 1 and 2 ranks, sync and async.

    python benchmarks/checkpoint_io.py            # spawns the worlds, prints one JSON object
Each world runs under torchrun (gloo on CPU, NCCL on GPU) and uses shardlm's own model/FSDP/checkpoint code.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def rss_gb() -> float:
    """This process's peak RSS so far, GiB."""
    import torch

    from shardlm.observe.hardware import peak_memory_bytes

    return peak_memory_bytes(torch.device("cpu")) / 2**30


def worker(out_dir: str, mode: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from shardlm.checkpoint.state import model_parts
    from shardlm.config import load_config
    from shardlm.models.hf_config import model_config
    from shardlm.tokenizer import load_tokenizer
    from shardlm.training.build import build_model, build_optimizer, init_dist

    cfg = load_config(None, ["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "model.n_positions=1024",
                             "model.tokenizer=gpt2", "data.seq_len=64", f"out_dir={out_dir}"])
    d, pl = init_dist(cfg)
    model = build_model(cfg, model_config(cfg, load_tokenizer("gpt2")), pl, d)
    opt, _ = build_optimizer(model, cfg, 10)
    tokens = torch.randint(0, 50257, (1, 65), device=d.device)
    loss, _ = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()  # creates the AdamW state
    state = {name: part.state_dict() for name, part in model_parts(model, opt).items()}  # what a checkpoint shards
    path = os.path.join(out_dir, "ckpt")
    d.barrier()
    before, began = rss_gb(), time.perf_counter()
    if mode == "async":
        future = dcp.async_save(state, checkpoint_id=path)
        blocked = time.perf_counter() - began
        future.result()
    else:
        dcp.save(state, checkpoint_id=path)
        blocked = time.perf_counter() - began
    d.barrier()
    save_s = time.perf_counter() - began
    save_peak = rss_gb() - before
    began = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    d.barrier()
    load_s = time.perf_counter() - began
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    if d.is_main:
        print("RESULT " + json.dumps({"ranks": d.world_size, "mode": mode, "save_s": round(save_s, 2),
                                      "training_blocked_s": round(blocked, 2), "load_s": round(load_s, 2),
                                      "rss_growth_during_save_gb_rank0": round(save_peak, 2),
                                      "peak_rss_gb_rank0": round(rss_gb(), 2), "checkpoint_gb": round(size / 1e9, 2)}),
              flush=True)
    from shardlm.distributed.process_group import shutdown

    shutdown(0)


def main() -> None:
    import torch

    results = []
    for ranks in (1, 2):
        for mode in ("sync", "async"):
            tmp = tempfile.mkdtemp(prefix="shardlm-ckpt-bench-")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   __file__, "--worker", tmp, mode]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            shutil.rmtree(tmp, ignore_errors=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            results.append(json.loads(lines[0][7:]) if lines else {"ranks": ranks, "mode": mode,
                                                                      "error": proc.stderr[-500:]})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    print(json.dumps({"benchmark": "checkpoint_io", "model": "gpt2-124M + AdamW", "device": device,
                      "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                      "results": results}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
