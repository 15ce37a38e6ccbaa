"""`shardlm export`: a checkpoint (or run dir) -> a Hugging Face folder that `from_pretrained` and
`pipeline("text-generation")` load offline: config.json, model.safetensors (sharded with an index when
large), generation_config.json and the tokenizer files. A LoRA run exports merged (base + adapter folded
into one model) by default, or with `adapter=True` (`--adapter`) as a PEFT adapter folder
(adapter_config.json, adapter_model.safetensors, tokenizer) that `peft.PeftModel.from_pretrained(base, OUT)`
loads onto its base."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shardlm import ShardlmError
from shardlm.checkpoint.layout import metrics_file, read_config, read_manifest, run_dir_of, tokenizer_dir
from shardlm.checkpoint.load import is_adapter_folder, is_hf_folder, load_for_inference
from shardlm.models.hf_config import context_length, padding_ids
from shardlm.tokenizer import end_of_turn_id

CARD_MARK = "trained with shardlm"  # in every export's README.md (model_card): how an earlier export is known


def _is_earlier_export(folder: Path) -> bool:
    card = folder / "README.md"
    return ((is_hf_folder(folder) or is_adapter_folder(folder)) and card.is_file()
            and CARD_MARK in card.read_text(errors="replace"))


def _sources(path: Path) -> list[Path]:
    """What an export of `path` reads: the path itself and, for a run, checkpoint or adapter, its base folder."""
    import json

    from shardlm.checkpoint.layout import resolve_checkpoint

    found = [path]
    base = None
    if is_adapter_folder(path):
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    elif path.is_dir() and not is_hf_folder(path):
        try:
            ckpt = resolve_checkpoint(path, log=lambda *_: None)
        except ShardlmError:
            return found  # the export itself reports it
        base = _run_config(ckpt).model.name
    if base and Path(base).expanduser().is_dir():
        found.append(Path(base).expanduser())
    return found


def _check_target(out: Path, source: Path) -> None:
    """Export replaces only an empty folder or an earlier shardlm export (its model card says so), never a folder
    of something else, and never what it reads: the model, or the base of a LoRA run (the run needs it)."""
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"export target '{out}' is a file; give a folder.")
    if out.is_dir() and any(out.iterdir()):
        if any(out.resolve() == s.resolve() for s in _sources(source)):
            raise ShardlmError(f"export target '{out}' is the model being exported or its run's base model "
                               "(model.name); give a new folder.")
        if not _is_earlier_export(out):
            raise ShardlmError(f"export target '{out}' is a folder that holds other files (not an earlier shardlm "
                               "export); give a new or empty folder.")


def _replace(tmp: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def _run_config(ckpt: Path | None):
    """The run's config as trained (load_for_inference clears lora.* of a merged LoRA model)."""


    return None if ckpt is None else read_config(ckpt)


def export_adapter(path: str | Path, out: Path, repo_id: str | None = None) -> Path:
    """A LoRA checkpoint (or run dir) -> a PEFT adapter folder; the base it names is the run's model.name."""
    import sys

    from shardlm.checkpoint.layout import resolve_checkpoint
    from shardlm.checkpoint.load import load_lora_checkpoint

    source = Path(path).expanduser()
    if not source.exists():
        raise ShardlmError(f"'{source}' does not exist: give a LoRA run dir or checkpoint.")
    if is_hf_folder(source) or is_adapter_folder(source):
        raise ShardlmError(f"export --adapter reads a LoRA run dir or checkpoint; '{source}' is an exported folder. "
                           "Give the run dir it came from.")
    ckpt = resolve_checkpoint(source, log=lambda m: print(m, file=sys.stderr))
    if not read_manifest(ckpt).get("lora"):
        raise ShardlmError(f"export --adapter writes a LoRA adapter, but {ckpt} is a full fine-tuning checkpoint "
                           "(lora.r=0): it has no adapter. Export it without --adapter (a full model folder).")
    cfg = read_config(ckpt)
    model = load_lora_checkpoint(ckpt, cfg)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir(ckpt))).save_pretrained(str(tmp))
        write_card(tmp, model, cfg, ckpt, repo_id or str(out), adapter=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardlmError(f"export to '{out}' failed: {e.strerror or e}.") from None
    _replace(tmp, out)
    return out


def export(path: str | Path, out_dir: str | Path, max_shard_size: str = "2GB", adapter: bool = False,
           repo_id: str | None = None) -> Path:
    """`repo_id`: the Hub repo the folder is for, named in the model card's loading example."""
    from transformers import GenerationConfig

    out = Path(out_dir).expanduser()
    _check_target(out, Path(path).expanduser())
    if adapter:
        return export_adapter(path, out, repo_id)
    model, tokenizer, _cfg, ckpt = load_for_inference(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        eos = tokenizer.eos_token_id
        model.config.bos_token_id = model.config.eos_token_id = eos
        model.config.use_cache = True
        positions = context_length(model.config)
        if model.config.model_type == "gpt2" and positions:
            model.config.n_ctx = positions  # llama.cpp's convert_hf_to_gguf.py still reads GPT-2's n_ctx
        if positions:
            tokenizer.model_max_length = positions  # not GPT-2's 1024: other tools cut prompts by it
        trim_padded_vocabulary(model)
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = eos  # the same pad id in config.json and generation_config.json
        # Ids and stops only: engines such as vLLM adopt generation_config.json's sampling as their defaults, so
        # it sets none (transformers' greedy default; the card recommends shardlm generate's temperature 0.8).
        # A model of a short context gets half of it as max_new_tokens: pipeline's default (256 new tokens)
        # would run past its positions and fail.
        stops = sorted({eos, end_of_turn_id(tokenizer)})  # a chat model's answer ends at its end-of-turn token
        short = {"max_new_tokens": positions // 2} if positions and positions < SHORT_CONTEXT else {}
        model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=stops if len(stops) > 1 else eos,
                                                   pad_token_id=model.config.pad_token_id, **short)
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(str(tmp))
        save_slow_tokenizer_files(tokenizer, tmp)
        write_card(tmp, model, _run_config(ckpt), ckpt, repo_id or str(out), chat=bool(tokenizer.chat_template))
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ShardlmError(f"export to '{out}' failed: {e.strerror or e}.") from None
    _replace(tmp, out)
    return out


SHORT_CONTEXT = 1024  # below it an export caps generation at half its positions


def trim_padded_vocabulary(model) -> None:
    """Drop the rows `model.vocab_multiple` added (ids no tokenizer entry decodes): only transformers honours
    `suppress_tokens`, and other engines sampled them (vLLM: 10 in 102,400 tokens of a lightly trained model),
    decoding to nothing while using up tokens. The rows of real tokens, and so their logits, are unchanged."""
    padding = padding_ids(model.config)
    if not padding:
        return
    model.resize_token_embeddings(padding[0], mean_resizing=False)
    model.config.vocab_size = padding[0]
    if hasattr(model.config, "tokenizer_size"):
        del model.config.tokenizer_size
    model.generation_config.suppress_tokens = None


def save_slow_tokenizer_files(tokenizer, folder: Path) -> None:
    """A byte-level BPE tokenizer's `vocab.json` and `merges.txt` beside `tokenizer.json`: what readers that ask
    for the slow GPT-2 tokenizer (`use_fast=False`, transformers 4, llama.cpp's converter) open."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is not None and type(model).__name__ == "BPE" and not (folder / "vocab.json").exists():
        model.save(str(folder))


# ---- the model card: README.md (+ loss.png) in every export folder -----------------------------------------
def run_facts(ckpt: Path | None) -> dict:
    """Step, tokens seen and the last train / validation numbers up to the checkpoint, from its run's
    metrics.jsonl (empty for an exported folder, which keeps no run)."""

    from shardlm.observe.plot import read_metrics

    if ckpt is None:
        return {}
    manifest = read_manifest(ckpt)
    step = manifest.get("step", 0)
    facts: dict = {"step": step, "world_size": manifest.get("world_size")}
    run = run_dir_of(ckpt)
    if run is None or not metrics_file(run).is_file():
        return facts
    records = [r for r in read_metrics(run) if (r.get("step") or 0) <= step]
    for split in ("train", "val"):
        last = [r for r in records if r.get("split") == split]
        if last:
            facts[split] = last[-1]
    facts["run"] = run
    return facts


def _table(rows: list[tuple[str, object]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))]


def _perplexity(record: dict | None, cfg) -> bool:
    """Whether exp of the run's loss is a perplexity: the objective says (a next-token loss); without a config,
    a preference record's rewards say it is not."""
    from shardlm.objectives import objective_family

    return objective_family(cfg.train.objective).perplexity if cfg else "rewards/margin" not in (record or {})


def _loss(record: dict | None, cfg=None) -> str | None:
    import math

    if not record or not isinstance(record.get("loss"), (int, float)):
        return None
    if not _perplexity(record, cfg):  # a preference, RL or distillation loss: exp of it is no perplexity
        return f"{record['loss']:.4f} at step {record['step']}"
    return f"{record['loss']:.4f} (perplexity {math.exp(min(record['loss'], 700)):.2f}) at step {record['step']}"


def _objective(cfg) -> str | None:
    """The run's objective and its settings, as the objective says them (an sft run's next-token loss: none)."""
    from shardlm.objectives import objective_family

    return objective_family(cfg.train.objective).card_line(cfg)


def _val_loss(record: dict | None, cfg) -> str | None:
    """The loss and which held-out tokens it is over: training scores a subset, `shardlm eval` all of them. A
    preference run's: its pair loss and rewards on its pairs (its loss is no next-token loss: no perplexity)."""
    from shardlm.observe.metrics import describe_val, held_out_words

    if record and "pairs" in record:
        words = describe_val(record, record.get("held_out_tokens"), cfg and cfg.train.eval_batches)
        return f"{words.removeprefix('loss ')} at step {record['step']}"
    if record and cfg and not _perplexity(record, cfg):  # its own words: rewards, kl, exact match, ...
        from shardlm.objectives import objective_family

        words = objective_family(cfg.train.objective).describe_val(cfg, record, record.get("held_out_tokens") or 0)
        return f"{words.removeprefix('loss ')} at step {record['step']}"
    loss = _loss(record, cfg)
    if record is None or loss is None or not isinstance(record.get("tokens"), int):
        return loss
    return f"{loss}, {held_out_words(record['tokens'], record.get('held_out_tokens'), cfg and cfg.train.eval_batches)}"


def layout(cfg, world_size: int | None, device: str | None) -> str:
    """How the run was spread, by the rules it ran under (parallelize.fsdp_enabled): parallel.sharding
    alone says nothing, as one process trains without FSDP unless parallel.fsdp or cpu_offload asks for it."""
    from shardlm.distributed.parallelize import fsdp_enabled

    p = cfg.parallel
    if world_size is None:
        return f"not recorded (parallel.sharding {p.sharding})"
    processes = f"{world_size} process{'es' * (world_size != 1)}"
    if device == "xla":
        return f"{processes}, XLA SPMD, FSDPv2 {p.sharding} sharding"
    return f"{processes}, FSDP2 {p.sharding} sharding" if fsdp_enabled(cfg, world_size) else f"{processes}, no FSDP"


def _data(data) -> str:
    """One source as given; a mixture as its sources with their weights (null: in proportion to their size)."""
    if not isinstance(data.train, list):
        return str(data.train)
    weights = data.weights or ["by size"] * len(data.train)
    return "a mixture of " + ", ".join(f"{s} ({w})" for s, w in zip(data.train, weights, strict=True))


def card_rows(model, cfg, facts: dict) -> list[tuple[str, object]]:
    c, positions = model.config, context_length(model.config)
    n_params = sum(p.numel() for p in model.parameters())
    train, val = facts.get("train"), facts.get("val")
    rows = [("architecture", f"{c.model_type}, {n_params / 1e6:.2f}M parameters, {getattr(c, 'num_hidden_layers', '?')}"
             f" layers, width {getattr(c, 'hidden_size', '?')}, context {positions}, vocabulary {c.vocab_size}"),
            ("base model", (cfg.model.name or "none: trained from scratch") if cfg else None),
            ("tokenizer", (cfg.model.tokenizer or ("the base model's" if cfg.model.name else "bytes"))
             if cfg else None),
            ("training data", _data(cfg.data) if cfg else None),
            ("validation data", (cfg.data.val or f"the last {cfg.data.val_fraction:.0%} of "
                                 f"{'each source' if isinstance(cfg.data.train, list) else 'the training data'}")
             if cfg else None),
            ("steps", facts.get("step")),
            ("tokens seen", f"{train['tokens']:,}" if train and "tokens" in train else None),
            ("final train loss", _loss(train, cfg)), ("final validation loss", _val_loss(val, cfg)),
            ("final validation accuracy", f"{val['accuracy']:.4f}" if val and val.get("accuracy")
             and "pairs" not in val else None)]
    if cfg:
        t, p = cfg.train, cfg.parallel
        rows += [("config", f"seq_len {cfg.data.seq_len}, batch {t.batch_size} x grad_accum {t.grad_accum} x "
                            f"{facts.get('world_size') or '?'} rank(s), lr {t.lr:g} (warmup {t.warmup_steps}, cosine "
                            f"to {t.lr * t.min_lr_ratio:g}), weight decay {t.weight_decay:g}, precision {p.precision}, "
                            f"seed {t.seed}"),
                 ("objective", _objective(cfg)),
                 ("layout", layout(cfg, facts.get("world_size"), (train or {}).get("device"))),
                 ("LoRA", f"r {cfg.lora.r}, alpha {cfg.lora.alpha:g}" if cfg.lora.r else None)]
    return rows


def _loadable(base: str | None) -> str | None:
    """A local base folder as an absolute path (as adapter_config.json has it): the card's example runs anywhere."""
    return str(Path(base).expanduser().resolve()) if base and Path(base).expanduser().is_dir() else base


def model_card(model, cfg, facts: dict, model_id: str, adapter: bool = False, image: bool = False,
               chat: bool = False) -> str:
    """README.md: what the model is, what it was trained on and how far, and how to load it."""
    base = cfg.model.name if cfg is not None and cfg.model.name else None
    meta = ["---", f"library_name: {'peft' if adapter else 'transformers'}", "pipeline_tag: text-generation",
            "tags: [shardlm, causal-lm]", *([f"base_model: {base}"] if base and not Path(base).exists() else []), "---"]
    if adapter:
        load = ["```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM",
                f'base = AutoModelForCausalLM.from_pretrained("{_loadable(base)}")',
                f'model = PeftModel.from_pretrained(base, "{model_id}")', "```"]
    elif chat:  # the folder's chat template renders the messages, as in training
        load = ["```python", "from transformers import pipeline", "",
                f'chat = pipeline("text-generation", model="{model_id}")',
                'messages = [{"role": "user", "content": "Hello! Who are you?"}]',
                'print(chat(messages, max_new_tokens=100)[0]["generated_text"][-1]["content"])', "```"]
    else:
        load = ["```python", "from transformers import pipeline", "",
                f'generate = pipeline("text-generation", model="{model_id}")',
                'print(generate("ROMEO:", max_new_tokens=100, do_sample=True, temperature=0.8)[0]["generated_text"])',
                'print(generate("ROMEO:", max_new_tokens=100)[0]["generated_text"])  # greedy', "```"]
    what = "A LoRA adapter" if adapter else "A causal language model"
    return "\n".join([*meta, f"# {Path(model_id).name}", "",
                      f"{what} {CARD_MARK} (PyTorch FSDP2).", "", "## Training", "",
                      *_table(card_rows(model, cfg, facts)), "",
                      *(["![training and validation loss](loss.png)", ""] if image else []),
                      "## How to use", "", *load, "",
                      *([] if adapter else ["`generation_config.json` holds the token ids and sets no sampling "
                                            "(engines such as vLLM adopt it as their defaults): sampling at "
                                            "temperature 0.8, as `shardlm generate`, is the recommended setting.",
                                            ""]),
                      "## Limitations and license", "",
                      "A model of this size and training budget writes fluent-looking but unreliable text: it states "
                      "no facts you can trust, may repeat or reproduce its training data, and carries that data's "
                      "biases. It is not meant for use in any product without evaluation for that use.", "",
                      "The weights inherit the license of the base model (if any) and the terms of the training "
                      "data; set a `license:` above accordingly before sharing. shardlm itself is MIT-licensed.", ""])


def write_card(folder: Path, model, cfg, ckpt: Path | None, model_id: str, adapter: bool = False,
               chat: bool = False) -> None:
    """`chat`: the exported tokenizer has a chat template (the card then shows pipeline use with messages)."""
    from shardlm.observe.plot import PANELS, draw, load_runs

    facts = run_facts(ckpt)
    image = False
    if "run" in facts:
        fig = draw(PANELS[0], load_runs([str(facts["run"])]))
        if fig is not None:
            fig.savefig(folder / "loss.png")
            image = True
    (folder / "README.md").write_text(model_card(model, cfg, facts, model_id, adapter, image, chat))
