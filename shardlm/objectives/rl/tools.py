"""Tools and environments for online RL, with TRL's meanings (`tools`, `max_tool_calling_iterations`,
`environment_factory`): what the model may call, how a call is read from its turn, run, and written back.

- `grpo.tools: [module:function, ...]`: each function's signature and docstring become the chat template's tool
  schema (transformers' `get_json_schema`, as `apply_chat_template(tools=...)` takes them).
- `grpo.environment_factory: module:Class`: one instance per completion; `reset(**fields)` (the prompt's record
  fields) returns the first observation (appended to the last prompt message, as TRL does) or None; its public
  methods (no leading `_`, not `reset` or `get_reward`) are tools bound to that instance; `get_reward()`, if
  defined, joins the reward functions under the class's name.
- Calls are parsed from the format the chat template renders them in: Hermes/Qwen2.5 (`<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`, any number in a turn) or Llama 3.1 (a turn that is `{"name": ...,
  "parameters": {...}}`). A template that renders neither is refused in one line.
- A bad call is the tool's message, never an exception out of the run: a malformed call, an unknown function,
  arguments that are not an object or do not fit the signature, an exception, a timeout (`grpo.tool_timeout`).
  Results and errors are written as TRL writes them: `str(result)`, `str({"error": message})`.
- The tool turn's ids are the template's own: the rendering of [user, assistant(tool_calls)] + the tool messages
  with the generation prompt, less the rendering without them cut after its last end-of-turn token (TRL's
  `_get_tool_suffix_ids`): the whole of it, the next assistant header included, is context and not trained.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardlm import ShardlmError
from shardlm.config import GrpoConfig
from shardlm.objectives.rl.rewards import Reward, RewardSet, import_named

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
FORMATS = ("hermes", "llama3")
NOT_TOOLS = ("reset", "get_reward")


@dataclass
class Call:
    name: str
    arguments: Any = None  # a dict when the call is well formed
    error: str | None = None  # why the call could not be read


@dataclass
class Toolbox:
    """What `grpo.tools` and `grpo.environment_factory` load: the functions, the environment class, their schemas
    (the environment's from a probe instance: its methods' schemas do not depend on the instance)."""
    functions: dict[str, Callable]
    factory: type | None
    schemas: list[dict]
    format: str
    max_iterations: int
    timeout: float
    env_methods: list[str] = field(default_factory=list)
    rollout: Callable | None = None  # grpo.rollout_func: the round is the function's (no tools)
    rollout_name: str = ""

    def episode(self, fields: dict) -> tuple[dict[str, Callable], Any, str | None]:
        """One completion's tools, its environment (None without a factory) and reset's observation."""
        if self.factory is None:
            return self.functions, None, None
        env = self.factory()
        observation = env.reset(**fields)
        if observation is not None and not isinstance(observation, str):
            raise ShardlmError(f"{self.factory.__name__}.reset returned a {type(observation).__name__}: it must "
                               "return the first observation as text, or None.")
        return {**self.functions, **{m: getattr(env, m) for m in self.env_methods}}, env, observation

    @property
    def rewarding(self) -> bool:
        return self.factory is not None and callable(getattr(self.factory, "get_reward", None))


def schema(fn: Callable, what: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException / TypeHintParsingException
        raise ShardlmError(f"{what} cannot be described to the model: {str(e).splitlines()[0]} The tool schema is "
                           "read from the signature and the docstring: give every argument a type hint and an "
                           "'Args:' line (Google style), as transformers' get_json_schema needs.") from None


def env_tools(factory: type) -> list[str]:
    """The methods of an environment class that are tools (TRL's rule: functions defined on the class, not
    reset or get_reward, no leading underscore)."""
    if not callable(getattr(factory, "reset", None)):
        raise ShardlmError(f"grpo.environment_factory '{factory.__name__}' has no reset method: an environment "
                           "defines reset(**fields) returning the first observation (or None), and its public "
                           "methods are the tools.")
    return [name for name, _ in inspect.getmembers(factory, inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


def load_toolbox(g: GrpoConfig, tok) -> Toolbox | None:
    """The run's tools (None when it has none); the template must render tool calls in a format read here (`tok`
    None: not asked, for a caller that runs no episode)."""
    if g.rollout_func:
        return Toolbox({}, None, [], "", 0, 0.0, rollout=import_named(g.rollout_func, "rollout function",
                                                                    "grpo.rollout_func"), rollout_name=g.rollout_func)
    if not g.tools and not g.environment_factory:
        return None
    functions = {}
    for spec in g.tools:
        fn = import_named(spec, "tool", "grpo.tools")
        functions[fn.__name__] = fn
    factory, methods = None, []
    if g.environment_factory:
        factory = import_named(g.environment_factory, "environment", "grpo.environment_factory")
        if not isinstance(factory, type):
            raise ShardlmError(f"grpo.environment_factory '{g.environment_factory}' is a "
                               f"{type(factory).__name__}, not a class: give module:Class.")
        methods = env_tools(factory)
    schemas = [schema(fn, f"tool '{name}'") for name, fn in functions.items()]
    if factory is not None:
        schemas += [schema(getattr(factory, m), f"{factory.__name__}.{m}") for m in methods
                    if m not in functions]
    if not schemas:
        raise ShardlmError(f"grpo.environment_factory '{g.environment_factory}' has no public method besides reset "
                           "and get_reward, and grpo.tools is empty: the model would have nothing to call.")
    iterations = g.max_tool_calling_iterations
    fmt = tool_format(tok) if tok is not None else ""  # None: the pre-run reward probe, which parses no call
    return Toolbox(functions, factory, schemas, fmt, 1 << 30 if iterations is None else iterations,
                   g.tool_timeout, methods)


def tool_format(tok) -> str:
    """The call format of the tokenizer's chat template, from what it renders."""
    template = str(getattr(tok, "chat_template", None) or "")
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template:
        return "llama3"
    raise ShardlmError(f"grpo.tools: the chat template of tokenizer '{getattr(tok, 'name_or_path', '')}' renders "
                       "no tool calls in a format shardlm reads (Hermes/Qwen2.5 <tool_call> JSON, Llama 3.1 JSON). "
                       "Set model.chat_template to such a template (Qwen2.5's or Llama 3.1's, a .jinja file).")


def parse_calls(text: str, fmt: str) -> list[Call]:
    """The calls of one model turn (its text, special tokens left out); [] when it calls nothing."""
    if fmt == "hermes":
        return [_call(block.strip(), "arguments") for block in HERMES_CALL.findall(text)]
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if body.startswith("{") and '"name"' in body:
        return [_call(body, "parameters")]
    return []


def _call(body: str, arguments_key: str) -> Call:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return Call("", error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return Call("", error='the tool call must be a JSON object with a "name" string')
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some templates and models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return Call(value["name"], {} if arguments is None else arguments)


def run_call(functions: dict[str, Callable], call: Call, timeout: float) -> tuple[str, bool]:
    """The tool message's content and whether the call failed."""
    if call.error:
        return _error(call.error)
    fn = functions.get(call.name)
    if fn is None:
        return _error(f"Tool {call.name} not found.")
    if not isinstance(call.arguments, dict):
        return _error(f"the arguments of {call.name} must be a JSON object, got {type(call.arguments).__name__}")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return _error(f"{call.name}: {e}")
    try:
        if timeout > 0:
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            try:
                result = pool.submit(fn, **call.arguments).result(timeout=timeout)
            finally:
                pool.shutdown(wait=False)  # a tool that never returns keeps its thread, not the run
        else:
            result = fn(**call.arguments)
    except concurrent.futures.TimeoutError:
        return _error(f"Tool {call.name} timed out after {timeout:g} s.")
    except Exception as e:  # noqa: BLE001 - the model's call failed: it reads why, as TRL writes it
        return _error(str(e))
    return str(result), False


def _error(message: str) -> tuple[str, bool]:
    return str({"error": message}), True


def tool_turn_ids(tok, messages: list[dict], end_of_turn: int) -> list[int]:
    """The ids of the tool messages' turn and the next generation prompt, as the chat template renders them
    after an assistant turn that called tools (TRL's `_get_tool_suffix_ids`)."""
    called = [{"role": "user", "content": "dummy"},
              {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]}]
    prefix = tok.apply_chat_template(called, add_generation_prompt=False, tokenize=True,
                                     return_dict=True)["input_ids"]
    full = tok.apply_chat_template(called + messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    ends = [i for i, t in enumerate(prefix) if t == end_of_turn]
    prefix = prefix[:ends[-1] + 1] if ends else prefix
    if list(full[:len(prefix)]) != list(prefix):
        raise ShardlmError("the chat template renders the turns before a tool result differently once it follows, "
                           "so the tool turn's tokens cannot be appended to what the model generated: use a "
                           "template that keeps earlier turns unchanged (Qwen2.5's, Llama 3.1's).")
    return list(full[len(prefix):])


def tool_fields(fields: list[str], box: Toolbox | None) -> list[str]:
    """The keywords the reward functions are called with besides the data's: `environments` (each completion's
    environment instance) when there is an environment_factory, as TRL passes it."""
    return [*fields, "environments"] if box is not None and box.factory is not None else fields


def with_environment_reward(rewards: RewardSet, box: Toolbox | None) -> RewardSet:
    """The environment's get_reward() joins the rewards under its class's name, weight 1 (TRL's rule)."""
    if box is None or not box.rewarding:
        return rewards
    assert box.factory is not None

    def get_reward(environments: list, **_: Any) -> list[float | None]:
        return [env.get_reward() for env in environments]

    rewards.rewards.append(Reward(box.factory.__name__, get_reward, ()))
    rewards.weights.append(1.0)
    return rewards


def dummy_call(name: str, fmt: str) -> str:
    """A call of `name` with no arguments as a model writes it in the template's format."""
    body = json.dumps({"name": name, "arguments" if fmt == "hermes" else "parameters": {}})
    return f"<tool_call>\n{body}\n</tool_call>" if fmt == "hermes" else body


def probe_tools(box: Toolbox | None, tok, fields: dict) -> list[str]:
    """The dry run's lines: the tools the schema offers, and a dummy call of the first parsed, run and written
    back as its tool turn (an environment made and reset from the first prompt's fields first)."""
    if box is None or box.rollout is not None:
        return [f"completions made by grpo.rollout_func '{box.rollout_name}'"] if box else []
    from shardlm.tokenizer import end_of_turn_id

    tools, _, observation = box.episode(fields)
    names = [s["function"]["name"] for s in box.schemas]
    call = dummy_call(names[0], box.format)
    parsed = parse_calls(call, box.format)
    content, failed = run_call(tools, parsed[0], box.timeout)
    turn = tool_turn_ids(tok, [{"role": "tool", "name": parsed[0].name, "content": content}], end_of_turn_id(tok))
    seen = f"; reset's observation: {observation!r}" if observation else ""
    return [f"tools ({box.format} calls, at most {box.max_iterations if box.max_iterations < 1 << 30 else 'unlimited'}"
            f" rounds): {', '.join(names)}{seen}",
            f"a dummy call {call!r} parses to {parsed[0].name}({parsed[0].arguments}) and "
            f"{'fails' if failed else 'returns'}; its tool turn (context, not trained):\n{tok.decode(turn)}"]
