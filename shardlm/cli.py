"""`shardlm train | eval | generate | export | plot`: each subcommand is a plain function."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import traceback

from shardlm import ShardlmError, __version__


def _split_config(rest: list[str]) -> tuple[list[str], list[str]]:
    """Leading arguments without `=` are config files (later ones win); the rest are overrides."""
    files = []
    while rest and "=" not in rest[0]:
        files, rest = [*files, rest[0]], rest[1:]
    return files, rest


def launch_torchrun(args: argparse.Namespace, rest: list[str]) -> int:
    """`shardlm train --nproc N ...` re-runs itself under torchrun on this node."""
    torchrun = shutil.which("torchrun") or None
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", f"--nproc-per-node={args.nproc}"]
    if args.max_restarts:
        cmd += [f"--max-restarts={args.max_restarts}"]
    cmd += ["-m", "shardlm", "train", *rest] + (["--debug"] if args.debug else [])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    os.execvp(cmd[0], cmd)


def cmd_train(args: argparse.Namespace) -> int:
    from shardlm.config import load_config

    if args.nproc and "TORCHELASTIC_RUN_ID" not in os.environ:
        return launch_torchrun(args, args.rest)
    config, overrides = _split_config(args.rest)
    cfg = load_config(config, overrides)
    from shardlm.train import train

    train(cfg)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from shardlm.evaluate import evaluate_path

    evaluate_path(args.path, args.overrides, stride=args.stride)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shardlm.generate import generate_from_path

    for text in generate_from_path(args.path, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                   args.top_p, args.seed, args.num_samples):
        print(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardlm.export import export

    out = export(args.path, args.out_dir)
    print(f"exported to {out}", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from shardlm.plot import plot_runs

    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from shardlm.config import load_config
    from shardlm.estimate import describe
    from shardlm.tokenizer import load_tokenizer

    config, overrides = _split_config(args.rest)
    cfg = load_config(config, overrides)
    print(describe(cfg, load_tokenizer(cfg.model.tokenizer, cfg.model.trust_remote_code), args.world_sizes))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardlm.config import load_config
    from shardlm.dist import detect_launch
    from shardlm.tune import report, tune

    config, overrides = _split_config(args.rest)
    cfg = load_config(config, overrides)
    points = tune(cfg, args.budget_gb, args.steps, args.max_batch)
    if detect_launch(launcher=cfg.parallel.launcher).rank == 0:
        print(report(points, Path(args.out or Path(cfg.out_dir) / "tuned.yaml")))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlm", description="Train GPT-2-family models with PyTorch FSDP2.")
    p.add_argument("--version", action="version", version=f"shardlm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--debug", action="store_true", help="show full tracebacks")
        sp.set_defaults(fn=fn)
        return sp

    t = add("train", cmd_train, "train or fine-tune: shardlm train [CONFIG.yaml] [key=value ...]")
    t.add_argument("--nproc", type=int, default=0, help="launch N processes on this node with torchrun")
    t.add_argument("--max-restarts", type=int, default=0, help="with --nproc: torchrun restarts on failure")
    t.add_argument("rest", nargs=argparse.REMAINDER, help="optional config file, then key=value overrides")

    e = add("eval", cmd_eval, "evaluate a checkpoint, run dir or HF folder: shardlm eval PATH [data.val=...]")
    e.add_argument("path")
    e.add_argument("--stride", type=int, default=0, help="sliding-window perplexity with this stride")
    e.add_argument("overrides", nargs="*")

    g = add("generate", cmd_generate, "sample text from a checkpoint, run dir or HF folder")
    g.add_argument("path")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-samples", type=int, default=1)

    x = add("export", cmd_export, "write a Hugging Face folder from a checkpoint or run dir")
    x.add_argument("path")
    x.add_argument("out_dir")

    es = add("estimate", cmd_estimate, "predict per-rank peak memory: shardlm estimate [CONFIG.yaml] [key=value]")
    es.add_argument("--world-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8],
                    help="comma-separated world sizes to estimate for (default 1,2,4,8)")
    es.add_argument("rest", nargs="*", help="optional config file, then key=value overrides")

    tu = add("tune", cmd_tune, "find the largest micro-batch and fastest FSDP setting: shardlm tune CONFIG")
    tu.add_argument("--budget-gb", type=float, default=None, help="memory budget per rank (required on CPU)")
    tu.add_argument("--steps", type=int, default=3, help="timed steps per feasible point")
    tu.add_argument("--max-batch", type=int, default=256)
    tu.add_argument("--out", default=None, help="YAML file for the best setting (default OUT_DIR/tuned.yaml)")
    tu.add_argument("rest", nargs="*", help="optional config file, then key=value overrides")

    pl = add("plot", cmd_plot, "plot metrics of one or more run dirs to PNG files")
    pl.add_argument("runs", nargs="+")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: the first run dir)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.debug:  # transformers imports torchao when installed: its CUDA-extension and pytree notices
        for name in ("torchao", "torch.utils._pytree"):  # say nothing a shardlm user can act on
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        code = args.fn(args)
    except ShardlmError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        if args.debug:
            traceback.print_exc()
        if rank in (None, "0") or args.debug:
            print(f"{prefix}error: {e}", file=sys.stderr, flush=True)
        _exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _exit(130)
    except Exception:  # noqa: BLE001 - a bug or an environment failure: show it with its rank
        rank = os.environ.get("RANK", "0")
        print(f"[rank {rank}] unexpected failure:", file=sys.stderr)
        traceback.print_exc()
        _exit(1)
    _exit(code)


def _exit(code: int) -> None:
    from shardlm.dist import shutdown

    shutdown(code)
    sys.exit(code)

