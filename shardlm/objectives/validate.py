"""One evaluation for every caller and objective (torchtitan's Validator is the model): training's validation
(`Trainer.evaluate`), `shardlm eval` (shardlm.inference.evaluate) and each objective's own numbers.

The loop is the Validator's: this rank's share of the rows (`eval_shares`: every rank the same number of batches,
short ones padded with -1, whose rows weigh nothing), each batch scored through `CausalLM` — so a family's logit
transform (Gemma 2's final soft-capping, Cohere's logit_scale, Granite's logits_scaling) and the trimmed padding
vocabulary count exactly as in training — the sums added in float64 and all-reduced once at the end.

What is summed is the objective's: a `Scorer` names its sums (`fields`), gives them for one batch and turns
their global totals into the result. Text and examples have `TokenScores` (loss per target, perplexity,
accuracy); preference pairs `PairScores` (objectives.preference.pairs); distillation `DistillScores`; each objective
brings its own and reuses the loop, the sharding over ranks and the padding rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import nn

from shardlm.data import Batch, eval_shares
from shardlm.distributed import xla
from shardlm.distributed.process_group import Dist
from shardlm.models.causal_lm import CausalLM
from shardlm.models.loss import IGNORE
from shardlm.observe.metrics import eval_summary


class Rows(Protocol):
    """What the Validator reads of the data (TokenBlocks, ExampleRows, MixtureBlocks, stride windows)."""

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> Batch: ...

    def targets(self, indices: np.ndarray) -> int: ...


class Share(NamedTuple):
    """The rows of one batch: the data they are from, their indices (a padding row reads row 0) and which are real."""

    rows: Any
    indices: np.ndarray
    valid: np.ndarray


class Scorer(Protocol):
    """An objective's validation: the named sums of one batch, and the result of their global totals.

    `sums` gets the model, the batch on the device and its `Share`; a padding row must add nothing. Each sum is a
    scalar tensor or a host number."""

    @property
    def fields(self) -> tuple[str, ...]: ...  # the names of its sums, in the order they are added up

    def sums(self, model: nn.Module, batch: Batch, share: Share) -> Mapping[str, torch.Tensor | float]: ...

    def result(self, totals: dict[str, float]) -> dict[str, Any]: ...


class TokenScores:
    """The next-token loss of text blocks or of examples' answers (their targets only)."""

    fields = ("loss_sum", "correct", "tokens")

    def sums(self, model: nn.Module, batch: Batch, share: Share) -> Mapping[str, torch.Tensor | float]:
        real = torch.from_numpy(share.valid).to(batch.targets.device)
        targets = batch.targets.masked_fill(~real[:, None], IGNORE)  # padding rows: static shapes (XLA)
        loss_sum, correct = model(batch.inputs, targets, batch.positions)
        return {"loss_sum": loss_sum, "correct": correct, "tokens": (targets != IGNORE).sum()}

    def result(self, totals: dict[str, float]) -> dict[str, Any]:
        return eval_summary(totals["loss_sum"], totals["correct"], totals["tokens"])


def to_device(device: torch.device) -> Callable[[Rows, np.ndarray], Batch]:
    """Rows read on the host and copied to `device` (the Trainer passes its own, which pins and prefetches)."""
    return lambda rows, indices: rows.batch(indices).to(device)


@dataclass
class Validator:
    """Scores rows with a model, `batch` rows per batch on each rank, at most `max_batches` per rank (0: all).
    `autocast` is the run's compute context; `on_batch` hears each batch's scored target count (a progress bar)."""

    dist: Dist
    batch: int
    max_batches: int = 0
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    load: Callable[[Any, np.ndarray], Batch] | None = None  # (rows, indices) -> the batch on the device
    on_batch: Callable[[int], None] | None = None

    @torch.no_grad()
    def validate(self, model: nn.Module, rows: Rows, scorer: Scorer) -> dict[str, Any]:
        device = self.dist.device
        model.eval()
        sums = torch.zeros(len(scorer.fields), device=device, dtype=torch.float64)
        for batch, share in self.batches(rows):
            with self.autocast():
                got = scorer.sums(model, batch, share)
            sums += torch.stack([torch.as_tensor(got[k], device=device).double() for k in scorer.fields])
            if device.type == "xla":  # one graph per batch, not one growing over the whole evaluation
                xla.sync()
            if self.on_batch is not None:
                self.on_batch(rows.targets(share.indices[share.valid]))
        totals = self.dist.all_reduce_sum(sums).tolist()
        return scorer.result(dict(zip(scorer.fields, totals, strict=True)))

    def batches(self, rows: Rows) -> Iterator[tuple[Batch, Share]]:
        """This rank's batches of `rows` on the device, each with its Share: what `validate` scores, and what
        scores per sequence read (a preference reference's log-probabilities)."""
        load = self.load or to_device(self.dist.device)
        for indices in eval_shares(len(rows), self.dist.eval_rank, self.dist.eval_world, self.batch,
                                   self.max_batches):
            valid = indices >= 0
            real = np.where(valid, indices, 0)
            yield load(rows, real), Share(rows, real, valid)


def scoring_model(hf_model: nn.Module, loss_chunk: int) -> CausalLM:
    """A loaded Hugging Face model (`shardlm eval`'s) as training scored it: inside `CausalLM`, whose loss applies
    the family's logit transform and leaves the padding vocabulary out."""
    device = next(hf_model.parameters()).device
    return CausalLM(hf_model, loss_chunk).to(device).eval()
