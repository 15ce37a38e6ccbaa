"""The search space of `shardlm sweep`: `--param KEY=KIND:ARGS` -> one Optuna distribution per config key.

    train.lr=loguniform:1e-4:1e-2        a float, sampled on a log scale (also: logfloat)
    train.weight_decay=uniform:0:0.2     a float (also: float); uniform:0:0.2:0.05 in steps of 0.05
    train.warmup_steps=int:0:200         an integer, both ends included; int:0:200:50 in steps of 50
    train.batch_size=logint:4:64         an integer on a log scale
    train.schedule=choice:cosine,wsd     one of the listed values (YAML scalars; also: categorical)

Every key is checked against the config's schema (with the nearest key for a misspelled one) and both ends of
a range, and each choice, against the config's own checks, before any trial starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import yaml

from shardlm import ShardlmError
from shardlm.config import KEY_ALIASES, all_keys, nearest

KINDS = {"loguniform": "float", "logfloat": "float", "uniform": "float", "float": "float", "int": "int",
         "logint": "int", "choice": "choice", "categorical": "choice"}
EXAMPLES = ("train.lr=loguniform:1e-4:1e-2", "train.warmup_steps=int:0:200", "train.schedule=choice:cosine,wsd")
FIXED = ("out_dir",)  # each trial has its own


@dataclass(frozen=True)
class Param:
    key: str
    kind: str  # float | int | choice
    low: float = 0.0
    high: float = 0.0
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    spec: str = ""  # as the user wrote it, after the key

    def suggest(self, trial) -> Any:
        """This parameter's value for an Optuna trial (a fixed value when the trial was enqueued)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.kind == "choice":
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high


def override(key: str, value: Any) -> str:
    """`key=value` as `shardlm train` reads it back (YAML: true, null, 0.001, text)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def _bad(text: str, why: str) -> ShardlmError:
    why = why if why.endswith(("?", ".")) else why + "."
    return ShardlmError(f"--param {text!r}: {why} Write KEY=KIND:ARGS, e.g. --param {EXAMPLES[0]} --param "
                        f"{EXAMPLES[1]} --param {EXAMPLES[2]} (docs/sweep.md).")


def _number(text: str, raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise _bad(text, f"{what} {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise _bad(text, f"{what} {raw!r} is not a finite number")
    return value


def _key(text: str, key: str) -> str:
    known = all_keys()
    key = KEY_ALIASES.get(key, key)
    if key in FIXED:
        raise _bad(text, "out_dir is the sweep's folder (each trial runs in OUT_DIR/trial_NNNN), not a parameter")
    if key not in known:
        raise _bad(text, f"unknown config key '{key}'.{nearest(key, list(known))}")
    return key


def parse_param(text: str) -> Param:
    """One `--param KEY=KIND:ARGS` (see the module's docstring)."""
    key, eq, spec = text.partition("=")
    if not eq or not key.strip():
        raise _bad(text, "no '='")
    key = _key(text, key.strip())
    kind_name, colon, args = spec.partition(":")
    kind_name = kind_name.strip().lower()
    if kind_name not in KINDS:
        close = nearest(kind_name, list(KINDS)) if kind_name else ""
        raise _bad(text, f"unknown distribution {kind_name!r} (the kinds: {', '.join(KINDS)}).{close}")
    kind = KINDS[kind_name]
    field_type = str(all_keys()[key].type)
    if kind == "choice":
        if not colon or not args.strip():
            raise _bad(text, "choice needs values: choice:A,B,C")
        choices = tuple(_scalar(text, v) for v in args.split(","))
        if len(set(map(repr, choices))) < len(choices):
            raise _bad(text, "a choice is listed twice")
        return Param(key, "choice", choices=choices, spec=spec)
    parts = args.split(":") if colon else []
    if len(parts) not in (2, 3):
        raise _bad(text, f"{kind_name} takes LOW:HIGH or LOW:HIGH:STEP, got {args!r}" if colon else
                   f"{kind_name} takes LOW:HIGH")
    low, high = _number(text, parts[0], "LOW"), _number(text, parts[1], "HIGH")
    step = _number(text, parts[2], "STEP") if len(parts) == 3 else None
    log = kind_name.startswith("log")
    if kind == "int" and not all(float(v).is_integer() for v in (low, high, step or 1)):
        raise _bad(text, f"{kind_name} takes whole numbers; use uniform:{parts[0]}:{parts[1]} for a float")
    if kind == "int" and "int" not in field_type:
        raise _bad(text, f"'{key}' is {field_type}: use uniform or loguniform for it")
    if kind == "float" and "float" not in field_type:
        hint = f"use int:{parts[0]}:{parts[1]} or logint" if "int" in field_type else "use choice:A,B"
        raise _bad(text, f"'{key}' is {field_type}, not a float: {hint}")
    if low >= high:
        raise _bad(text, f"LOW ({parts[0]}) must be below HIGH ({parts[1]})")
    if log and low <= 0:
        raise _bad(text, f"{kind_name} needs LOW > 0 (a log scale); use {'int' if kind == 'int' else 'uniform'} "
                         "to include 0")
    if step is not None and (step <= 0 or log):
        raise _bad(text, "STEP must be > 0, and a log scale takes none")
    return Param(key, kind, low, high, step, log, spec=spec)


def _scalar(text: str, raw: str) -> Any:
    for number in (int, float):  # YAML 1.1 reads 1e-3 as text
        with contextlib.suppress(ValueError):
            return number(raw)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        raise _bad(text, f"choice {raw!r} is not a single value (a number, word, true/false or null)")
    return value


def parse_space(texts: list[str]) -> list[Param]:
    params = [parse_param(t) for t in texts]
    seen: set[str] = set()
    for p in params:
        if p.key in seen:
            raise ShardlmError(f"--param {p.key} is given twice: give each key one distribution.")
        seen.add(p.key)
    return params


def parse_enqueued(text: str, params: list[Param]) -> dict[str, Any]:
    """`--enqueue 'train.lr=1e-3,train.warmup_steps=10'`: values to try first, each inside its parameter's range."""
    by_key = {p.key: p for p in params}
    values: dict[str, Any] = {}
    for item in re.split(r",(?=\s*[\w.]+=)", text):
        key, eq, raw = item.partition("=")
        key = KEY_ALIASES.get(key.strip(), key.strip())
        if not eq:
            raise ShardlmError(f"--enqueue {text!r}: {item!r} is not KEY=VALUE. Example: --enqueue "
                               "'train.lr=1e-3,train.warmup_steps=10'.")
        if key not in by_key:
            raise ShardlmError(f"--enqueue {text!r}: '{key}' is not a --param of this sweep "
                               f"({', '.join(by_key)}).{nearest(key, list(by_key))}")
        p = by_key[key]
        value = _scalar(text, raw)
        if p.kind == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)
        if not p.contains(value):
            where = f"one of {list(p.choices)}" if p.kind == "choice" else f"in [{p.low:g}, {p.high:g}]"
            raise ShardlmError(f"--enqueue {text!r}: {key}={raw} is not {where}, the range of --param "
                               f"{key}={p.spec}.")
        values[key] = value
    missing = [p.key for p in params if p.key not in values]
    if missing:
        raise ShardlmError(f"--enqueue {text!r} gives no value for {', '.join(missing)}: an enqueued trial "
                           "names every --param.")
    return values


def ends(param: Param) -> list[Any]:
    """The values whose configs are checked before the sweep starts: a range's two ends, every choice."""
    if param.kind == "choice":
        return list(param.choices)
    if param.kind == "int":
        return [int(param.low), int(param.high)]
    return [param.low, param.high]
