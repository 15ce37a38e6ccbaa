"""Data: sources -> token cache (built once, by rank 0 or `shardlm prepare`) -> packed blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.blocks import GlobalSampler, TokenBlocks, eval_shares, micro_batch_position
from shardlm.data.cache import build_cache, cache_root, count_tokens, load_tokens
from shardlm.data.mixture import MixtureBlocks, MixtureSampler
from shardlm.data.sources import resolve

__all__ = ["Blocks", "GlobalSampler", "MixtureBlocks", "MixtureSampler", "TokenBlocks", "eval_shares",
           "micro_batch_position", "prepare_data", "load_split", "train_sampler", "counting_loader"]

Blocks = TokenBlocks | MixtureBlocks


def load_split(spec: str, cfg: DataConfig, tokenizer, dist, default_split: str):
    """Tokens of one source as a memmap; rank 0 builds the cache while the others wait for its result.
    A rank that cannot see rank 0's folder (a node with its own disk) builds its own copy, one per folder:
    the cache's lock makes the other ranks there wait for it. `shardlm prepare` builds caches ahead."""
    root = cache_root(cfg.cache_dir)

    def build():
        source = resolve(spec, default_split, cfg.data_files)
        return str(build_cache(source, tokenizer, root, cfg.text_field, cfg.hf_rows_are_documents, log=dist.print))

    path = dist.run_on_main(build)
    if not (Path(path) / "meta.json").is_file():
        path = build()
    return load_tokens(Path(path))


def counting_loader(enough: int, exact: list[bool]) -> Callable:
    """A `load` for `prepare_data` that writes nothing (`shardlm train --dry-run`): each source's token count
    (`count_tokens`: its cache's, or tokenized in memory up to `enough`), as a zero-copy array of that length,
    since only lengths are read before training. Each count's exactness is appended to `exact`."""

    def load(spec: str, cfg: DataConfig, tokenizer, _dist, default_split: str) -> np.ndarray:
        source = resolve(spec, default_split, cfg.data_files)
        n, is_exact = count_tokens(source, tokenizer, cache_root(cfg.cache_dir), cfg.text_field,
                                   cfg.hf_rows_are_documents, enough)
        exact.append(is_exact)
        return np.broadcast_to(np.zeros((), dtype=np.uint8), (n,))

    return load


def train_sampler(train: Blocks, seed: int) -> GlobalSampler | MixtureSampler:
    """The global order of the training blocks: one source's epochs, or a mixture's weighted rounds."""
    if isinstance(train, MixtureBlocks):
        return MixtureSampler(train.sizes, train.weights, seed)
    return GlobalSampler(len(train), seed)


def prepare_data(cfg: DataConfig, tokenizer, dist, load: Callable = load_split) -> tuple[Blocks, Blocks]:
    """Training and validation blocks, checked to hold one block each. `load` gives a source's tokens:
    `load_split`, or for a dry run an array of the right length that nothing was written for."""
    if isinstance(cfg.train, list):
        return prepare_mixture(cfg, tokenizer, dist, load)
    train_tokens = load(cfg.train, cfg, tokenizer, dist, "train")
    if cfg.val:
        val_tokens = load(cfg.val, cfg, tokenizer, dist, "validation")
        train = TokenBlocks(train_tokens, cfg.seq_len)
        val = TokenBlocks(val_tokens, cfg.seq_len)
    else:  # hold out the tail of the training stream, as nanoGPT does: deterministic and disjoint
        cut = int(len(train_tokens) * (1 - cfg.val_fraction))
        train = TokenBlocks(train_tokens, cfg.seq_len, 0, cut)
        val = TokenBlocks(train_tokens, cfg.seq_len, cut)
    for name, blocks in (("training", train), ("validation", val)):
        if len(blocks) == 0:
            raise ShardlmError(_too_short(name, blocks.end - blocks.start, cfg))
    return train, val


def _too_short(name: str, tokens: int, cfg: DataConfig) -> str:
    held_out = f"{cfg.val_fraction:.0%}"
    if name == "training":
        what = f"'{cfg.train}'" + ("" if cfg.val else f" (less the {held_out} held out for validation)")
    else:
        what = f"'{cfg.val}'" if cfg.val else f"(the last {held_out} of '{cfg.train}')"
    fix = "" if cfg.val else f", or a {'larger' if name == 'validation' else 'smaller'} data.val_fraction"
    return (f"the {name} data {what} has {tokens} tokens, fewer than one block of data.seq_len={cfg.seq_len} + 1. "
            f"Use more data or a smaller data.seq_len{fix}.")


def prepare_mixture(cfg: DataConfig, tokenizer, dist, load: Callable = load_split) -> tuple[MixtureBlocks, Blocks]:
    """`data.train` a list: each source's cache, its training blocks sampled by `data.weights`. Without
    data.val, validation is the held-out tail (data.val_fraction) of every source, interleaved; a source too
    short to give a held-out block gives none."""
    trains, tails = [], []
    for i, spec in enumerate(cfg.train):
        tokens = load(spec, cfg, tokenizer, dist, "train")
        cut = len(tokens) if cfg.val else int(len(tokens) * (1 - cfg.val_fraction))
        trains.append(TokenBlocks(tokens, cfg.seq_len, 0, cut))
        tails.append(TokenBlocks(tokens, cfg.seq_len, cut))
        if len(trains[-1]) == 0:
            held = "" if cfg.val else f" (less the {cfg.val_fraction:.0%} held out for validation)"
            raise ShardlmError(f"mixture source data.train[{i}] '{spec}' has {cut} tokens{held}, fewer than one "
                               f"block of data.seq_len={cfg.seq_len} + 1. Give it more data, remove it from "
                               "data.train, or use a smaller data.seq_len.")
    train = MixtureBlocks(trains, cfg.weights)
    if cfg.val:
        val: Blocks = TokenBlocks(load(cfg.val, cfg, tokenizer, dist, "validation"), cfg.seq_len)
        if len(val) == 0:
            raise ShardlmError(_too_short("validation", val.end - val.start, cfg))
        return train, val
    held_out = [t for t, w in zip(tails, train.weights, strict=True) if len(t) and w > 0]  # weight 0: left out
    if not held_out:
        raise ShardlmError(f"no source of data.train has, in its last {cfg.val_fraction:.0%}, one block of "
                           f"data.seq_len={cfg.seq_len} + 1 tokens to hold out for validation. Set data.val, a "
                           "larger data.val_fraction, or a smaller data.seq_len.")
    return train, MixtureBlocks.interleaved(held_out)
