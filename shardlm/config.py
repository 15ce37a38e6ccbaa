"""Run configuration: nested dataclasses, a YAML file and dotted `key=value` overrides.

OmegaConf structured configs do the parsing: one library gives YAML loading, dotted overrides and
type checking against the dataclasses, and it is what Hydra users already know. We add what it lacks:
unknown keys and bad values are reported with the nearest valid key or choice.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from shardlm import ShardlmError

SHARDINGS = ("full", "grad_op", "no_shard", "hybrid_full", "hybrid_grad")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
COMPILES = ("auto", "model", "blocks", "false")
LAUNCHERS = ("auto", "torchrun", "slurm", "mpi", "single")
# The scenario configs, shipped as package data; a checkout's top-level configs/ is a link to this folder.
BUNDLED_CONFIGS = Path(__file__).parent / "configs"
# `checkpoint.async` is the public name; `async` is a Python keyword, so the field is `async_save`.
KEY_ALIASES = {"checkpoint.async": "checkpoint.async_save"}
# ZeRO stages and FSDP1 / HF Trainer names (docs/distributed.md's table), keyed like `_sharding_key` spells them.
SHARDING_ALIASES = {
    "zero3": "full", "fullshard": "full",
    "zero2": "grad_op", "shardgradop": "grad_op",
    "zero0": "no_shard", "ddp": "no_shard",
    "hybridshard": "hybrid_full", "hybridshardzero2": "hybrid_grad",
}
CHOICE_HINTS = {"parallel.sharding": " ZeRO / FSDP1 names work too: zero3 or FULL_SHARD = full, zero2 or "
                                     "SHARD_GRAD_OP = grad_op, zero0, ddp or NO_SHARD = no_shard, "
                                     "HYBRID_SHARD = hybrid_full, hybrid_shard_zero2 = hybrid_grad."}


# auto, or the transformers attn_implementation used as given (sdpa: transformers' own masks)
ATTENTION_CHOICES = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelConfig:
    name: str | None = None  # hub name or local HF folder; None = from scratch
    arch: str = "gpt2"  # from scratch: an HF model_type (gpt2, llama, qwen2, mistral, ...)
    n_layer: int = 4  # transformer blocks (from scratch)
    n_head: int = 4  # attention heads (from scratch)
    n_kv_head: int | None = None  # key/value heads for grouped-query attention (from scratch); None = n_head
    n_embd: int = 192  # model width (from scratch)
    intermediate_size: int | None = None  # MLP width (from scratch); None = the family's default
    n_positions: int | None = None  # context length (from scratch); None = data.seq_len, every position trained
    vocab_multiple: int = 1  # from scratch: pad the vocabulary to a multiple of this (64 on GPUs: aligned lm_head)
    config_overrides: dict[str, Any] = field(default_factory=dict)  # any other HF config fields (from scratch)
    dropout: float = 0.0  # residual, embedding and attention dropout (also set on pretrained models)
    attention: str = "auto"  # auto = SDPA (causal kernels, no mask), else eager; or sdpa, eager, flash_attention_2, ...
    tokenizer: str | None = None  # None = the model's own, bytes from scratch; or bytes, gpt2, a folder, a hub name
    trust_remote_code: bool = False  # allow Hub models that ship their own code (off: safe by default)


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank; 0 = off (full fine-tuning)
    alpha: float = 16.0  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.0  # dropout on the LoRA path
    target_modules: list[str] | None = None  # module names to adapt; None (or all-linear) = every linear of the blocks
    quantize: str | None = None  # nf4 = QLoRA (bitsandbytes, CUDA only); None = base weights in parallel.precision


@dataclass
class DataConfig:
    train: str | list[str] = "shakespeare"  # file, folder, "hf:name[/config][:split]", "shakespeare"; list = mixture
    weights: list[float] | None = None  # sampling weight of each source of a list data.train; None = their sizes
    val: str | None = None  # None = hold out `val_fraction` of train
    val_fraction: float = 0.1  # tail of data.train held out for validation when data.val is null
    seq_len: int = 128  # tokens per packed training block
    text_field: str = "text"  # column of .csv / field of .jsonl / HF dataset column
    hf_rows_are_documents: bool = True  # False for line-per-row datasets such as wikitext (no EOS per row)
    cache_dir: str | None = None  # token cache; None = ~/.cache/shardlm (or $SHARDLM_CACHE)
    data_files: Any = None  # for hf:json / hf:parquet / hf:csv / hf:text: a path, glob, list, or {split: files}


@dataclass
class TrainConfig:
    batch_size: int = 32  # per-device micro-batch, in blocks of seq_len tokens
    grad_accum: int = 1  # micro-batches per optimizer step (no gradient sync until the last)
    max_steps: int | None = None  # wins over epochs when set; 0 = evaluate only
    epochs: float = 2.0  # passes over data.train when max_steps is null; 0 = evaluate only; 3 when fine-tuning
    lr: float = 3e-3  # peak learning rate (AdamW); fine-tuning (model.name set): 5e-5, with LoRA (lora.r > 0) 2e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20  # linear warmup, then cosine decay; 0 when fine-tuning
    weight_decay: float = 0.1  # AdamW decay on matrices; biases, norms get none; 0.0 when fine-tuning
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # 0 = off
    eval_every: int = 50  # steps between validations; 0 = only at the end
    eval_batches: int = 8  # micro-batches per rank per evaluation; 0 = the whole validation set
    log_every: int = 25  # steps between training records and console lines
    seed: int = 1337  # init, data order and dropout
    loss_chunk_size: int | None = None  # tokens per lm_head/loss chunk; 0 = plain full-logits loss; null = auto
    max_bad_steps: int = 5  # consecutive non-finite losses before the run stops
    sample_tokens: int = 200  # tokens generated at the end of training as a sample; 0 = none
    sample_prompt: str = "\n"  # prompt of that sample
    gen_every: int = 0  # every N steps: generation-quality metrics (split "gen", as eval --generation); 0 = off
    gen_samples: int = 32  # held-out prompts sampled for those metrics


@dataclass
class ParallelConfig:
    sharding: str = "full"  # full | grad_op | no_shard | hybrid_full | hybrid_grad
    shard_size: int = 0  # hybrid shard-group size; 0 = ranks per node
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (params/compute; gradients reduce in fp32; fp8 = Hopper+)
    fsdp: bool | None = None  # null = FSDP2 when world size > 1 or cpu_offload; true = also on one rank
    cpu_offload: bool = False  # keep params, grads and optimizer state in CPU RAM (FSDP2 CPUOffloadPolicy)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory, ~30% more compute
    compile: str = "auto"  # model (whole model + loss), blocks (each block), false; auto = model on CUDA, else false
    prefetch: int = 1  # FSDP2 explicit forward/backward prefetch depth; 0 = implicit
    device: str = "auto"  # auto (cuda if visible; xla if PJRT_DEVICE names an accelerator), cpu, cuda or xla
    launcher: str = "auto"  # auto, torchrun, slurm, mpi or single
    timeout_s: int = 600  # collective timeout: a dead rank brings the others down after this


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2  # complete checkpoints kept (newest first)
    resume: str = "auto"  # auto (newest in out_dir), none, or a checkpoint / run dir path
    async_save: bool = False  # DCP async save: training goes on while shards are written
    export_final: bool = False  # write a Hugging Face folder to OUT_DIR/hf at the end
    save_final: bool = True  # checkpoint when training ends


@dataclass
class LogConfig:
    tensorboard: bool = True  # also write TensorBoard scalars to OUT_DIR/tensorboard
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise), bar, lines or none
    wandb: bool = False  # also log to Weights & Biases (`pip install shardlm[wandb]`; WANDB_MODE=offline works)
    mlflow: bool = False  # also log to MLflow (`pip install shardlm[mlflow]`)
    project: str = "shardlm"  # W&B project / MLflow experiment
    run_name: str | None = None  # W&B / MLflow run name; None = the out_dir's folder name
    entity: str | None = None  # W&B team or user; None = your default
    mlflow_uri: str | None = None  # MLflow tracking URI; None = a local file store in OUT_DIR/mlruns


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    out_dir: str = "runs/default"  # metrics, config, checkpoints and exports of the run


def all_keys(cls: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted leaf key of the config, mapped to its dataclass field."""
    keys: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            keys.update(all_keys(f.default_factory, prefix + f.name + "."))
        else:
            keys[prefix + f.name] = f
    return keys


# Other trainers' names for shardlm keys (HF TrainingArguments, ...): suggested before spelling neighbours
ALIASES = {"learning_rate": "lr", "lerning_rate": "lr", "per_device_train_batch_size": "batch_size",
           "gradient_accumulation_steps": "grad_accum", "num_train_epochs": "epochs", "max_grad_norm": "grad_clip",
           "adam_beta1": "beta1", "adam_beta2": "beta2", "block_size": "seq_len", "output_dir": "out_dir"}


def nearest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    prefix, _, tail = word.rpartition(".")
    alias = ALIASES.get(tail)
    if alias is not None:
        same = [c for c in choices if c.rsplit(".", 1)[-1] == alias]
        best = [c for c in same if c.rpartition(".")[0] == prefix] or same
        if best:
            return f" Did you mean '{best[0]}'?"
    same_tail = [c for c in choices if c.rsplit(".", 1)[-1] == tail]  # `lr` -> train.lr, not the closer lora.r
    if same_tail:
        return f" Did you mean {' or '.join(repr(c) for c in same_tail)}?"
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.4)
    if not match:  # try the last component alone: "batchsize" -> "train.batch_size"
        tails = {c.rsplit(".", 1)[-1]: c for c in choices}
        hit = difflib.get_close_matches(word.rsplit(".", 1)[-1], list(tails), n=1, cutoff=0.6)
        match = [tails[hit[0]]] if hit else []
    return f" Did you mean '{match[0]}'?" if match else ""


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
    return _flatten(tree)


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file(s), later ones winning <- overrides, type-checked; then cross-field validation.
    A pretrained model gets fine-tuning defaults for the keys no file or override gave (`task_defaults`)."""
    values: dict[str, Any] = {}
    for one in [] if path is None else path if isinstance(path, list) else [path]:
        values.update(_read_yaml(config_path(one)))
    cli = parse_overrides(overrides or [])
    _check_keys(dict(cli), "the command line")
    values.update(cli)
    cfg = build_config(values)
    for key, value in task_defaults(cfg).items():
        if key not in values:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, value)
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
    """The defaults of the run's task that differ from the dataclass's: none from scratch (model.name null)."""
    if cfg.model.name is None:
        return {}
    return {**FINETUNE_DEFAULTS, "train.lr": LORA_LR if cfg.lora.r > 0 else FINETUNE_DEFAULTS["train.lr"]}


def task_defaults_note(cfg: Config) -> str | None:
    """One line for the run header naming the fine-tuning defaults in effect, so a user who expected the
    from-scratch ones (or docs/finetune.md's table) sees why; None from scratch or when every one was overridden."""
    used = [f"{key}={value:g}" for key, value in task_defaults(cfg).items() if _value(cfg, key) == value]
    if not used:
        return None
    what = "a pretrained model with LoRA" if cfg.lora.r > 0 else "a pretrained model"
    return f"fine-tuning defaults (model.name is {what}): {', '.join(used)}; set any to override"


def build_config(flat: dict[str, Any]) -> Config:
    known = all_keys()
    schema = OmegaConf.structured(Config)
    for key, value in flat.items():
        if key not in known:
            raise ShardlmError(f"unknown config key '{key}'.{nearest(key, list(known))}")
        if key == "data.train":
            value = _as_spec(value)
        if key == "parallel.compile" and isinstance(value, bool):  # YAML true/false, as before `model`/`blocks`
            value = "model" if value else "false"
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
    cfg: Config = OmegaConf.to_object(schema)  # type: ignore[assignment]
    cfg.parallel.sharding = canonical_sharding(cfg.parallel.sharding)
    validate(cfg)
    return cfg


def _as_spec(value: Any) -> Any:
    """A path or number given for data.train (or an entry of its list) is its text, as for any str key."""
    if isinstance(value, (list, tuple)):
        return [_as_spec(v) for v in value]
    return str(value) if isinstance(value, (Path, int, float)) else value


def _sharding_key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def canonical_sharding(name: str) -> str:
    """shardlm's name for a sharding strategy given in any case, or as a ZeRO / FSDP1 name; else unchanged."""
    canonical = {_sharding_key(s): s for s in SHARDINGS}
    key = _sharding_key(name)
    return canonical.get(key) or SHARDING_ALIASES.get(key, name)


def _positive(name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ShardlmError(f"{name} must be {bound}, got {value}.")


def validate(cfg: Config) -> None:
    """Checks that need no hardware or world size; those that do live in parallel.check_feasible."""
    for name, value, choices in (
        ("parallel.sharding", cfg.parallel.sharding, SHARDINGS),
        ("parallel.precision", cfg.parallel.precision, PRECISIONS),
        ("parallel.launcher", cfg.parallel.launcher, LAUNCHERS),
        ("parallel.compile", cfg.parallel.compile, COMPILES),
        ("parallel.device", cfg.parallel.device, ("auto", "cpu", "cuda", "xla")),
        ("log.progress", cfg.log.progress, ("auto", "bar", "lines", "none")),
    ):
        if value not in choices:
            raise ShardlmError(f"{name}={value!r} is not one of {', '.join(choices)}.{nearest(value, choices)}"
                               + CHOICE_HINTS.get(name, ""))
    t = cfg.train
    _positive("train.batch_size", t.batch_size)
    _positive("train.grad_accum", t.grad_accum)
    _positive("data.seq_len", cfg.data.seq_len)
    _positive("train.epochs", t.epochs, allow_zero=True)
    if t.max_steps is not None:
        _positive("train.max_steps", t.max_steps, allow_zero=True)
    _positive("train.lr", t.lr)
    _positive("train.log_every", t.log_every)
    _positive("train.gen_samples", t.gen_samples)
    for name in ("eval_every", "eval_batches", "warmup_steps", "max_bad_steps", "gen_every"):
        _positive(f"train.{name}", getattr(t, name), allow_zero=True)
    if t.loss_chunk_size is not None:
        _positive("train.loss_chunk_size", t.loss_chunk_size, allow_zero=True)
    _positive("train.grad_clip", t.grad_clip, allow_zero=True)
    _positive("checkpoint.every", cfg.checkpoint.every, allow_zero=True)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("parallel.shard_size", cfg.parallel.shard_size, allow_zero=True)
    _positive("model.vocab_multiple", cfg.model.vocab_multiple)
    if cfg.checkpoint.export_final and not cfg.checkpoint.save_final:
        raise ShardlmError("checkpoint.export_final=true exports the final checkpoint: it needs "
                           "checkpoint.save_final=true (or run `shardlm export` on a checkpoint later).")
    _check_mixture(cfg)
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ShardlmError(f"data.val_fraction must be between 0 and 1, got {cfg.data.val_fraction}.")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ShardlmError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}.")
    _check_lora(cfg)
    m = cfg.model
    if m.attention not in ATTENTION_CHOICES:
        raise ShardlmError(f"model.attention={m.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}."
                           f"{nearest(m.attention, ATTENTION_CHOICES)}")
    if m.name is None:
        _positive("model.n_layer", m.n_layer)
        _positive("model.n_embd", m.n_embd)
        _positive("model.n_head", m.n_head)
        if m.n_embd % m.n_head:
            raise ShardlmError(f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}.")
        if m.n_kv_head is not None and (m.n_kv_head <= 0 or m.n_head % m.n_kv_head):
            raise ShardlmError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head} (each key/value "
                               "head serves a group of query heads): choose a divisor, or null for n_head.")
        if m.n_positions is not None and cfg.data.seq_len > m.n_positions:
            raise ShardlmError(
                f"data.seq_len={cfg.data.seq_len} exceeds model.n_positions={m.n_positions}: "
                f"lower data.seq_len or raise model.n_positions."
            )


def _check_mixture(cfg: Config) -> None:
    """A list data.train is a mixture; data.weights, if given, has one weight >= 0 per source, not all 0."""
    train, weights = cfg.data.train, cfg.data.weights
    if isinstance(train, list) and not train:
        raise ShardlmError("data.train is an empty list: give one source, or a list of sources to mix.")
    if weights is None:
        return
    if not isinstance(train, list):
        raise ShardlmError(f"data.weights applies to a mixture, but data.train is one source ({train!r}): give "
                           "data.train a list of sources ('data.train=[a.txt,b.parquet]') or set data.weights=null.")
    if len(weights) != len(train):
        n = len(weights)
        raise ShardlmError(f"data.weights has {n} weight{'s' * (n != 1)} but data.train lists {len(train)} sources: "
                           "give one weight per source, or data.weights=null to weight them by their sizes.")
    for i, w in enumerate(weights):
        if not (math.isfinite(w) and w >= 0):
            raise ShardlmError(f"data.weights[{i}] is {w}: weights must be finite and >= 0 (0 = leave a source out).")
    if not any(weights):
        raise ShardlmError("data.weights are all 0: give at least one source a positive weight.")


def _check_lora(cfg: Config) -> None:
    """LoRA settings; QLoRA's need for CUDA is checked with the device (shardlm.models.lora.check)."""
    lora = cfg.lora
    _positive("lora.r", lora.r, allow_zero=True)
    if lora.quantize not in (None, "nf4"):
        raise ShardlmError(f"lora.quantize={lora.quantize!r} is not one of nf4, null.")
    if lora.r == 0:
        if lora.quantize:
            raise ShardlmError(f"lora.quantize={lora.quantize} quantizes the frozen base of a LoRA run: set lora.r "
                               "(e.g. lora.r=16) or lora.quantize=null.")
        return
    _positive("lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        raise ShardlmError(f"lora.dropout must be in [0, 1), got {lora.dropout}.")
    if cfg.model.name is None:
        raise ShardlmError("lora.r > 0 adapts a pretrained model, but model.name is null (from scratch): set "
                           "model.name to a hub name or folder, or lora.r=0 to train every weight.")
    if cfg.parallel.precision == "fp8":
        raise ShardlmError("lora.r > 0 with parallel.precision=fp8 is not supported (float8 linears do not wrap "
                           "PEFT's adapter layers). Use parallel.precision=bf16 (or fp32) for LoRA.")
    if lora.target_modules is not None and not lora.target_modules:
        raise ShardlmError("lora.target_modules is an empty list: give module names (e.g. [q_proj, v_proj]) or "
                           "null for every attention and MLP projection.")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_flat_dict(cfg: Config) -> dict[str, Any]:
    """`{"train.lr": ..., "out_dir": ...}`: what `build_config` takes back, with overrides merged in."""
    return _flatten(to_dict(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """YAML with the public key names (`checkpoint.async`, not the field's `async_save`)."""
    tree = to_dict(cfg)
    for public, field_name in KEY_ALIASES.items():
        section, name = field_name.split(".")
        tree[section] = {public.split(".")[1] if k == name else k: v for k, v in tree[section].items()}
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(yaml.safe_dump(tree, sort_keys=False))
    tmp.replace(path)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a Config saved by `save_config` (checkpoints carry one), ignoring keys removed since."""
    known = all_keys()
    return build_config({k: v for k, v in _flatten(tree).items() if k in known})
