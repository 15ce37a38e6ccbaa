"""Reward functions of online RL (`grpo.rewards`): built-ins that need no code, and the user's own named
`module:function` (or `path/to/file.py:function`), called as TRL's `GRPOTrainer` calls them.

A reward function gets `prompts`, `completions` (strings; for conversational prompts, TRL's one-message lists
`[{"role": "assistant", "content": ...}]`), `completion_ids` and every other field of the prompt data as a
keyword list, one entry per completion, and returns one float per completion, or None where it does not apply.
Everything that can go wrong with a user's function is reported in one line naming the function (and, for a
value, the prompt), because a reward bug otherwise shows only as a run that does not learn.

Built-ins (`answer` is the reference field, as `eval --exact-match` and chat data's last answer provide it; each
returns None where a prompt's `answer` is None, never comparing with the text 'None'):
- `exact_match`: 1 when the completion equals `answer` after trimming whitespace at both ends, else 0 (the rule
  of `shardlm eval --exact-match`).
- `partial_match`: credit per character position, for answers that are built one character at a time (the
  bundled chat tasks' reverse and uppercase): 1 for the right character, 1/2 for the right letter in the wrong
  case, over the longer of the two trimmed texts, so missing and extra characters cost alike.
- `numeric`: 1 when the last number in the completion equals the last number in `answer`, else 0; None
  where `answer` holds no number (TRL's convention for a reference that cannot be parsed).
- `format`: 1 when the whole trimmed completion matches `grpo.format_pattern` (a regex; `.` matches newlines).
- `length`: DAPO's soft overlong penalty (TRL's `get_soft_overlong_punishment`), on the completion's tokens:
  0 up to max_completion_length - cache, then down linearly to -1 at max_completion_length.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.config import GrpoConfig, nearest
from shardlm.config.grpo import reward_weights

RewardFn = Callable[..., Sequence[float | None]]
SIGNATURE = "def f(prompts, completions, **kwargs) -> list[float | None]"
# Keywords every reward function is called with besides the data's fields (TRL passes the same three).
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def text_of(completion: Any) -> str:
    """A completion's text: itself, or the content of the last message of a conversational one."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def exact_match(completions: list, answer: list, **_: Any) -> list[float | None]:
    """None where the answer is None: no reference, never the text 'None'."""
    return [None if a is None else float(text_of(c).strip() == str(a).strip())
            for c, a in zip(completions, answer, strict=True)]


def partial_credit(text: str, reference: str) -> float:
    text, reference = text.strip(), reference.strip()
    width = max(len(text), len(reference))
    if not width:
        return 1.0
    pairs = zip(text, reference, strict=False)  # the longer text's extra characters score 0
    same = sum(1.0 if x == y else 0.5 if x.lower() == y.lower() else 0.0 for x, y in pairs)
    return same / width


def partial_match(completions: list, answer: list, **_: Any) -> list[float | None]:
    return [None if a is None else partial_credit(text_of(c), str(a))
            for c, a in zip(completions, answer, strict=True)]


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:  # a stray comma run such as "1,,"
        return None


def numeric(completions: list, answer: list, **_: Any) -> list[float | None]:
    out: list[float | None] = []
    for c, a in zip(completions, answer, strict=True):
        want, got = None if a is None else last_number(str(a)), last_number(text_of(c))
        out.append(None if want is None else float(got is not None and math.isclose(got, want, rel_tol=1e-9,
                                                                                     abs_tol=1e-9)))
    return out


def format_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.S)

    def format_match(completions: list, **_: Any) -> list[float | None]:
        return [float(compiled.fullmatch(text_of(c).strip()) is not None) for c in completions]

    return format_match


def length_reward(max_completion_length: int, cache: int) -> RewardFn:
    """DAPO's eq. 13, as TRL's get_soft_overlong_punishment."""
    def overlong(completion_ids: list, **_: Any) -> list[float | None]:
        out: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_length - cache:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((max_completion_length - cache - n) / cache)
            else:
                out.append(-1.0)
        return out

    return overlong


BUILTINS = ("exact_match", "partial_match", "numeric", "format", "length")
NEEDS_ANSWER = ("exact_match", "partial_match", "numeric")


@dataclass(frozen=True)
class Reward:
    name: str  # as configured: a built-in's name or module:function
    fn: RewardFn
    needs: tuple[str, ...]  # data fields it cannot do without


def builtin(name: str, g: GrpoConfig) -> Reward:
    if name == "format":
        if not g.format_pattern:
            raise ShardlmError("reward 'format' checks completions against grpo.format_pattern, which is not set: "
                               "set grpo.format_pattern to a regex (e.g. '<answer>.*</answer>').")
        try:
            return Reward(name, format_reward(g.format_pattern), ())
        except re.error as e:
            raise ShardlmError(f"grpo.format_pattern {g.format_pattern!r} is not a valid regex ({e}): "
                               "fix the pattern.") from None
    if name == "length":
        cache = g.max_completion_length // 4 if g.length_cache is None else g.length_cache
        if not 0 < cache <= g.max_completion_length:
            raise ShardlmError(f"grpo.length_cache must be in 1..grpo.max_completion_length "
                               f"({g.max_completion_length}), got {cache}: set it, or null for a quarter.")
        return Reward(name, length_reward(g.max_completion_length, cache), ())
    fn = {"exact_match": exact_match, "partial_match": partial_match, "numeric": numeric}[name]
    return Reward(name, fn, ("answer",))


def _import_module(spec: str, name: str, noun: str = "reward"):
    where = Path(spec).expanduser()
    if spec.endswith(".py"):
        if not where.is_file():
            raise ShardlmError(f"{noun} '{name}': file '{spec}' does not exist: give an existing .py file or an "
                               "importable module.")
        loader = importlib.util.spec_from_file_location(where.stem, where)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        return module
    # the shardlm command's sys.path lacks the current folder, where a user's rewards.py most often is
    sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(spec)
    finally:
        sys.path.remove(str(Path.cwd()))


def import_named(name: str, noun: str = "reward", key: str = "grpo.rewards") -> Any:
    """`module:attribute` (the module a .py file or an importable name), each failure one line naming `noun`."""
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr:
        raise ShardlmError(f"{key}: {noun} '{name}' is not module:name (e.g. my_tools.py:add or my_tools:add).")
    try:
        module = _import_module(module_name, name, noun)
    except ShardlmError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported the same way
        raise ShardlmError(f"{noun} '{name}': module '{module_name}' does not import ({type(e).__name__}: {e}). "
                           "Fix it, or put it in the current folder or on PYTHONPATH.") from None
    fn = getattr(module, attr, None)
    if fn is None:
        kind, wanted = ("class", inspect.isclass) if noun == "environment" else ("function", inspect.isfunction)
        names = [n for n, v in vars(module).items() if wanted(v) and not n.startswith("_")]
        hint = nearest(attr, names) or f" Its {kind}s: {', '.join(names) or 'none'}."
        raise ShardlmError(f"{noun} '{name}': module '{module_name}' has no '{attr}'.{hint} Name a {kind} of it.")
    if not callable(fn):
        raise ShardlmError(f"{noun} '{name}' is a {type(fn).__name__}, not a function: {SIGNATURE}." if
                           noun == "reward" else f"{noun} '{name}' is a {type(fn).__name__}, not callable.")
    return fn


def user_reward(name: str) -> Reward:
    return Reward(name, import_named(name), ())


def check_call(reward: Reward, fields: Sequence[str]) -> None:
    """The function can be called with the keywords it will get, and the data has every field it requires."""
    missing = [f for f in reward.needs if f not in fields]
    try:
        signature: inspect.Signature | None = inspect.signature(reward.fn)
    except (TypeError, ValueError):  # a builtin or extension callable without a signature: called as it is
        signature = None
    params = {} if signature is None else dict(signature.parameters)
    required = [n for n, p in params.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in CALL_KEYWORDS]
    missing += [n for n in required if n not in fields and n not in missing]
    if missing:
        partial = getattr(fields, "partial", {}).get(missing[0])  # prompts.FieldNames: some prompts hold it
        if partial:
            total, lacking, first = partial
            raise ShardlmError(f"reward '{reward.name}' needs the field '{missing[0]}', which {lacking:,} of the "
                               f"{total:,} prompts lack (the first: {first}; a null value counts as none): add it "
                               "to every record, or use another reward.")
        raise ShardlmError(f"reward '{reward.name}' needs the field '{missing[0]}', which the prompt data lacks "
                           f"(its fields: {', '.join(fields) or 'none besides the prompt'}): add it to every record, "
                           "or use another reward.")
    if signature is None:
        return
    try:
        signature.bind(**{k: [] for k in (*CALL_KEYWORDS, *fields)})
    except TypeError as e:
        raise ShardlmError(f"reward '{reward.name}' cannot be called with prompts, completions, completion_ids and "
                           f"the data's fields as keywords ({e}; its signature: {signature}). "
                           f"Define it as {SIGNATURE}.") from None


class RewardSet:
    """The configured rewards and their weights; `score` calls each once per batch and checks what it returns."""

    def __init__(self, rewards: list[Reward], weights: list[float]):
        self.rewards, self.weights = rewards, weights
        self.rounds = 0  # training rounds scored so far (rollout.check_applied: the first's all-None stops the run)
        self.warned = False  # check_applied's warning of a later round with every reward None (once a run)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def metric_names(self) -> list[str]:
        """The names the records give them (`rewards/<name>/mean`): a built-in's, a user function's own name as
        TRL records it (`path/rewards.py:fn` is `fn`), numbered from the second where two would share one."""
        out: list[str] = []
        for r in self.rewards:
            name = r.name.rpartition(":")[2] or r.name
            out.append(name if name not in out else f"{name}_{len(out)}")
        return out

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]],
              fields: dict[str, list]) -> torch.Tensor:
        """(completions, rewards) float32, NaN where a function returned None."""
        out = torch.empty(len(completions), len(self.rewards))
        for j, reward in enumerate(self.rewards):
            values = call(reward, prompts, completions, completion_ids, fields)
            out[:, j] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return out

    @property
    def weight_tensor(self) -> torch.Tensor:
        return torch.tensor(self.weights, dtype=torch.float32)


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _where(prompts: list, i: int) -> str:
    """`completion i (prompt '...')`: which completion, and the start of its prompt."""
    if i >= len(prompts):
        return f"completion {i}"
    prompt = prompts[i]
    text = (text_of(prompt) if isinstance(prompt, list) else str(prompt)).replace("\n", "\\n")
    return f"completion {i} (prompt {text if len(text) <= 60 else text[:57] + '...'!r})"


def call(reward: Reward, prompts: list, completions: list, completion_ids: list[list[int]],
         fields: dict[str, list]) -> list[float | None]:
    n = len(completions)
    try:
        values = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
    except Exception as e:  # noqa: BLE001 - the user's code: find the completion that fails, then say which
        i, e = _first_failure(reward, prompts, completions, completion_ids, fields, e)
        where = f" on {_where(prompts, i)}" if i is not None else ""
        raise ShardlmError(f"reward '{reward.name}' raised {type(e).__name__}: {e}{where}. Fix the function "
                           "(return None for a completion it cannot score).") from None
    try:  # text and mappings iterate too, but as characters or keys: not one number per completion
        if isinstance(values, (str, bytes, dict)):
            raise TypeError
        values = list(values)
    except TypeError:
        shown = f" ({_short(values)})" if isinstance(values, (str, bytes)) else ""
        raise ShardlmError(f"reward '{reward.name}' returned a {type(values).__name__}{shown}, not a list of "
                           f"numbers: it must return one float (or None) per completion ({SIGNATURE}).") from None
    if len(values) != n:
        raise ShardlmError(f"reward '{reward.name}' returned {len(values)} values for {n} completions: it must "
                           "return one float (or None) per completion, in order.")
    for i, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) and not _is_scalar_tensor(v)):
            raise ShardlmError(f"reward '{reward.name}' returned {v!r} ({type(v).__name__}) for {_where(prompts, i)}: "
                               "return a float, or None where it does not apply.")
        if v is not None and not math.isfinite(float(v)):
            raise ShardlmError(f"reward '{reward.name}' returned {float(v)} for {_where(prompts, i)}: rewards must "
                               "be finite; return None where a completion cannot be scored.")
    return values


def _is_scalar_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.numel() == 1


def _first_failure(reward: Reward, prompts: list, completions: list, completion_ids: list, fields: dict,
                   error: Exception) -> tuple[int | None, Exception]:
    for i in range(len(completions)):
        try:
            reward.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                      completion_ids=completion_ids[i:i + 1], **{k: v[i:i + 1] for k, v in fields.items()})
        except Exception as e:  # noqa: BLE001
            return i, e
    return None, error


def load_rewards(g: GrpoConfig, fields: Sequence[str]) -> RewardSet:
    """`grpo.rewards` and `grpo.reward_weights`, each function checked against the data's fields (every field
    of a prompt record but the prompt)."""
    weights = reward_weights(g)
    rewards = []
    for name in g.rewards:
        if name in BUILTINS:
            reward = builtin(name, g)
        elif ":" in name.strip(":") and not name.endswith(":"):
            reward = user_reward(name)
        else:
            raise ShardlmError(f"reward '{name}' is neither a built-in ({', '.join(BUILTINS)}) nor module:function."
                               f"{nearest(name, BUILTINS)}")
        check_call(reward, fields)
        rewards.append(reward)
    return RewardSet(rewards, weights)
