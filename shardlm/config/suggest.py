"""The nearest valid key or choice for a misspelled one, other trainers' names included."""

from __future__ import annotations

import difflib

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
