"""Prompt sources -> a memory-mapped prompt cache, and a run's prompt splits (train.objective grpo and rloo).

Layout: `CACHE/rl-<key>/tokens.bin` (each prompt's rendered ids, uint16 or uint32), `offsets.npy` (int64, prompt k
is `[offsets[k], offsets[k+1])`), `prompts.jsonl` (one JSON line per prompt: where it came from, the prompt as the
rewards see it, its fields; JSON, never pickle: a cache is data anyone may hand over), `lines.npy` (int64, the
byte where each line starts, so a prompt's fields are read alone) and `meta.json`. Built once like the example
cache (`cache.build_once`: a temporary name renamed when whole, one builder at a time, each file's size and
checksum checked at open); the key covers the source, the tokenizer, the chat template and what changes a prompt
(`data.system_prompt`, `data.on_bad_example`), not `data.seq_len` or the `grpo:` section.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardlm import ShardlmError
from shardlm.config import Config, DataConfig
from shardlm.config.grpo import check_prompt_fits
from shardlm.data.cache import build_once, cache_root, damage, read_meta
from shardlm.data.formats import BadExample
from shardlm.data.prompts import FieldCount, PromptRows, RLPrompt, field_names, prompt_token_ids, rl_prompt
from shardlm.data.records import first_record, iter_records
from shardlm.data.sources import Source, resolve
from shardlm.tokenizer import fingerprint, template_fingerprint

PROMPTS_FORMAT = 2  # 2: a null `answer` is left out of the fields (caches of 1 hold it as None)
Log = Callable[[str], None]


def prompts_key(source: Source, tok, cfg: DataConfig, tools: list[dict] | None = None) -> str:
    ident = [PROMPTS_FORMAT, source.identity(), fingerprint(tok), template_fingerprint(tok), cfg.system_prompt,
             cfg.on_bad_example] + ([tools] if tools else [])  # the schemas are rendered into every prompt
    return "rl-" + hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]


def _line(where: str, p: RLPrompt) -> bytes:
    try:
        return (json.dumps({"where": where, "prompt": p.prompt, "fields": p.fields}, ensure_ascii=False) +
                "\n").encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        name = next((k for k, v in p.fields.items() if not _is_json(v)), "?")
        raise BadExample(f"{where}: field {name!r} holds a {type(p.fields.get(name)).__name__}, which the prompt "
                         "cache cannot store as JSON (the reward functions get it from there). Convert it to text "
                         "or numbers, or drop the field.") from None


def _is_json(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _write(source: Source, tok, cfg: DataConfig, tmp: Path, tools: list[dict] | None = None) -> dict:
    dtype = np.uint16 if len(tok) <= np.iinfo(np.uint16).max + 1 else np.uint32
    offsets, lines, skipped = [0], [0], []  # type: list[int], list[int], list[str]
    fields = FieldCount()
    with open(tmp / "tokens.bin", "wb") as ids_out, open(tmp / "prompts.jsonl", "wb") as lines_out:
        for where, record in iter_records(source):
            try:
                p = rl_prompt(record, where, cfg.system_prompt)
                line, ids = _line(where, p), prompt_token_ids(tok, p, where, tools)
            except BadExample as e:
                if cfg.on_bad_example != "skip":
                    raise
                skipped.append(str(e))
                continue
            ids_out.write(np.asarray(ids, dtype=dtype).tobytes())
            offsets.append(offsets[-1] + len(ids))
            lines_out.write(line)
            lines.append(lines[-1] + len(line))
            fields.add(where, p.fields)
    np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(tmp / "lines.npy", np.asarray(lines, dtype=np.int64))
    if len(offsets) == 1:
        why = f" (all {len(skipped)} were skipped as bad; the first: {skipped[0]})" if skipped else ""
        raise ShardlmError(f"data source '{source.spec}' holds no prompts{why}. Give records such as "
                           '{"prompt": "...", "answer": "..."} or chat {"messages": [...]}.')
    lengths = np.diff(offsets)
    return {"prompts": len(offsets) - 1, "num_tokens": offsets[-1], "dtype": np.dtype(dtype).name,
            **fields.meta(), "longest": int(lengths.max()), "skipped": len(skipped), "first_skipped": skipped[:3]}


def build_prompts(source: Source, tok, cfg: DataConfig, root: Path, log: Log = print,
                  tools: list[dict] | None = None) -> Path:
    """The prompt cache folder of `source` (rendered with the tools' schemas), built first when none is complete."""
    folder = root / prompts_key(source, tok, cfg, tools)

    def write(tmp: Path) -> dict:
        log(f"rendering the prompts of {source.spec} -> {folder}")
        return {**_write(source, tok, cfg, tmp, tools), "source": source.spec,
                "tokenizer": getattr(tok, "name_or_path", "")}

    folder, meta = build_once(folder, write, log)
    if meta is not None:
        for name, partial in meta["partial_fields"].items():
            lack = "lacks" if partial["lacking"] == 1 else "lack"
            log(f"warning: {partial['lacking']:,} of the {meta['prompts']:,} prompts of {source.spec} {lack} the field "
                f"'{name}' (the first: {partial['first']}), so no reward can use it: add it to every record")
        if meta["skipped"]:
            log(f"warning: skipped {meta['skipped']:,} bad prompt record{'s' * (meta['skipped'] != 1)} "
                f"(data.on_bad_example=skip); the first: {meta['first_skipped'][0]}")
        log(f"rendered {meta['prompts']:,} prompts into {meta['num_tokens']:,} tokens in {meta['seconds']:.1f}s")
    return folder


class _Lines:
    """Prompt k's (where, RLPrompt), read from its own line of prompts.jsonl when asked for."""

    def __init__(self, path: Path, starts: np.ndarray):
        self.path, self.starts = path, starts

    def __call__(self, k: int) -> tuple[str, RLPrompt]:
        a, b = int(self.starts[k]), int(self.starts[k + 1])
        with open(self.path, "rb") as fh:
            fh.seek(a)
            entry = json.loads(fh.read(b - a))
        return entry["where"], RLPrompt(entry["prompt"], entry["fields"])


def load_prompts(folder: Path) -> PromptRows:
    meta = read_meta(folder)
    tokens = np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))
    return PromptRows(tokens, np.load(folder / "offsets.npy"), _Lines(folder / "prompts.jsonl",
                      np.load(folder / "lines.npy")), field_names(meta, meta["prompts"]), meta["source"],
                      meta={**meta, "folder": str(folder)})


def prompts_in_memory(source: Source, tok, cfg: DataConfig, tools: list[dict] | None = None) -> PromptRows:
    """A source's prompts that write nothing that stays (`--dry-run`): its cache when built, else one built in a
    temporary folder and read into memory."""
    folder = cache_root(cfg.cache_dir) / prompts_key(source, tok, cfg, tools)
    if (folder / "meta.json").is_file() and damage(folder) is None:
        return load_prompts(folder)
    with tempfile.TemporaryDirectory(prefix="shardlm-dry-") as tmp:
        return load_prompts(build_prompts(source, tok, cfg, Path(tmp), log=lambda _: None, tools=tools)).in_memory()


def prompt_source(spec: str, cfg: DataConfig, default_split: str, key: str) -> Source:
    """The source of a prompt split, refused in one line when it holds plain text (no records to prompt with)."""
    source = resolve(spec, default_split, cfg.data_files)
    if cfg.format == "text" or first_record(source) is None:
        why = "data.format=text reads it as" if cfg.format == "text" else "it is"
        raise ShardlmError(f"{key}='{spec}': {why} plain text, but online RL (train.objective grpo/rloo) samples "
                           "completions of prompts: give records such as {\"prompt\": \"...\", \"answer\": \"...\"} "
                           "or chat {\"messages\": [...]} (.jsonl, .parquet, .csv or hf:)"
                           + (", and leave data.format at auto." if cfg.format == "text" else "."))
    return source


def load_prompt_split(spec: str, cfg: DataConfig, tok, dist, default_split: str, key: str,
                      tools: list[dict] | None = None) -> PromptRows:
    """One source's prompts: rank 0 builds the cache while the others wait for it (a rank that cannot see its
    folder builds its own, as `load_split` does); `dist` None writes nothing (a dry run)."""
    source = prompt_source(spec, cfg, default_split, key)
    if dist is None:
        return prompts_in_memory(source, tok, cfg, tools)

    def build() -> str:
        return str(build_prompts(source, tok, cfg, cache_root(cfg.cache_dir), log=dist.print, tools=tools))

    path = Path(dist.run_on_main(build))
    if not (path / "meta.json").is_file():
        path = Path(build())
    return load_prompts(path)


def one_source(cfg: DataConfig) -> str:
    """data.train, refused in one line when it is a mixture."""
    if isinstance(cfg.train, list):
        raise ShardlmError("data.train is a list (a mixture), but online RL (train.objective grpo/rloo) samples "
                           "from one prompt source: concatenate the prompt files into one, or give one of them.")
    return cfg.train


def prepare_prompts(cfg: DataConfig, tok, dist, tools: list[dict] | None = None) -> tuple[PromptRows, PromptRows]:
    """The training and validation prompts: data.val's, or the last data.val_fraction of data.train's held out
    (the same cache, another range). `dist` None: a dry run, which writes nothing."""
    train = load_prompt_split(one_source(cfg), cfg, tok, dist, "train", "data.train", tools)
    if cfg.val:
        val = load_prompt_split(cfg.val, cfg, tok, dist, "validation", "data.val", tools)
    else:
        cut = int(len(train) * (1 - cfg.val_fraction))
        train, val = train.share(0, cut), train.share(cut)
    for name, rows in (("training", train), ("validation", val)):
        if len(rows) == 0:
            what = f"'{cfg.val}'" if name == "validation" and cfg.val else f"'{cfg.train}'"
            held = "" if cfg.val else f" with data.val_fraction={cfg.val_fraction:g} held out for validation"
            raise ShardlmError(f"the {name} data {what} has no prompts{held}. Use more prompts"
                               f"{'' if cfg.val else ', data.val, or another data.val_fraction'}.")
    return train, val


def check_prompts_fit(rows: PromptRows, cfg: Config) -> None:
    """The first prompt (in the data's order) that leaves no room for grpo.max_completion_length in data.seq_len,
    refused with its path:line (`check_prompt_fits`)."""
    too_long = rows.lengths > cfg.data.seq_len - cfg.grpo.max_completion_length
    if too_long.any():
        i = int(np.argmax(too_long))
        check_prompt_fits(int(rows.lengths[i]), cfg, rows.where(i))
