"""Data: sources -> token cache (built once, by rank 0 or `shardlm prepare`) -> packed blocks."""

from __future__ import annotations

from pathlib import Path

from shardlm import ShardlmError
from shardlm.config import DataConfig
from shardlm.data.blocks import GlobalSampler, TokenBlocks, eval_shares, micro_batch_position
from shardlm.data.cache import build_cache, cache_root, load_tokens
from shardlm.data.sources import resolve

__all__ = ["GlobalSampler", "TokenBlocks", "eval_shares", "micro_batch_position", "prepare_data", "load_split"]


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


def prepare_data(cfg: DataConfig, tokenizer, dist) -> tuple[TokenBlocks, TokenBlocks]:
    train_tokens = load_split(cfg.train, cfg, tokenizer, dist, "train")
    if cfg.val:
        val_tokens = load_split(cfg.val, cfg, tokenizer, dist, "validation")
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
