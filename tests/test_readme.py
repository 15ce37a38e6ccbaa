"""The README's commands run as written, so a README command that breaks fails CI; every bundled config
validates with `shardlm train CONFIG --dry-run`. The guides' commands (docs/*.md) run in tests/test_docs.py,
the same way (`runnable`, `small_overrides`) on the pages marked for tiny runs.

Each `shardlm train`/`tune` command gets tiny overrides appended (a small corpus and model, 10 steps): the
command's own options, files and keys are what is tested, not the training. Process counts above 2 are
lowered to 2 to fit a 2-core CI machine. `tensorboard` (a server) is not started; its log folder is checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, benchmark_module, byte_gpt2_config, run_command, tiny
from shardlm import ShardlmError
from shardlm.cli import cmd_train, parse_args
from shardlm.config import load_config, to_flat_dict
from shardlm.tokenizer import byte_tokenizer, set_chat_template

README = ROOT / "README.md"
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def readme_commands() -> list[list[str]]:
    """Every line of the README's bash blocks except the first block (`make demo` / `make test`)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)[1:]
    return [argv for block in blocks for line in block.splitlines() if (argv := shlex.split(line, comments=True))]


def demo_command() -> list[str]:
    """`make demo`'s recipe line, which the tour starts from."""
    recipe = re.search(r"^demo:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    return shlex.split(recipe.replace("$(VENV)/bin/", ""))


def small_overrides(corpus, cache_dir) -> list[str]:
    """The tiny overrides appended to each `shardlm train`/`tune` command (the command's own out_dir stays)."""
    small = [a for a in tiny(corpus, cache_dir, "unused") if not a.startswith("out_dir=")]
    return small + ["model.name=null", "model.tokenizer=bytes", "data.val=null", "parallel.precision=fp32",
                    "train.grad_accum=1", "checkpoint.async=false", "log.tensorboard=true"]


def runnable(argv: list[str], small: list[str]) -> list[str] | None:
    argv = [re.sub(r"^(--nproc(?:_per_node|-per-node)?[= ]?)([3-9]|\d\d+)$", r"\g<1>2", a) for a in argv]
    argv = [a if i == 0 or not argv[i - 1].startswith("--nproc") or int(a) <= 2 else "2"
            for i, a in enumerate(argv)] if any(a.startswith("--nproc") for a in argv) else argv
    head, rest = argv[0], argv[1:]
    if head == "tensorboard":
        return None
    if head in ("shardlm", "torchrun"):
        launcher = ["-m", "shardlm"] if head == "shardlm" else ["-m", "torch.distributed.run"]
        cmd = [sys.executable, *launcher, *rest]
        if "train" in rest:
            cmd += small
        if rest[0] == "tune":
            cmd += [*small, "--max-batch", "4", "--steps", "1", "train.batch_size=4"]
        return cmd
    if head == "python":
        return [sys.executable, *rest]
    raise AssertionError(f"a command of an unknown program: {shlex.join(argv)}")


def test_readme_commands_run_as_written(corpus, cache_dir, tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    small = small_overrides(corpus, cache_dir)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    ran = []
    for argv in [demo_command(), *readme_commands()]:
        cmd = runnable(argv, small)
        if cmd is None:
            assert (tmp_path / argv[-1]).is_dir(), f"{shlex.join(argv)}: no such log folder"
            continue
        proc = run_command(cmd, env, 300, tmp_path)
        assert proc.returncode == 0, f"README command failed: {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
        ran.append((shlex.join(argv), proc.stdout + proc.stderr))
    assert len(ran) >= 10
    assert sorted(p.name for p in (tmp_path / "runs" / "demo" / "plots").glob("loss*.png"))
    check_the_tour_words(ran, (tmp_path / "runs" / "demo-hf" / "README.md").read_text())


def check_the_tour_words(ran: list[tuple[str, str]], card: str) -> None:
    """What the tour shows: the rerun of make demo's command trains nothing (seconds, not a second run);
    training's validation loss (a subset, train.eval_batches) and eval's (all held-out tokens) say which they
    are, and so does the model card, with the one-process run's layout; plot says why there is no MFU figure;
    resume extends a run from its own config and says what the learning rate does."""
    (_, demo), (_, again), out = ran[0], ran[1], dict(ran[2:])
    assert "nothing to train" in again, again
    subset = re.search(r"on ([\d,]+) of ([\d,]+) held-out tokens \(a subset: train.eval_batches=4\)", demo)
    assert subset and f"on all {subset[2]} held-out tokens" in out["shardlm eval runs/demo"], demo
    assert f"at step 10, {subset[0]} |" in card and "| layout | 1 process, no FSDP |" in card, card
    assert "no mfu.png: MFU needs the device's peak FLOP/s" in out["shardlm plot runs/demo runs/short"]
    extended = out["shardlm resume runs/short train.max_steps=120"]
    assert "resumed from" in extended and "the run's end moved from step 10 to 120" in extended, extended


def test_plain_train_is_the_shakespeare_config():
    """The README says plain `shardlm train` (no config: the dataclass defaults) trains what the bundled
    shakespeare_tiny does, into runs/default."""
    bundled = to_flat_dict(load_config("shakespeare_tiny"))
    defaults = to_flat_dict(load_config(None))
    defaults["model.n_positions"] = defaults["model.n_positions"] or defaults["data.seq_len"]  # null = seq_len
    defaults["model.tokenizer"] = defaults["model.tokenizer"] or "bytes"  # null = bytes from scratch
    assert {k: v for k, v in bundled.items() if k != "out_dir"} == {k: v for k, v in defaults.items()
                                                                      if k != "out_dir"}


def flow_model(config, path: str | None = None) -> None:
    """The exported model a config of a flow starts from (dpo_tiny's `runs/chat_tiny-hf`; `path`: distill_tiny's
    teacher), as the flow's earlier steps make it, in the test's own folder: the dry run then checks the model and
    counts the blocks instead of taking the path for a hub name it cannot reach."""
    import torch
    from transformers import GPT2LMHeadModel

    values = yaml.safe_load(config.read_text())
    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")  # chat_tiny's
    torch.manual_seed(0)
    model = GPT2LMHeadModel(byte_gpt2_config(vocab_size=len(tok), n_positions=values["data"]["seq_len"]))
    model.save_pretrained(path or values["model"]["name"])
    tok.save_pretrained(path or values["model"]["name"])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_bundled_config_validates(config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = []
    if "my_corpus" in str(yaml.safe_load(config.read_text()).get("data", {}).get("train")):
        (tmp_path / "corpus.csv").write_text('text\n' + '"hello world"\n' * 20000)  # a batch of 1024-token blocks
        extra = [f"data.train={tmp_path / 'corpus.csv'}"]
    train = str(yaml.safe_load(config.read_text()).get("data", {}).get("train"))
    if train.startswith("runs/sort/"):  # sort, grpo and distill_tiny's: the task's data as the flow writes it
        benchmark_module("grpo_demo", monkeypatch).write_task(Path("runs/sort"), 0, documents=3000, prompts=64,
                                                              heldout=16)
        if train.startswith("runs/sort/distill/"):  # distill_tiny's: the labels and the answers, here the right ones
            rows = [json.loads(line) for line in Path("runs/sort/prompts.jsonl").read_text().splitlines()]
            benchmark_module("distill_demo", monkeypatch).write_data(Path("runs/sort"), [0], 200,
                                                                     [r["answer"] for r in rows])
    elif train.startswith("runs/"):
        extra = ["data.train=chat_pairs", "data.val=chat_pairs_val"]  # made by the flow's earlier steps (dpo_tiny)
    if str(yaml.safe_load(config.read_text()).get("model", {}).get("name")).startswith("runs/"):
        flow_model(config)  # dpo_tiny's and grpo_tiny's model: the flow's exported chat_tiny
    if str(teacher := yaml.safe_load(config.read_text()).get("distill", {}).get("teacher")).startswith("runs/"):
        flow_model(config, teacher)  # distill_tiny's teacher: the flow's exported chat_tiny
    assert cmd_train(parse_args(["train", str(config), "--dry-run", "--nproc", "2", *extra])) == 0
    out = capsys.readouterr().out
    assert "dry run: the config is valid" in out and "plan: 2 rank(s)" in out
    if extra[:1] == ["data.train=chat_pairs"]:  # the flow's model was checked, not taken for a hub name
        assert "tokenizer runs/chat_tiny-hf, 259 tokens" in out, out


def test_a_recipe_whose_flow_step_is_missing_names_the_step(tmp_path, monkeypatch):
    """Run before its flow's earlier steps, a bundled recipe names the command that makes what it reads: the task's
    the task's data (sort_tiny), the base (grpo_tiny), the teacher (distill_tiny), never taken for a hub name."""
    monkeypatch.chdir(tmp_path)  # no runs/ here
    for argv, message in [
        (["sort_tiny"], "data path 'runs/sort/corpus.jsonl' does not exist. An earlier step of the bundled recipes' "
                        "flow makes it: python benchmarks/grpo_demo.py --data-only."),
        (["grpo_tiny"], "model.name 'runs/sort_tiny-hf' is a path that does not exist. An earlier step of the bundled "
         "recipes' flow makes it: python benchmarks/grpo_demo.py --data-only && shardlm train sort_tiny && shardlm "
         "export runs/sort_tiny runs/sort_tiny-hf."),
        (["distill_tiny"], "distill.teacher 'runs/sort/grpo-hf' is a path that does not exist. An earlier step of "
                           "the bundled recipes' flow makes it: make demo-rl."),
        (["distill_tiny", "train.objective=sft"], "data path 'runs/sort/distill/taught-0.jsonl' does not exist. An "
         "earlier step of the bundled recipes' flow makes it: make demo-rl && python benchmarks/distill_demo.py "
         "--data-only."),  # the longest product's step: runs/sort/distill's, not runs/sort's
    ]:
        with pytest.raises(ShardlmError, match=re.escape(message)):
            cmd_train(parse_args(["train", *argv, "--dry-run"]))


def test_the_rl_demos_task_keeps_its_held_out_strings_out(tmp_path, monkeypatch):
    """The sort task (benchmarks/grpo_demo.py): no held-out string is in the corpus or the RL prompts, the corpus
    never holds the length RL asks for, the answers are the sorted letters, and another seed is another split."""
    demo = benchmark_module("grpo_demo", monkeypatch)
    for seed in (0, 1):
        demo.write_task(tmp_path / str(seed), seed, documents=3000, prompts=300, heldout=40)
    read = {(seed, name): [json.loads(line) for line in (tmp_path / str(seed) / f"{name}.jsonl").open()]
            for seed in (0, 1) for name in ("corpus", "prompts", "heldout")}
    held = {r["prompt"][:-1] for r in read[0, "heldout"]}
    corpus = {r["text"].split(">")[0] for r in read[0, "corpus"]}
    assert len(held) == 40 and len(read[0, "prompts"]) == 300 and len(corpus) > 2900
    assert not held & corpus and not held & {r["prompt"][:-1] for r in read[0, "prompts"]}
    assert max(map(len, corpus)) == demo.ASKED - 1 and {len(s) for s in held} == {demo.ASKED}
    assert all(r["answer"] == "".join(sorted(r["prompt"][:-1])) for r in read[0, "heldout"] + read[0, "prompts"])
    assert all(demo.held_out(s, 0) for s in held) and not any(demo.held_out(s, 0) for s in corpus)
    assert held != {r["prompt"][:-1] for r in read[1, "heldout"]}
    chat = [json.loads(line) for line in (tmp_path / "0" / "chat_heldout.jsonl").open()]  # --chat: the same, asked
    assert [(c["prompt"][0]["content"], c["answer"]) for c in chat] == [
        (f"Sort: {r['prompt'][:-1]}", r["answer"]) for r in read[0, "heldout"]]
    sft = [json.loads(line)["messages"] for line in (tmp_path / "0" / "chat_sft.jsonl").open()]
    assert max(len(m[1]["content"]) for m in sft) == demo.CHAT_SFT and not held & {m[0]["content"][6:] for m in sft}


def test_the_rl_demo_refuses_a_folder_holding_its_earlier_runs(tmp_path):
    """A second `make demo-rl` into the same folder would train nothing (its runs are finished) and report CPU times
    of 0: it stops in one line naming the fix, and writes nothing."""
    import subprocess

    (tmp_path / "grpo").mkdir()
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "grpo_demo.py"), "--work", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and f"{tmp_path} already holds this demo's runs (grpo): remove them" in run.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["grpo"]


def test_options_overrides_and_files_mix_in_any_order(capsys):
    args = parse_args(["train", "a.yaml", "--nproc", "4", "train.lr=1", "--debug", "b.yaml", "out_dir=x"])
    assert (args.nproc, args.debug, args.rest) == (4, True, ["a.yaml", "train.lr=1", "b.yaml", "out_dir=x"])
    assert parse_args(["eval", "runs/x", "--stride", "8", "data.val=v.txt"]).overrides == ["data.val=v.txt"]
    with pytest.raises(SystemExit) as exit_:
        parse_args(["train", "a.yaml", "--nprocs", "4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'shardlm train': --nprocs. Did you mean --nproc?" in err
