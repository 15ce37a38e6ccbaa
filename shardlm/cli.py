"""`shardlm train | eval | generate | export | prepare | plot | ...`: the options of each subcommand, parsed in any
order, and the one place errors become exit codes; what each command does is in shardlm.commands."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import traceback

from shardlm import ShardlmError, __version__
from shardlm.commands import (
    cmd_configs,
    cmd_env,
    cmd_estimate,
    cmd_eval,
    cmd_export,
    cmd_generate,
    cmd_plot,
    cmd_prepare,
    cmd_sweep,
    cmd_train,
    cmd_tune,
    cmd_vllm_serve,
)

REFERENCE = "config keys: docs/config.md (python -m shardlm.docs prints them)"
TRAIN_EXAMPLES = """examples:
  shardlm train                                      the defaults: a byte-level GPT on Tiny Shakespeare
  shardlm train gpt2_wikitext2 --nproc 4             a bundled config by name (shardlm configs lists them)
  shardlm train my.yaml train.max_steps=100 out_dir=runs/short   a config file and overrides
  shardlm train CONFIG --dry-run                     check config, data, model and plan; train nothing
  shardlm resume runs/short train.max_steps=200      continue a run from its saved config (or: train RUN_DIR)
options, config files and key=value overrides mix in any order; later files and overrides win.
"""


SWEEP_EXAMPLES = """examples:
  shardlm sweep shakespeare_tiny out_dir=runs/sweep --param train.lr=loguniform:1e-4:1e-2 \\
      --param train.warmup_steps=int:0:200 --trials 20      20 runs in runs/sweep/trial_NNNN, bad ones pruned
  shardlm sweep runs/sweep --trials 30                        continue it (an interrupted trial resumes)
  shardlm plot runs/sweep                                     loss per trial, curves, parameter importance
each trial is `shardlm train` with the values as overrides; the study is runs/sweep/study.db (Optuna).
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardlm", description="Train and fine-tune causal language models (GPT-2, "
                                "Llama, Qwen, Mistral, Gemma, Phi, ...; full or LoRA) with PyTorch FSDP2.",
                                epilog="shardlm COMMAND --help shows each command's options and examples.")
    p.add_argument("--version", action="version", version=f"shardlm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help_: str, epilog: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--debug", action="store_true", help="show full tracebacks")
        sp.set_defaults(fn=fn)
        return sp

    def config_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("rest", nargs="*", metavar="CONFIG | key=value",
                        help="config files or bundled config names (later win; shardlm configs lists them) and "
                             f"dotted overrides such as train.lr=1e-3; {REFERENCE}")

    def train_options(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--nproc", type=int, default=0, help="launch N processes on this node with torchrun")
        sp.add_argument("--max-restarts", type=int, default=0, help="with --nproc: torchrun restarts on failure")
        sp.add_argument("--dry-run", action="store_true",
                        help="check the config, data, model and parallel plan, then exit without training")
        sp.add_argument("--callback", action="append", default=[], metavar="MODULE:NAME",
                        help="run a callback of your own (shardlm.callbacks: early stopping, custom logging); "
                             "MODULE:NAME or file.py:NAME, with literal arguments as NAME(3, x='a'); repeatable")

    t = add("train", cmd_train, "train or fine-tune: shardlm train [CONFIG ...] [key=value ...]", TRAIN_EXAMPLES)
    train_options(t)
    config_args(t)

    r = add("resume", cmd_train, "continue a run from its saved config: shardlm resume RUN_DIR [key=value ...]",
            "examples:\n  shardlm resume runs/short                          from its newest checkpoint\n"
            "  shardlm resume runs/short train.max_steps=400    train further (the learning rate goes on "
            "without a jump)\n  shardlm resume runs/short/checkpoints/step_000000100   from that checkpoint\n"
            "the run's own config.yaml is the config; overrides given apply on top and are reported. "
            "`shardlm train RUN_DIR` does the same, but starts the run if it has no checkpoint yet.\n")
    r.add_argument("run", metavar="RUN_DIR", help="a run's out_dir, or one of its checkpoints/step_N folders")
    train_options(r)
    config_args(r)

    e = add("eval", cmd_eval, "evaluate a checkpoint, run dir or HF folder: shardlm eval PATH [data.val=...]",
            "examples:\n  shardlm eval runs/demo\n  shardlm eval runs/demo-hf data.val=valid.txt --stride 512\n"
            "  shardlm eval runs/demo --generation 200   (+ generation quality; appended to metrics.jsonl)\n"
            "  shardlm eval runs/demo --tasks hellaswag,arc_easy --limit 200   (lm-evaluation-harness)\n")
    e.add_argument("path", help="a checkpoint (checkpoints/step_N), a run dir (its newest checkpoint) or an "
                                "exported Hugging Face folder")
    e.add_argument("--stride", type=int, default=None, help="sliding-window perplexity with this stride")
    e.add_argument("--generation", type=int, default=0, metavar="N",
                   help="also sample N continuations of held-out prompts (first half of validation blocks) and "
                        "report distinct-n, rep-4, self-BLEU, ROUGE-L and MAUVE (pip install shardlm[gen])")
    e.add_argument("--exact-match", type=int, default=0, metavar="N",
                   help="examples: answer the first N held-out prompts greedily (chat template applied) and report "
                        "the fraction equal to the reference answer")
    e.add_argument("--featurizer", default=None, metavar="PATH",
                   help="with --generation: model whose last hidden states are MAUVE's features (run dir, "
                        "checkpoint or HF folder; default the evaluated model)")
    e.add_argument("--temperature", type=float, default=1.0,
                   help="with --generation: sampling temperature (default 1.0: the model's own distribution)")
    e.add_argument("--top-p", type=float, default=1.0, help="with --generation: nucleus mass; 1.0 = off")
    e.add_argument("--seed", type=int, default=0, help="with --generation: the same seed gives the same numbers")
    e.add_argument("--tasks", default=None, metavar="NAMES",
                   help="run EleutherAI's lm-evaluation-harness tasks (comma-separated) on the model's export and "
                        "record the scores in the run's metrics.jsonl (pip install shardlm[lmeval])")
    e.add_argument("--limit", type=float, default=None,
                   help="with --tasks: at most N examples per task (a fraction below 1: that share)")
    e.add_argument("--num-fewshot", type=int, default=None, help="with --tasks: few-shot examples per prompt")
    e.add_argument("--include-path", default=None, metavar="DIR",
                   help="with --tasks: a folder of task YAMLs of your own (local data files work offline)")
    e.add_argument("overrides", nargs="*", metavar="key=value",
                   help="e.g. data.val=FILE (default: the run's validation data), data.seq_len=N")

    g = add("generate", cmd_generate, "sample text from a checkpoint, run dir or HF folder",
            "examples:\n  shardlm generate runs/demo --prompt 'ROMEO:' --max-new-tokens 300   (streamed)\n"
            "  shardlm generate runs/demo-hf --prompt 'The' --temperature 0 (greedy)\n"
            "  shardlm generate runs/demo --prompt-file prompts.txt --json > samples.jsonl\n"
            "  shardlm generate runs/chat_tiny --chat --prompt 'Reverse: abc'   (the chat template applied)\n"
            "one prompt and one sample are printed as they are generated; --json prints one line per sample:\n"
            '  {"prompt": ..., "sample": 0, "text": "<continuation>", "new_tokens": N}\n')
    g.add_argument("path", help="a checkpoint, a run dir or an exported Hugging Face folder")
    g.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    g.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="UTF-8 file with one prompt per line (blank lines skipped), generated in batches")
    g.add_argument("--chat", action="store_true",
                   help="answer as a chat model: --prompt is a user message (or --messages FILE), rendered with the "
                        "chat template; without either, an interactive loop on a terminal")
    g.add_argument("--messages", default=None, metavar="FILE",
                   help="with --chat: a JSON list of {role, content} messages to answer")
    g.add_argument("--batch-size", type=int, default=8,
                   help="prompts generated together, left-padded (default 8); samples of a prompt go with it")
    g.add_argument("--json", action="store_true",
                   help='one JSON line per sample: {"prompt", "sample", "text" (the continuation), "new_tokens"}')
    g.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1.0 = off")
    g.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same text")
    g.add_argument("--num-samples", type=int, default=1, help="independent samples of the prompt")

    en = add("env", cmd_env, "print versions, devices, launcher and caches for a bug report: shardlm env [--json]")
    en.add_argument("--json", action="store_true", help="one JSON object instead of plain text")

    x = add("export", cmd_export, "write a Hugging Face folder from a checkpoint or run dir",
            "example:\n  shardlm export runs/demo runs/demo-hf   # then transformers.pipeline(model='runs/demo-hf')\n"
            "  shardlm export runs/lora runs/lora-adapter --adapter  # peft.PeftModel.from_pretrained(base, ...)\n"
            "  shardlm export runs/demo runs/demo-hf --push-to-hub me/demo --private\n"
            "every export folder gets a model card README.md (data, steps, final losses, how to load).\n")
    x.add_argument("path", help="a checkpoint or a run dir (its newest checkpoint)")
    x.add_argument("out_dir", help="folder to write config.json, model.safetensors and the tokenizer to")
    x.add_argument("--adapter", action="store_true",
                   help="LoRA runs: write the PEFT adapter (adapter_config.json, adapter_model.safetensors) instead "
                        "of the merged model")
    x.add_argument("--push-to-hub", default=None, metavar="REPO_ID",
                   help="then upload the folder to this Hugging Face model repo (token: HF_TOKEN or `hf auth login`)")
    x.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")

    pr = add("prepare", cmd_prepare, "build the token caches of data.train and data.val, then exit",
             "examples:\n  shardlm prepare gpt2_wikitext2                   on a login node, before the GPU job\n"
             "  shardlm prepare data.train=corpus.parquet model.tokenizer=gpt2\n"
             "prints documents, tokens, MB/s and the cache folder of each; every core tokenizes.\n")
    config_args(pr)

    sw = add("sweep", cmd_sweep, "hyperparameter search with Optuna: shardlm sweep [CONFIG] --param KEY=KIND:ARGS "
             "... --trials N", SWEEP_EXAMPLES)
    sw.add_argument("--param", action="append", default=[], metavar="KEY=KIND:ARGS",
                    help="a config key and its distribution: loguniform:LOW:HIGH, uniform:LOW:HIGH[:STEP], "
                         "int:LOW:HIGH[:STEP], logint:LOW:HIGH, choice:A,B,C; repeatable")
    sw.add_argument("--trials", type=int, default=None,
                    help="trials the study holds when done (default 20); a rerun adds trials up to this number")
    sw.add_argument("--nproc", type=int, default=0, help="run each trial as N processes with torchrun")
    sw.add_argument("--metric", default=None, help="validation metric to optimize (default loss)")
    sw.add_argument("--direction", choices=["minimize", "maximize"], default=None,
                    help="default: maximize accuracy-like metrics, minimize the others")
    sw.add_argument("--pruner", default=None, help="median (default), hyperband or none")
    sw.add_argument("--pruner-startup", type=int, default=None,
                    help="median: trials completed before any is pruned (default 5)")
    sw.add_argument("--pruner-warmup", type=int, default=None,
                    help="steps before a trial may be pruned (default 0; hyperband: its minimum resource)")
    sw.add_argument("--sampler", default=None, help="tpe (default: Optuna's TPE) or random")
    sw.add_argument("--seed", type=int, default=None, help="the sampler's seed (default 0)")
    sw.add_argument("--enqueue", action="append", default=[], metavar="KEY=V,KEY=V",
                    help="try these values first (every --param named); repeatable")
    sw.add_argument("--quiet", action="store_true", help="one line per trial; its output only in its train.log")
    config_args(sw)

    es = add("estimate", cmd_estimate, "predict per-rank peak memory: shardlm estimate [CONFIG] [key=value]")
    es.add_argument("--world-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 4, 8],
                    help="comma-separated world sizes to estimate for (default 1,2,4,8)")
    config_args(es)

    tu = add("tune", cmd_tune, "the fastest micro-batch x grad_accum and FSDP setting at your global batch",
             "example:\n  shardlm tune shakespeare_tiny --budget-gb 4\n"
             "  shardlm train shakespeare_tiny runs/shakespeare/tuned.yaml\n")
    tu.add_argument("--budget-gb", type=float, default=None, help="memory budget per rank (required on CPU)")
    tu.add_argument("--steps", type=int, default=3, help="timed steps per feasible point")
    tu.add_argument("--max-batch", type=int, default=256, help="largest micro-batch tried")
    tu.add_argument("--out", default=None, help="YAML file for the best setting (default OUT_DIR/tuned.yaml)")
    config_args(tu)

    vs = add("vllm-serve", cmd_vllm_serve,
             "a vLLM engine for online RL's grpo.vllm_mode=server (run it in vLLM's environment)",
             "example:\n  shardlm vllm-serve --port 8000          # on its own GPUs: CUDA_VISIBLE_DEVICES=7\n"
             "  shardlm train my_grpo.yaml grpo.use_vllm=true grpo.vllm_mode=server --nproc 7\n"
             "the trainer sends the model's config and weights: the server needs no model folder.\n")
    vs.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    vs.add_argument("--port", type=int, default=8000, help="port (default 8000, grpo.vllm_server_port's)")
    vs.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="on a GPU, the engine's share of its memory (default 0.9: the GPU is the engine's own)")

    add("configs", cmd_configs, "list the bundled configs, one line each: shardlm train NAME runs one",
        "example:\n  shardlm configs\n  shardlm train shakespeare_tiny train.max_steps=100\n"
        "the folder they are in is printed last (on stderr): copy a file from it to edit it.\n")

    pl = add("plot", cmd_plot, "plot metrics of one or more run dirs to PNG files",
             "example:\n  shardlm plot runs/demo runs/short   # PNGs in runs/demo/plots/\n")
    pl.add_argument("runs", nargs="+", help="run dirs (out_dir of training runs); several are overlaid")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: FIRST_RUN/plots)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options, config files and overrides in any order, as users type them (`train CFG --nproc 4 a=b`)."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    target = "rest" if hasattr(args, "rest") else "overrides" if hasattr(args, "overrides") else None
    if unknown or (extra and target is None):
        p.error(f"unrecognized arguments for 'shardlm {args.command}': {' '.join(unknown or extra)}"
                f"{_nearest_option(p, args.command, unknown)} (see shardlm {args.command} --help)")
    if target:
        setattr(args, target, [*getattr(args, target), *extra])
    return args


def _nearest_option(p: argparse.ArgumentParser, command: str, unknown: list[str]) -> str:
    """`--nprocs` -> ` Did you mean --nproc?`: the closest option of that command to the first unknown one."""
    commands = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    options = [o for a in commands[command]._actions for o in a.option_strings if o.startswith("--")]
    match = difflib.get_close_matches(unknown[0].split("=")[0], options, n=1, cutoff=0.6) if unknown else []
    return f". Did you mean {match[0]}?" if match else ""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.debug:  # transformers' "Loading weights" / "Writing model shards" bars: `\r` noise in logs
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
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
    from shardlm.distributed.process_group import shutdown
    from shardlm.observe.tracking import abandon_open

    shutdown(code, before_exit=abandon_open)  # a crashed run's MLflow run must not stay RUNNING
    sys.exit(code)

