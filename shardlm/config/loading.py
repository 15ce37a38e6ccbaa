"""Run configuration: nested dataclasses, a YAML file and dotted `key=value` overrides.

OmegaConf structured configs do the parsing: one library gives YAML loading, dotted overrides and
type checking against the dataclasses, and it is what Hydra users already know. We add what it lacks:
unknown keys and bad values are reported with the nearest valid key or choice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardlm import ShardlmError
from shardlm.config import objectives
from shardlm.config.checks import canonical_sharding, validate
from shardlm.config.schema import KEY_ALIASES, Config, all_keys
from shardlm.config.suggest import nearest

# The scenario configs, shipped as package data; a checkout's top-level configs/ is a link to this folder.
BUNDLED_CONFIGS = Path(__file__).parent.parent / "configs"


def _sections() -> set[str]:
    return {k.split(".")[0] for k in all_keys() if "." in k}


def _check_keys(tree: dict[str, Any], source: str, prefix: str = "") -> None:
    known, sections = all_keys(), _sections()
    for key, value in tree.items():
        dotted = KEY_ALIASES.get(prefix + str(key), prefix + str(key))
        if dotted in sections and value is None:  # `train:` with every key commented out
            continue
        if isinstance(value, dict) and dotted in sections:
            _check_keys(value, source, dotted + ".")
        elif dotted in sections:
            example = next(k for k in known if k.startswith(dotted + "."))
            raise ShardlmError(f"'{dotted}' in {source} is a config section: it holds keys such as "
                               f"'{example}', not the value {value!r}.")
        elif dotted not in known:
            raise ShardlmError(f"unknown config key '{dotted}' in {source}.{nearest(dotted, list(known))}")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if value is None and prefix == "" and key in _sections():
            continue
        if isinstance(value, dict) and prefix == "":
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[KEY_ALIASES.get(prefix + key, prefix + key)] = value
    return flat


def split_args(rest: list[str]) -> tuple[list[str], list[str]]:
    """Command-line arguments with `=` are overrides, the others configs (later ones win; `config_path`
    resolves a file or a bundled name); each keeps its order."""
    return [a for a in rest if "=" not in a], [a for a in rest if "=" in a]


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.lr=1e-3", "data.val=null"]` -> `{"train.lr": 0.001, "data.val": None}` (YAML values)."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ShardlmError(
                f"override '{item}' is not key=value. Example: train.batch_size=16 parallel.sharding=grad_op"
            )
        key, raw = item.split("=", 1)
        key = KEY_ALIASES.get(key.strip(), key.strip())
        try:
            parsed[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            parsed[key] = raw
    return parsed


def _yaml_message(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line, ending with a fix: the problem, where, what it was inside of."""
    if isinstance(e, yaml.reader.ReaderError):
        code = ord(e.character) if isinstance(e.character, str) else e.character
        return f"character #x{code:04x} at position {e.position} is not allowed. Remove it: a config is plain text."
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split()).replace('in "<unicode string>", ', "") + "."
    mark, where = e.problem_mark, ""
    if e.context and e.context_mark is not None and e.context_mark.line != mark.line:
        where = f" ({e.context} from line {e.context_mark.line + 1})"
    problem = f"{e.problem or e.context} at line {mark.line + 1}, column {mark.column + 1}{where}."
    if "'\\t'" in problem:
        return f"{problem} Indent with spaces: YAML does not allow tabs."
    return (f"{problem} Check the indentation, quotes and brackets on that line or just above "
            "(a value holding ': ' or ' #' needs quotes); configs/ has examples.")


def _yaml_kind(tree: object) -> str:
    kinds = {list: "list", str: f"plain string {str(tree)[:40]!r}", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(tree), type(tree).__name__)


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise ShardlmError(f"config file '{path}' is a folder. Pass a YAML file (see configs/) or none.")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ShardlmError(f"config file '{path}' is not UTF-8 text (byte {e.start}). Save it as UTF-8.") from None


def bundled_configs() -> dict[str, Path]:
    """The scenario configs shipped in the package, by name: `shardlm train shakespeare_tiny` runs one."""
    return {p.stem: p for p in sorted(BUNDLED_CONFIGS.glob("*.yaml"))}


def config_summary(path: Path) -> str:
    """A config's first comment line, what `shardlm configs` prints beside its name."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return next((line.lstrip("#").strip() for line in lines if line.startswith("#")), "")


DATA_SUFFIXES = {".txt", ".csv", ".tsv", ".jsonl", ".json", ".parquet", ".arrow", ".gz", ".zst", ".bz2", ".xz", ".md"}


def config_path(arg: str | Path) -> Path:
    """The one place a config argument becomes a file: a path that exists, else a bundled config by name
    (`shakespeare_tiny` or `shakespeare_tiny.yaml`, no folder)."""
    path, bundled = Path(arg), bundled_configs()
    if path.exists():
        return path
    name = path.name.removesuffix(".yaml")
    if str(path) != path.name:  # a path with a folder is a file, never a name
        problem = f"config file '{arg}' not found."
        problem += f" Did you mean the bundled '{name}' (no folder)?" if name in bundled else ""
    elif name in bundled:
        return bundled[name]
    else:
        problem = f"config '{arg}' is neither a file nor a bundled config.{nearest(name, list(bundled))}"
    raise ShardlmError(f"{problem} Pass a YAML file, none, or a bundled config by name: {', '.join(bundled)} "
                       "(`shardlm configs` describes them).")


def _data_hint(path: Path) -> str:
    if path.suffix.lower() not in DATA_SUFFIXES:
        return ""
    return (f" '{path.name}' looks like data: train on it with data.train={path} (arguments before the first "
            "key=value are read as config files).")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(_read_text(path)) or {}
    except yaml.YAMLError as e:
        raise ShardlmError(f"config file '{path}' is not valid YAML: {_yaml_message(e)}{_data_hint(path)}") from None
    if not isinstance(tree, dict):
        raise ShardlmError(
            f"config file '{path}' holds a {_yaml_kind(tree)}, not a mapping of sections: write sections such as "
            "'train:' with indented 'batch_size: 8' lines (see configs/). Arguments before the first key=value "
            f"are read as config files.{_data_hint(path)}")
    _check_keys(tree, str(path))
    return _flatten(saved_before_changes(tree))


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file(s), later ones winning <- overrides, type-checked; then cross-field validation.
    A pretrained model gets fine-tuning defaults for the keys no file or override gave (`task_defaults`), before
    the cross-field checks (which see rloo's grpo.group, not grpo's)."""
    values: dict[str, Any] = {}
    for one in [] if path is None else path if isinstance(path, list) else [path]:
        values.update(_read_yaml(config_path(one)))
    cli = parse_overrides(overrides or [])
    _check_keys(dict(cli), "the command line")
    values.update(cli)
    cfg = build_config(values, check=False)
    for key, value in task_defaults(cfg).items():
        if key not in values:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
    validate(cfg)
    return cfg


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# The from-scratch defaults (lr 3e-3, warmup 20, decay 0.1) erase much of what a pretrained model knows in its
# first steps. Fine-tuning takes HF Trainer's defaults (lr 5e-5, 3 epochs, no warmup, no weight decay) and, for
# LoRA, the 2e-4 of PEFT's examples and of configs/llama_lora.yaml: adapters start at zero and need a larger step.
FINETUNE_DEFAULTS: dict[str, float] = {"train.lr": 5e-5, "train.epochs": 3.0, "train.warmup_steps": 0,
                                       "train.weight_decay": 0.0}
LORA_LR = 2e-4


def task_defaults(cfg: Config) -> dict[str, float]:
    """The defaults of the run's task that differ from the dataclass's: none from scratch (model.name null) but
    the objective's own (TRL's config for it: rloo's group and beta)."""
    s = objectives.spec(cfg)
    if cfg.model.name is None:
        return dict(s.defaults)
    lr = s.lr or (LORA_LR if cfg.lora.r > 0 else FINETUNE_DEFAULTS["train.lr"])
    return {**FINETUNE_DEFAULTS, "train.lr": lr, **s.defaults}


def task_defaults_note(cfg: Config) -> str | None:
    """One line for the run header naming the fine-tuning defaults in effect, so a user who expected the
    from-scratch ones (or docs/finetune.md's table) sees why; None from scratch or when every one was overridden."""
    unused = {"train.epochs"} if cfg.train.max_steps is not None else set()  # max_steps sets the run's length
    used = [f"{key}={value:g}" for key, value in task_defaults(cfg).items()
            if _value(cfg, key) == value and key not in unused]
    if not used:
        return None
    s = objectives.spec(cfg)
    trl = f"TRL's {s.peer}"
    if cfg.model.name is None:
        return f"train.objective={cfg.train.objective} defaults ({trl}): {', '.join(used)}; set any to override"
    what = "a pretrained model with LoRA" if cfg.lora.r > 0 else "a pretrained model"
    rl = f"; train.objective={cfg.train.objective} takes {trl}'s" if s.lr is not None else ""
    return f"fine-tuning defaults (model.name is {what}{rl}): {', '.join(used)}; set any to override"


def build_config(flat: dict[str, Any], check: bool = True) -> Config:
    known = all_keys()
    schema = OmegaConf.structured(Config)
    for key, value in flat.items():
        if key not in known:
            raise ShardlmError(f"unknown config key '{key}'.{nearest(key, list(known))}")
        if key == "data.train":
            value = _as_spec(value)
        if key == "parallel.compile" and isinstance(value, bool):  # YAML true/false, as before `model`/`blocks`
            value = "model" if value else "false"
        if key == "parallel.activation_checkpointing" and isinstance(value, bool):  # as before the modes
            value = "full" if value else "none"
        if key == "lora.target_modules" and isinstance(value, str):
            if value != "all-linear":  # PEFT's keyword: every linear layer but the head, i.e. the default
                raise ShardlmError(f"lora.target_modules={value!r}: give a list of module names such as "
                                   "[q_proj,v_proj], or null (or all-linear) for every linear layer of the blocks.")
            value = None
        try:
            OmegaConf.update(schema, key, value, merge=False)
        except OmegaConfBaseException:
            expected = getattr(known[key].type, "__name__", str(known[key].type))
            raise ShardlmError(
                f"config key '{key}' expects {expected}, got {value!r} ({type(value).__name__})."
            ) from None
    cfg = cast(Config, OmegaConf.to_object(schema))  # the structured schema gives back a Config
    cfg.parallel.sharding = canonical_sharding(cfg.parallel.sharding)
    if check:
        validate(cfg)
    return cfg


def _as_spec(value: Any) -> Any:
    """A path or number given for data.train (or an entry of its list) is its text, as for any str key."""
    if isinstance(value, (list, tuple)):
        return [_as_spec(v) for v in value]
    return str(value) if isinstance(value, (Path, int, float)) else value


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_flat_dict(cfg: Config) -> dict[str, Any]:
    """`{"train.lr": ..., "out_dir": ...}`: what `build_config` takes back, with overrides merged in."""
    return _flatten(to_dict(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """YAML with the public key names (`checkpoint.async`, not the field's `async_save`)."""
    tree = to_dict(cfg)
    tree["checkpoint"]["allow_changes"] = False  # one invocation's permission: a later resume asks again
    for public, field_name in KEY_ALIASES.items():
        section, name = field_name.split(".")
        tree[section] = {public.split(".")[1] if k == name else k: v for k, v in tree[section].items()}
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a Config saved by `save_config` (checkpoints carry one), ignoring keys removed since."""
    known = all_keys()
    return build_config({k: v for k, v in _flatten(saved_before_changes(tree)).items() if k in known})


# Defaults that changed: (section, key, the value runs saved before the key existed trained with). A run's saved
# config lists every key of its time, so one without the key was written before it and keeps its old behaviour on
# resume, eval and export (a chat run's masks, a DPO run's stored reference) instead of taking the new default.
CHANGED_DEFAULTS = [("data", "answer_end", "end_of_turn")]
_SAVED_MARKS = {"data": {"train", "weights", "val", "val_fraction", "seq_len", "text_field", "cache_dir"},
                "model": {"vocab_multiple", "config_overrides", "trust_remote_code"}}


def saved_before_changes(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` with the old values of CHANGED_DEFAULTS filled in when it is a whole config saved before them."""
    saved = all(isinstance(tree.get(s), dict) and keys <= tree[s].keys() for s, keys in _SAVED_MARKS.items())
    if not saved:
        return tree
    tree = {s: dict(v) if isinstance(v, dict) else v for s, v in tree.items()}
    for section, key, old in CHANGED_DEFAULTS:
        tree[section].setdefault(key, old)
    return tree
