"""Language modelling (`train.objective=sft`): the next-token loss on text blocks or on examples' answers, the
mean over every target of the optimizer step; MoE's router term rides inside the model's own loss."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from shardlm.config import objectives as specs
from shardlm.data import Blocks
from shardlm.data.prompts import PromptRows
from shardlm.distributed.parallelize import set_gradient_sync
from shardlm.objectives.base import Loop, StepOut
from shardlm.objectives.defaults import Defaults
from shardlm.objectives.validate import TokenScores


def blocks(split: Any) -> Blocks:
    """A split of blocks (text, examples or a mixture); prompts are online RL's alone."""
    assert not isinstance(split, PromptRows), "online RL reads its prompts in shardlm.objectives.rl"
    return split


class LanguageModeling(Defaults):
    names: ClassVar[tuple[str, ...]] = specs.names("lm")

    @classmethod
    def build(cls, loop: Loop) -> LanguageModeling:
        return cls()

    def micro_steps(self, loop: Loop) -> StepOut:
        targets = loop.step_targets()
        # gradients are averaged over every rank, the context ranks that split a row's targets included
        per_rank = targets * loop.batch * loop.accum / loop.global_batch / loop.dist.context_size
        loss_sum = torch.zeros((), device=loop.device)
        for m in range(loop.accum):
            batch = loop.train_batch(m)
            if loop.accum > 1:  # FSDP2 walks every module to set it: once a step is host time at small sizes
                set_gradient_sync(loop.model, m == loop.accum - 1)
            loss_sum += loop.forward_backward_step(batch, per_rank)
        return targets, loss_sum, None

    def validate(self, loop: Loop) -> dict[str, Any]:
        return loop.validator.validate(loop.model, blocks(loop.run.val), TokenScores())
