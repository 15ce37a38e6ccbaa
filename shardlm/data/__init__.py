"""Data: sources -> token cache (built once, by rank 0 or `shardlm prepare`) -> packed blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.blocks import Batch, GlobalSampler, TokenBlocks, eval_shares, micro_batch_position
from shardlm.data.cache import build_cache, cache_root, count_tokens, load_tokens
from shardlm.data.examples import ExampleSet, build_examples, examples_in_memory, load_examples, source_format
from shardlm.data.mixture import MixtureBlocks, MixtureSampler
from shardlm.data.packing import ExampleRows
from shardlm.data.prompt_cache import check_prompts_fit, prepare_prompts
from shardlm.data.prompts import PromptRows
from shardlm.data.sources import resolve

__all__ = ["Batch", "Blocks", "ExampleRows", "GlobalSampler", "MixtureBlocks", "MixtureSampler", "PromptRows",
           "Split", "TokenBlocks", "check_prompts_fit", "counting_loader", "describe", "eval_shares", "load_split",
           "micro_batch_position", "prepare_data", "prepare_prompts", "train_sampler"]

Blocks = TokenBlocks | MixtureBlocks | ExampleRows
Split = Blocks | PromptRows  # what run.train and run.val are: prompts for train.objective grpo and rloo
Loaded = np.ndarray | ExampleSet  # a text source's tokens, or an example source's examples


def load_split(spec: str, cfg: DataConfig, tokenizer, dist, default_split: str):
    """Tokens of one source as a memmap; rank 0 builds the cache while the others wait for its result.
    A rank that cannot see rank 0's folder (a node with its own disk) builds its own copy, one per folder:
    the cache's lock makes the other ranks there wait for it. `shardlm prepare` builds caches ahead."""
    root = cache_root(cfg.cache_dir)

    def build():
        source = resolve(spec, default_split, cfg.data_files)
        if source_format(source, cfg)[0] != "text":
            return str(build_examples(source, tokenizer, cfg, root, log=dist.print))
        return str(build_cache(source, tokenizer, root, cfg.text_field, cfg.hf_rows_are_documents, log=dist.print))

    path = dist.run_on_main(build)
    if not (Path(path) / "meta.json").is_file():
        path = build()
    return load_examples(Path(path)) if Path(path).name.startswith("ex-") else load_tokens(Path(path))


def describe(blocks: Split) -> list[str]:
    """Header lines for example and prompt sources (a mixture's each); none for text."""
    if isinstance(blocks, ExampleRows | PromptRows):
        return [blocks.describe()]
    if isinstance(blocks, MixtureBlocks):
        return [line for part in blocks.parts for line in describe(part)]
    return []


def counting_loader(enough: int, exact: list[bool]) -> Callable:
    """A `load` for `prepare_data` that writes nothing (`shardlm train --dry-run`): each source's token count
    (`count_tokens`: its cache's, or tokenized in memory up to `enough`), as a zero-copy array of that length,
    since only lengths are read before training. Each count's exactness is appended to `exact`."""

    def load(spec: str, cfg: DataConfig, tokenizer, _dist, default_split: str) -> Loaded:
        source = resolve(spec, default_split, cfg.data_files)
        if source_format(source, cfg)[0] != "text":
            exact.append(True)
            return examples_in_memory(source, tokenizer, cfg)
        n, is_exact = count_tokens(source, tokenizer, cache_root(cfg.cache_dir), cfg.text_field,
                                   cfg.hf_rows_are_documents, enough)
        exact.append(is_exact)
        return np.broadcast_to(np.zeros((), dtype=np.uint8), (n,))

    return load


def train_sampler(train: Split, seed: int) -> GlobalSampler | MixtureSampler:
    """The global order of the training blocks (or prompts): one source's epochs, or a mixture's weighted rounds."""
    if isinstance(train, MixtureBlocks):
        return MixtureSampler(train.sizes, train.weights, seed)
    return GlobalSampler(len(train), seed)


def prepare_data(cfg: DataConfig, tokenizer, dist, load: Callable = load_split) -> tuple[Blocks, Blocks]:
    """Training and validation blocks, checked to hold one block each. `load` gives a source's tokens:
    `load_split`, or for a dry run an array of the right length that nothing was written for."""
    if isinstance(cfg.train, list):
        return prepare_mixture(cfg, tokenizer, dist, load)
    train_data = load(cfg.train, cfg, tokenizer, dist, "train")
    if cfg.val:
        val_data = load(cfg.val, cfg, tokenizer, dist, "validation")
        train, val = split_blocks(train_data, cfg, cfg.train), split_blocks(val_data, cfg, cfg.val)
    else:  # hold out the tail of the training stream, as nanoGPT does: deterministic and disjoint
        cut = int(len(train_data) * (1 - cfg.val_fraction))
        train = split_blocks(train_data, cfg, cfg.train, 0, cut)
        val = split_blocks(train_data, cfg, cfg.train, cut)
    for name, blocks in (("training", train), ("validation", val)):
        if len(blocks) == 0:
            raise ShardlmError(_too_short(name, _size(blocks), cfg, isinstance(blocks, ExampleRows)))
    return train, val


def split_blocks(data: Loaded, cfg: DataConfig, spec: str, start: int = 0, end: int | None = None) -> Blocks:
    """Text blocks of tokens `[start, end)`, or rows of examples `[start, end)`."""
    if isinstance(data, ExampleSet):
        return ExampleRows(data, cfg.seq_len, start, end, cfg.packing, cfg.truncation, spec)
    return TokenBlocks(data, cfg.seq_len, start, end)


def _size(blocks: Blocks) -> int:
    return blocks.end - blocks.start


def _too_short(name: str, tokens: int, cfg: DataConfig, examples: bool = False) -> str:
    held_out = f"{cfg.val_fraction:.0%}"
    if name == "training":
        what = f"'{cfg.train}'" + ("" if cfg.val else f" (less the {held_out} held out for validation)")
    else:
        what = f"'{cfg.val}'" if cfg.val else f"(the last {held_out} of '{cfg.train}')"
    fix = "" if cfg.val else f", or a {'larger' if name == 'validation' else 'smaller'} data.val_fraction"
    if examples:
        return f"the {name} data {what} has {tokens} examples, too few to make one row. Use more data{fix}."
    return (f"the {name} data {what} has {tokens} tokens, fewer than one block of data.seq_len={cfg.seq_len} + 1. "
            f"Use more data or a smaller data.seq_len{fix}.")


def prepare_mixture(cfg: DataConfig, tokenizer, dist, load: Callable = load_split) -> tuple[MixtureBlocks, Blocks]:
    """`data.train` a list: each source's cache, its training blocks sampled by `data.weights`. Without
    data.val, validation is the held-out tail (data.val_fraction) of every source, interleaved; a source too
    short to give a held-out block gives none."""
    trains, tails = [], []
    for i, spec in enumerate(cfg.train):
        data = load(spec, cfg, tokenizer, dist, "train")
        cut = len(data) if cfg.val else int(len(data) * (1 - cfg.val_fraction))
        trains.append(split_blocks(data, cfg, spec, 0, cut))
        tails.append(split_blocks(data, cfg, spec, cut))
        if len(trains[-1]) == 0:
            held = "" if cfg.val else f" (less the {cfg.val_fraction:.0%} held out for validation)"
            raise ShardlmError(f"mixture source data.train[{i}] '{spec}' has {cut} tokens{held}, fewer than one "
                               f"block of data.seq_len={cfg.seq_len} + 1. Give it more data, remove it from "
                               "data.train, or use a smaller data.seq_len.")
    train = MixtureBlocks(trains, cfg.weights)
    if cfg.val:
        val = split_blocks(load(cfg.val, cfg, tokenizer, dist, "validation"), cfg, cfg.val)
        if len(val) == 0:
            raise ShardlmError(_too_short("validation", _size(val), cfg, isinstance(val, ExampleRows)))
        return train, val
    held_out = [t for t, w in zip(tails, train.weights, strict=True) if len(t) and w > 0]  # weight 0: left out
    if not held_out:
        raise ShardlmError(f"no source of data.train has, in its last {cfg.val_fraction:.0%}, one block of "
                           f"data.seq_len={cfg.seq_len} + 1 tokens to hold out for validation. Set data.val, a "
                           "larger data.val_fraction, or a smaller data.seq_len.")
    return train, MixtureBlocks.interleaved(held_out)
