"""`shardlm eval PATH [data.val=...] [--stride S]`: loss, perplexity and accuracy of a saved model.

Block mode scores the same packed blocks training validates on. `--stride` is the sliding-window protocol
used for published GPT-2 perplexities: windows of the model's context advance by `stride` tokens and only
the tokens not scored by an earlier window count, each with up to a full context before it.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.config import build_config, parse_overrides, to_flat_dict
from shardlm.data import TokenBlocks
from shardlm.load import inference_config, load_for_inference
from shardlm.loss import IGNORE, linear_cross_entropy
from shardlm.model import context_length


@torch.no_grad()
def score(model, tokens: torch.Tensor, targets: torch.Tensor, chunk: int) -> tuple[float, int, int]:
    hidden = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    loss, correct = linear_cross_entropy(hidden.flatten(0, 1), head.weight, targets.flatten(), chunk,
                                         getattr(head, "bias", None))
    return loss.item(), correct.item(), int((targets != IGNORE).sum())


def evaluate_blocks(model, blocks: TokenBlocks, batch: int, max_batches: int, chunk: int) -> dict:
    device = next(model.parameters()).device
    n = len(blocks) if max_batches == 0 else min(len(blocks), max_batches * batch)
    total = np.zeros(3)
    for start in range(0, n, batch):
        rows = blocks.get(np.arange(start, min(n, start + batch))).to(device)
        total += score(model, rows[:, :-1], rows[:, 1:], chunk)
    return _summary(total)


def evaluate_stride(model, tokens: np.ndarray, context: int, stride: int, chunk: int) -> dict:
    device = next(model.parameters()).device
    stream = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    total, prev_end = np.zeros(3), 0
    for begin in range(0, len(stream) - 1, stride):
        end = min(begin + context, len(stream) - 1)
        window = stream[begin:end + 1]
        targets = window[1:].clone()
        fresh = end - max(prev_end, begin)  # targets not scored by an earlier window
        targets[: len(targets) - fresh] = IGNORE
        total += score(model, window[None, :-1].to(device), targets[None].to(device), chunk)
        prev_end = end
        if end == len(stream) - 1:
            break
    return _summary(total)


def _summary(total: np.ndarray) -> dict:
    if total[2] == 0:
        raise ShardlmError("nothing to evaluate: the validation data is shorter than one block.")
    loss = total[0] / total[2]
    return {"loss": loss, "ppl": math.exp(min(loss, 700)), "accuracy": total[1] / total[2], "tokens": int(total[2])}


def evaluate_path(path: str, overrides: list[str], stride: int = 0) -> dict:
    from shardlm.data import load_split
    from shardlm.dist import Dist, LaunchInfo

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, saved, _ckpt = load_for_inference(path, device)
    flat = to_flat_dict(inference_config(saved))
    flat["train.eval_batches"] = 0  # the whole validation set unless told otherwise
    flat.update(parse_overrides(overrides))
    cfg = build_config({k: v for k, v in flat.items() if not k.startswith("model.")})
    single = Dist(LaunchInfo("single"), torch.device(device))
    spec = cfg.data.val or (cfg.data.train if saved is not None else None)
    if spec is None:
        raise ShardlmError("an exported model carries no data settings: pass data.val=PATH (or hf:...).")
    tokens = load_split(spec, cfg.data, tokenizer, single, "validation")
    if cfg.data.val is None:  # the held-out tail of the training data, as during training
        tokens = tokens[int(len(tokens) * (1 - cfg.data.val_fraction)):]
    context = context_length(model.config) or 1024
    chunk = cfg.train.loss_chunk_size or 0  # null (auto) scores with the plain loss: no gradients at eval
    if stride:
        result = evaluate_stride(model, tokens, context, stride, chunk)
    else:
        blocks = TokenBlocks(tokens, min(cfg.data.seq_len, context))
        result = evaluate_blocks(model, blocks, cfg.train.batch_size, cfg.train.eval_batches, chunk)
    print(json.dumps(result))
    print(f"loss {result['loss']:.4f}  ppl {result['ppl']:.2f}  accuracy {result['accuracy']:.4f}  "
          f"({result['tokens']:,} tokens)", file=sys.stderr)
    return result
