"""Tool-calling episodes in online RL (grpo.tools, grpo.environment_factory): calls read from the template's format,
bad calls as the tool's message, the tool turn's ids as TRL renders them, the mask that keeps them out of the loss,
and the episode loop's budget, rounds and metrics."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardlm import ShardlmError
from shardlm.config import GrpoConfig
from shardlm.data.blocks import IGNORE
from shardlm.data.prompts import RLPrompt
from shardlm.objectives.rl.logps import micro_batch
from shardlm.objectives.rl.multiturn import sample_episodes
from shardlm.objectives.rl.rewards import Reward, RewardSet
from shardlm.objectives.rl.rollout import round_metrics, sampling_params, score_round
from shardlm.objectives.rl.sampling import Rollout
from shardlm.objectives.rl.tools import (
    Call,
    load_toolbox,
    parse_calls,
    run_call,
    tool_format,
    tool_turn_ids,
    with_environment_reward,
)
from shardlm.tokenizer import byte_tokenizer, end_of_turn_id, set_chat_template

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


class Guess:
    """An environment: a secret number from the prompt's fields; `guess` says higher, lower or right."""

    def reset(self, secret: int, **_) -> str:
        self.secret, self.right = secret, False
        return " (between 1 and 9)"

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: the guess
        """
        self.right = n == self.secret
        return "right" if self.right else "higher" if n < self.secret else "lower"

    def get_reward(self) -> float:
        return float(self.right)


def qwen_tokenizer():
    """The byte tokenizer with ChatML's tokens under Qwen2.5's own template (it renders Hermes tool calls)."""
    tok = byte_tokenizer()
    set_chat_template(tok, "chatml")
    tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text()
    return tok


def test_calls_are_read_from_the_templates_format_and_an_unknown_format_is_refused():
    hermes = ('Sure.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
              '<tool_call>{"name": "nope", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parse_calls(hermes, "hermes") == [Call("multiply", {"a": 2, "b": 3}), Call("nope", {"x": 1})]
    assert parse_calls("<tool_call>{\"name\": \"multiply\", \"argu</tool_call>", "hermes")[0].error.startswith(
        "the tool call is not valid JSON")
    assert parse_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")[0].error == \
        'the tool call must be a JSON object with a "name" string'
    assert parse_calls("just an answer", "hermes") == []
    assert parse_calls('<|python_tag|>{"name": "multiply", "parameters": {"a": 1, "b": 2}}', "llama3") == \
        [Call("multiply", {"a": 1, "b": 2})]
    assert tool_format(qwen_tokenizer()) == "hermes"
    llama = byte_tokenizer()
    llama.chat_template = (TEMPLATES / "llama3.jinja").read_text()
    assert tool_format(llama) == "llama3"
    chatml = byte_tokenizer()
    set_chat_template(chatml, "chatml")
    with pytest.raises(ShardlmError, match="renders no tool calls in a format shardlm reads"):
        tool_format(chatml)


def test_a_bad_call_is_the_tools_message():
    tools = {"multiply": multiply, "slow": slow}
    assert run_call(tools, Call("multiply", {"a": 6, "b": 7}), 0) == ("42", False)
    assert run_call(tools, Call("nope", {}), 0) == ("{'error': 'Tool nope not found.'}", True)
    content, failed = run_call(tools, Call("multiply", {"a": 1}), 0)
    assert failed and "missing a required argument: 'b'" in content
    assert run_call(tools, Call("multiply", [1, 2]), 0)[0] == \
        "{'error': 'the arguments of multiply must be a JSON object, got list'}"
    assert run_call(tools, Call("multiply", {"a": "x", "b": None}), 0)[1]  # the tool raised
    assert run_call(tools, Call("", error="the tool call is not valid JSON"), 0) == \
        ("{'error': 'the tool call is not valid JSON'}", True)
    assert run_call(tools, Call("slow", {"seconds": 2.0}), 0.05) == \
        ("{'error': 'Tool slow timed out after 0.05 s.'}", True)


def test_the_tool_turn_is_the_ids_trl_appends():
    """The tool turn's ids equal TRL 1.16's `_get_tool_suffix_ids` on the same template and messages."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    tok = qwen_tokenizer()
    said = [{"role": "tool", "name": "multiply", "content": "42"}, {"role": "tool", "name": "nope", "content": "x"}]
    # Qwen2.5-Instruct's EOS is its end of turn, <|im_end|>: TRL cuts the rendering there
    trl_self = SimpleNamespace(processing_class=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                               _tokenizer=SimpleNamespace(eos_token_id=end_of_turn_id(tok)))
    ours = tool_turn_ids(tok, said, end_of_turn_id(tok))
    assert ours == GRPOTrainer._get_tool_suffix_ids(trl_self, said)
    assert tok.decode(ours) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nx\n"
                                "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    llama = byte_tokenizer()  # Llama 3.1: the result an ipython turn, the template's own rendering
    llama.chat_template = (TEMPLATES / "llama3.jinja").read_text()
    llama.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                                                            "<|begin_of_text|>"]})
    trl_self.processing_class, trl_self._tokenizer.eos_token_id = llama, end_of_turn_id(llama)
    ours = tool_turn_ids(llama, said[:1], end_of_turn_id(llama))
    assert ours == GRPOTrainer._get_tool_suffix_ids(trl_self, said[:1])
    assert llama.decode(ours) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n")


class Scripted:
    """A model-free sampler: a context without a tool result answers `call`, one with it answers `answer`."""

    def __init__(self, tok, call: str, answer: str):
        self.tok, self.call, self.answer, self.asked = tok, call, answer, []

    def sample(self, prompts, keys, params) -> Rollout:
        self.asked.append((list(keys), params.max_tokens))
        eot = end_of_turn_id(self.tok)
        out = []
        for p in prompts:
            text = self.answer if "<tool_response>" in self.tok.decode(p) else self.call
            out += [(self.tok(text, add_special_tokens=False)["input_ids"] + [eot])[:params.max_tokens]] * \
                params.group
        logps = [[-0.5] * len(c) for c in out]
        return Rollout([list(p) for p in prompts], out, [c[-1] != eot for c in out], params.group, logps)


def _episodes(tok, g: GrpoConfig, sampler, fields=None):
    box = load_toolbox(g, tok)
    prompts = [RLPrompt([{"role": "user", "content": "6 x 7?"}], fields or {})]
    ids = [tok.apply_chat_template(prompts[0].prompt, tools=box.schemas, add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]]
    params = sampling_params(g, [end_of_turn_id(tok)], 0)
    return box, prompts, ids, sample_episodes(sampler, tok, box, prompts, ids, [5], params, end_of_turn_id(tok))


def test_an_episode_calls_the_tool_reads_its_result_and_trains_only_its_own_turns():
    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    g = GrpoConfig(group=2, max_completion_length=200, tools=["test_grpo_tools:multiply"])
    sampler = Scripted(tok, call, "42")
    _, prompts, ids, ep = _episodes(tok, g, sampler)
    eot = end_of_turn_id(tok)
    first = tok(call, add_special_tokens=False)["input_ids"] + [eot]
    suffix = tool_turn_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}], eot)
    second = tok("42", add_special_tokens=False)["input_ids"] + [eot]
    r = ep.rollout
    assert r.completions == [first + suffix + second] * 2
    assert r.trainable == [[1] * len(first) + [0] * len(suffix) + [1] * len(second)] * 2
    assert r.logps[0] == [-0.5] * len(first) + [0.0] * len(suffix) + [-0.5] * len(second)
    assert r.truncated == [False, False] and r.tools == {"calls": 2.0, "failed": 0.0, "turns": 4.0, "calling": 2.0}
    assert ep.messages[0][1] == {"role": "tool", "name": "multiply", "content": "42"}
    assert ep.messages[0][0]["tool_calls"] == [{"type": "function", "function": {"name": "multiply",
                                                                                  "arguments": {"a": 6, "b": 7}}}]
    # turn 2 of each sample is its own keyed row: sample j of a prompt never shares a stream with another
    assert sampler.asked[0][0] == [5] and len(set(sampler.asked[1][0])) == 2
    # the tool's tokens are context, never targets: the rows' targets are the model's turns alone
    tokens, _, targets, lengths = micro_batch([ids[0]] * 2, r.completions, 0, torch.device("cpu"), r.trainable)
    assert tokens[0, len(ids[0]):len(ids[0]) + len(r.completions[0])].tolist() == r.completions[0]
    trained = targets[0][targets[0] != IGNORE].tolist()
    assert trained == first + second and lengths[0].sum().item() == len(first) + len(second)
    metrics = round_metrics(SimpleNamespace(rollout=r, per_func=torch.zeros(2, 1),
                                            scored=SimpleNamespace(rewards=torch.zeros(2),
                                                                   std_zero=torch.zeros(2, dtype=torch.bool))), ["x"])
    assert metrics["tools/call_frequency"] == 1.0 and metrics["tools/failure_frequency"] == 0.0
    assert metrics["completions/mean_length"] == len(first) + len(second)  # TRL's: the model's tokens


def test_the_budget_and_the_rounds_end_an_episode():
    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    eot = end_of_turn_id(tok)
    first = len(tok(call, add_special_tokens=False)["input_ids"]) + 1
    suffix = len(tool_turn_ids(tok, [{"role": "tool", "name": "multiply", "content": "42"}], eot))
    for limit, rounds, want_len, calls in [(first + suffix - 1, None, first, 2.0),  # no room for the tool's turn
                                           (first + suffix + 1, None, first + suffix + 1, 2.0),  # cut: truncated
                                           (200, 0, first, 0.0)]:  # no round of calls at all
        g = GrpoConfig(group=2, max_completion_length=limit, tools=["test_grpo_tools:multiply"],
                       max_tool_calling_iterations=rounds)
        r = _episodes(tok, g, Scripted(tok, call, "42"))[3].rollout
        assert [len(c) for c in r.completions] == [want_len] * 2 and r.tools["calls"] == calls
        assert r.truncated == [want_len == first + suffix + 1] * 2


def test_an_environment_per_completion_its_tools_observation_and_reward(tmp_path):
    tok = qwen_tokenizer()
    g = GrpoConfig(group=2, max_completion_length=200, environment_factory="test_grpo_tools:Guess",
                   rewards=[])
    call = '<tool_call>{"name": "guess", "arguments": {"n": 7}}</tool_call>'
    box, prompts, ids, ep = _episodes(tok, g, Scripted(tok, call, "7"), {"secret": 7})
    assert [s["function"]["name"] for s in box.schemas] == ["guess"]
    assert "(between 1 and 9)" in tok.decode(ep.rollout.prompts[0])  # reset's observation ends the prompt
    assert "guess" in tok.decode(ids[0])  # the schema is in the prompt
    assert len({id(e) for e in ep.environments}) == 2 and all(e.right for e in ep.environments)
    rewards = with_environment_reward(RewardSet([], []), box)
    scored = score_round(Scripted(tok, call, "7"), tok, prompts, ids, [0], rewards, g,
                         sampling_params(g, [end_of_turn_id(tok)], 0), box=box)
    assert rewards.names == ["Guess"] and scored.per_func[:, 0].tolist() == [1.0, 1.0]


def test_tool_settings_that_cannot_hold_are_refused(tmp_path, monkeypatch):
    tok = qwen_tokenizer()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "undocumented.py").write_text("def f(x):\n    return x\n")
    for g, message in [
        (GrpoConfig(tools=["undocumented:f"]), "tool 'f' cannot be described to the model"),
        (GrpoConfig(tools=["undocumented:g"]), "tool 'undocumented:g': module 'undocumented' has no 'g'"),
        (GrpoConfig(environment_factory="test_grpo_tools:multiply"), "is a function, not a class"),
    ]:
        with pytest.raises(ShardlmError, match=message):
            load_toolbox(g, tok)
    from shardlm.config.grpo import check_tools
    from shardlm.data.prompts import prompt_token_ids

    with pytest.raises(ShardlmError, match="grpo.dynamic_sampling cannot run tool-calling episodes or a rollout"):
        check_tools(GrpoConfig(tools=["m:f"], dynamic_sampling=True))
    with pytest.raises(ShardlmError, match="grpo.rollout_func makes a round's completions itself, so grpo.tools"):
        check_tools(GrpoConfig(tools=["m:f"], rollout_func="m:g"))
    with pytest.raises(ShardlmError, match="a text prompt cannot offer tools"):
        prompt_token_ids(tok, RLPrompt("6 x 7?", {}), tools=[{"type": "function"}])


def test_the_dry_run_shows_the_tools_schema_and_a_parsed_dummy_call(tmp_path, cache_dir):
    """`shardlm train --dry-run` with grpo.tools on chat prompts under Qwen2.5's template: the schema in the first
    prompt, and a parsed dummy call with its tool turn (a run that trains: the 2-ranks test below)."""
    import json

    from helpers import shardlm_cli, tiny

    (tmp_path / "calc.py").write_text("def multiply(a: int, b: int) -> int:\n    \"\"\"Multiply.\n\n    Args:\n"
                                      "        a: one\n        b: two\n    \"\"\"\n    return a * b\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a} x 3?"}],
                                           "answer": str(3 * a)}) + "\n" for a in range(16)))
    args = tiny(prompts, cache_dir, tmp_path / "run", **{
        "train.objective": "grpo", "grpo.group": 4, "grpo.max_completion_length": 8, "train.batch_size": 8,
        "train.max_steps": 2, "data.seq_len": 1024, "model.n_positions": 1024, "data.val_fraction": 0.25,
        "model.chat_template": TEMPLATES / "qwen2_5.jinja", "grpo.tools": f"[{tmp_path / 'calc.py'}:multiply]",
        "train.eval_every": 2, "train.eval_batches": 1})
    dry = shardlm_cli(["train", *args, "--dry-run"], cwd=tmp_path)
    assert '"name": "multiply"' in dry.stdout and "tools (hermes calls, at most unlimited rounds): multiply" in \
        dry.stdout, dry.stdout[-3000:]
    assert "parses to multiply({}) and fails; its tool turn (context, not trained):" in dry.stdout
    assert "<|im_start|>user\n<tool_response>\n{'error': \"multiply: missing a required argument: 'a'\"}\n" \
           "</tool_response><|im_end|>\n<|im_start|>assistant\n" in dry.stdout


CALC = '''class Calc:
    """An environment per completion: its multiply is the tool; it rewards one call."""

    def reset(self, **fields):
        self.calls = 0

    def multiply(self, a: int, b: int) -> int:
        """Multiply.

        Args:
            a: one
            b: two
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls == 1)


def called(completions, environments, **kwargs):
    """A reward naming its environments (checked before training as it runs: with them)."""
    return [float(e.calls > 0) for e in environments]
'''


def test_episodes_that_call_tools_train_on_two_ranks_as_in_one_process_and_resume_exactly(tmp_path, cache_dir):
    """A model that calls a tool (weights set by hand: it writes the call, then an answer after the tool's turn,
    missing a token now and then), the tool an environment's method: its episodes train the same on 2 ranks as in
    one process, and a run killed -9 after its step-2 checkpoint resumes to the same records (the environments are
    made again from the prompts' fields); the calls run, the environment's reward joins, the records count them."""
    import json

    from faults import fault

    from helpers import by_step, calling_model, losses, records, shardlm_cli, tiny, tools_tokenizer

    (tmp_path / "calc.py").write_text(CALC)
    prompts = [[{"role": "user", "content": f"{a} x 7?"}] for a in range(1, 10)] * 2
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "42"}) + "\n"
                                                    for p in prompts))
    g = GrpoConfig(environment_factory=f"{tmp_path / 'calc.py'}:Calc")
    tok = tools_tokenizer()
    length = len(tok.apply_chat_template(prompts[0], tools=load_toolbox(g, tok).schemas, add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"])
    model = calling_model(tmp_path / "calls", length, sure=0.68)

    def args(out: str, nproc: int) -> list[str]:
        return ["train", *tiny(tmp_path / "prompts.jsonl", cache_dir, tmp_path / out, **{
            "model.name": model, "train.objective": "grpo", "grpo.group": 4, "grpo.max_completion_length": 140,
            "train.batch_size": 4, "train.grad_accum": 2 if nproc < 2 else 1, "train.max_steps": 4,
            "data.seq_len": 256, "data.val_fraction": 0.12, "grpo.environment_factory": f"{tmp_path / 'calc.py'}:Calc",
            "grpo.rewards": f"[{tmp_path / 'calc.py'}:called]",
            "train.lr": 1e-2, "train.warmup_steps": 0, "checkpoint.every": 2})]

    shardlm_cli(args("one", 0), cwd=tmp_path)
    shardlm_cli(args("two", 2), nproc=2, cwd=tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    assert losses(two) == pytest.approx(losses(one), abs=1e-6)
    first = records(one)[0]
    assert first["tools/call_frequency"] == records(two)[0]["tools/call_frequency"] > 0.5
    assert first["tools/turns"] > 1.2 and first["completions/mean_length"] < 100  # the tool turns are not counted
    assert 0 < first["rewards/Calc/mean"] <= 1 and 0 < first["rewards/called/mean"] <= 1
    killed = args("killed", 0)
    assert shardlm_cli([*killed, fault("KillAfterSave(2)")], check=False, cwd=tmp_path).returncode != 0
    shardlm_cli(killed, cwd=tmp_path)
    got, want = by_step(tmp_path / "killed"), by_step(one)
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), rel=1e-5, abs=1e-7)


def env_turn(prompts, prompt_ids, generate, tokenizer, **_):
    """A rollout_func: the model's turn, an environment's text (read, not trained), the model's second turn."""
    first = generate(prompt_ids)
    said = [tokenizer("|env|", add_special_tokens=False)["input_ids"] for _ in prompts]
    second = generate([p + c + s for p, (c, _), s in zip(prompt_ids, first, said, strict=True)])
    return {"completion_ids": [c + s + d for (c, _), s, (d, _) in zip(first, said, second, strict=True)],
            "env_mask": [[1] * len(c) + [0] * len(s) + [1] * len(d) for (c, _), s, (d, _) in
                         zip(first, said, second, strict=True)],
            "logprobs": [lc + [0.0] * len(s) + ld for (_, lc), s, (_, ld) in zip(first, said, second, strict=True)],
            "turns": [2] * len(prompts)}


def test_a_rollout_func_makes_the_round_and_bad_returns_are_one_line():
    """grpo.rollout_func (TRL's): the function's completions and env_mask are the round's, its extra keys reach the
    rewards, its generate() is keyed per completion and call; a malformed return is refused in one line."""
    tok = qwen_tokenizer()
    g = GrpoConfig(group=2, max_completion_length=200, rollout_func="test_grpo_tools:env_turn", rewards=[])
    box = load_toolbox(g, tok)
    sampler = Scripted(tok, "hi", "42")
    prompts = [RLPrompt("6 x 7?", {})]
    seen = []
    rewards = RewardSet([Reward("turns", lambda completions, turns, **_: seen.append(turns) or [1.0, 0.0], ())],
                        [1.0])
    scored = score_round(sampler, tok, prompts, [list(b"6 x 7?")], [3], rewards, g,
                         sampling_params(g, [end_of_turn_id(tok)], 0), box=box)
    r = scored.rollout
    eot = end_of_turn_id(tok)
    hi, env = tok("hi", add_special_tokens=False)["input_ids"] + [eot], list(b"|env|")
    assert r.completions[0] == hi + env + hi and r.trainable[0] == [1] * len(hi) + [0] * len(env) + [1] * len(hi)
    assert seen == [[2, 2]] and len({k for keys, _ in sampler.asked for k in keys}) == 4  # 2 calls x 2 samples
    for fn, message in [(lambda **_: [[1]], "returned list: it must return a dict with completion_ids"),
                        (lambda **_: {"completion_ids": [[1]]}, "returned completion_ids as 1 items for the "
                                                                  "round's 2 completions"),
                        (lambda **_: {"completion_ids": [[1], [2]], "env_mask": [[1], [1, 0]]},
                         "returned env_mask for a completion in another length than the completion's"),
                        (lambda **_: {"completion_ids": [[1], [2]], "prompt_ids": [[1], [2]]},
                         "returned different prompt_ids for the completions of one prompt")]:
        box.rollout = fn
        with pytest.raises(ShardlmError, match=message):
            score_round(sampler, tok, prompts, [list(b"6 x 7?")], [3], rewards, g,
                        sampling_params(g, [eot], 0), box=box)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_loss_on_an_episode_is_trls_with_its_tool_mask(loss_type):
    """On the same multi-turn completions, shardlm's trained tokens (micro_batch's `lengths`, from
    Rollout.trainable) and loss equal TRL 1.16's `_compute_loss` given `tool_mask` (its completion_mask x tool_mask)."""
    from collections import defaultdict

    from trl.trainer.grpo_trainer import GRPOTrainer

    from shardlm.objectives.rl.loss import step_loss, token_loss

    tok = qwen_tokenizer()
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    g = GrpoConfig(group=2, max_completion_length=200, tools=["test_grpo_tools:multiply"])
    r = _episodes(tok, g, Scripted(tok, call, "42"))[3].rollout
    r.completions[1] = r.completions[1][:30]  # a shorter one: padding and the tool mask side by side
    r.trainable[1] = r.trainable[1][:30]
    padded = r.padded(0)
    _, _, _, lengths = micro_batch([r.prompt_of(i) for i in range(2)], r.completions, 0, torch.device("cpu"),
                                   r.trainable)
    mask = lengths.float()
    assert torch.equal(mask, (padded["completion_mask"] * padded["tool_mask"]).float())  # TRL's loss_mask
    gen = torch.Generator().manual_seed(0)
    logps = (-torch.rand(mask.shape, generator=gen) * 3).requires_grad_()
    old = logps.detach() + (torch.rand(mask.shape, generator=gen) - 0.5) * 0.8
    advantages = torch.tensor([1.1, -0.6])
    me = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, aux_loss_enabled=False, use_vllm=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        epsilon_low=0.2, epsilon_high=0.28, beta=0.0, loss_type=loss_type, importance_sampling_level="token",
        max_completion_length=200)
    inputs = {**padded, "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": None,
              "num_items_in_batch": mask.sum()}
    theirs = GRPOTrainer._compute_loss(me, None, inputs)
    parts = token_loss(logps, old, advantages, mask, 0.2, 0.28, 0.0, None, None, "token")
    mine = step_loss(parts.per_token, mask, loss_type, completions=2, tokens=mask.sum().item(),
                     max_completion_length=200)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(mine, logps)[0], torch.autograd.grad(theirs, logps)[0])


def test_the_tools_demos_task_keeps_its_held_out_pairs_out_and_renders_as_rl_asks(tmp_path, monkeypatch):
    """benchmarks/tools_demo.py: no held-out pair is in the warm-up or the RL prompts, and a warm-up conversation's
    prompt renders as the RL prompt with the tool's schema does (the system turn the template writes for it)."""
    import json

    from transformers import AutoTokenizer

    from helpers import benchmark_module

    demo = benchmark_module("tools_demo", monkeypatch)
    demo.write_task(tmp_path, 0, warmup=300, prompts=300, heldout=40)
    read = {name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("warmup.jsonl", "prompts.jsonl", "heldout.jsonl")}
    held = {r["prompt"][-1]["content"] for r in read["heldout.jsonl"]}
    assert len(held) == 40 and not held & {r["prompt"][-1]["content"] for r in read["prompts.jsonl"]}
    assert not held & {r["messages"][1]["content"] for r in read["warmup.jsonl"]}
    tok = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    box = load_toolbox(GrpoConfig(tools=[f"{tmp_path / 'calc.py'}:multiply"]), tok)
    warm = read["warmup.jsonl"][0]["messages"]
    as_rl = tok.apply_chat_template(warm[1:2], tools=box.schemas, add_generation_prompt=True, tokenize=False)
    assert as_rl == tok.apply_chat_template(warm[:2], add_generation_prompt=True, tokenize=False)
    call = parse_calls(warm[2]["content"], box.format)[0]  # the warm-up's call is one the run reads
    assert call.arguments["a"] * call.arguments["b"] == int(warm[3]["content"]) == int(warm[4]["content"])
