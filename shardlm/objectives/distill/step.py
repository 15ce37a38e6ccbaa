"""Distillation in the training loop (`train.objective=distill`): the step's micro-batches scored against the
teacher, and validation by the same objective.

Each micro-batch (text blocks or examples, read as sft reads them; the scored positions are the targets) goes
through the teacher's body first (no_grad, eval, its head copied out of FSDP2's gather once: `teacher_view`), then
through the student's `distill` forward, whose head computes GKD's generalized JSD to the teacher mixed with the
next-token loss in chunks of positions (shardlm.models.distill_loss). With `distill.teacher_topk=K` the teacher
scores the data once before the first step instead (shardlm.objectives.distill.teacher_scores) and is let go: the stored
top-K log-probabilities of the micro-batch's rows stand for it. On the steps `distill.on_policy` draws
(shardlm.objectives.distill.samples), each example's answer is first replaced by the student's own completion,
and the loss is the divergence alone (`distill.alpha`'s next-token part needs the data's answers).

The step's loss is its sum over every target divided once by the step's global target count, as sft's is
(`Loop.step_targets`; an on-policy step counts its sampled targets with one all-reduce), so 2 ranks train what
one process trains and accumulation is exact. The records add the parts per target: `distill/loss` (the
divergence), `distill/nll` (the student's next-token loss, what it is judged by), both entropies at the
temperature, and `distill/on_policy` (the share of the targets that were the student's own samples).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config
from shardlm.config import objectives as specs
from shardlm.data import Batch, ExampleRows, micro_batch_position
from shardlm.distributed.parallelize import reshard, set_gradient_sync
from shardlm.models.distill_loss import LiveTeacher, TopKTeacher
from shardlm.models.loss import IGNORE
from shardlm.objectives.base import Footprint, Loop, MemoryTerms, StepOut
from shardlm.objectives.defaults import Defaults
from shardlm.objectives.distill.memory import distill_memory
from shardlm.objectives.distill.preflight import (
    check_live_teacher,
    check_teacher_family,
    check_teacher_resume,
    teacher_lines,
)
from shardlm.objectives.distill.samples import on_policy_step, row_keys, step_completions
from shardlm.objectives.distill.teacher import (
    check_teacher_tokenizer,
    former_key,
    identity_key,
    load_teacher,
    teacher_changed,
    teacher_identity,
    teacher_source,
)
from shardlm.objectives.distill.teacher_scores import TeacherScores, prepare_teacher_topk
from shardlm.objectives.lm import blocks
from shardlm.objectives.validate import Share
from shardlm.observe.metrics import held_out_words

if TYPE_CHECKING:
    from shardlm.models.causal_lm import CausalLM

Run = Any  # shardlm.training.build's, a layer above: its cfg, dist, plan, tokenizer, train and val

PARTS = ("distill", "nll", "teacher_entropy", "student_entropy")  # distill_loss's sums, in the records' order
RECORDS = ("distill/loss", "distill/nll", "distill/teacher_entropy", "distill/student_entropy", "distill/on_policy")


class Distill(Defaults):
    """The objective of a distillation run: its teacher (live, or its stored top-K scores) and the step."""

    names: ClassVar[tuple[str, ...]] = specs.names("distill")
    stats: ClassVar[tuple[str, ...]] = RECORDS  # per target
    perplexity: ClassVar[bool] = False  # a mix of divergence and next-token loss (its records give the student's ppl)

    @classmethod
    def check_data(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any) -> None:
        """As sft's; on-policy steps sample answers to the examples' prompts, which text blocks do not have."""
        super().check_data(cfg, hf_cfg, train, val)
        if cfg.distill.on_policy > 0 and not all(isinstance(part, ExampleRows)
                                                 for part in getattr(train, "parts", [train])):
            raise ShardlmError(f"distill.on_policy={cfg.distill.on_policy} samples the student's answers to the "
                               "examples' prompts, and data.train was read as text blocks, which have none: give "
                               "examples (prompt/completion or chat records), or set distill.on_policy=0.")
        if cfg.distill.teacher_topk == 0:  # before a resume's checks, as the dry run's teacher lines come first
            check_teacher_family(cfg)

    @classmethod
    def check_resume(cls, cfg: Config, hf_cfg: Any, train: Any, val: Any, resumed: Any, on_main: Callable) -> None:
        if resumed is not None:
            check_teacher_resume(cfg, resumed, on_main)

    @classmethod
    def model_lines(cls, cfg: Config, tokenizer: Any) -> list[str]:
        return teacher_lines(cfg, tokenizer)

    @classmethod
    def card_line(cls, cfg: Config) -> str | None:
        d = cfg.distill
        return (f"distill from {d.teacher} (beta {d.beta:g}, temperature {d.temperature:g}, alpha {d.alpha:g}"
                + (f", top-{d.teacher_topk} scores" if d.teacher_topk else "")
                + (f", on_policy {d.on_policy:g}" if d.on_policy else "") + ")")

    @classmethod
    def memory(cls, cfg: Config, f: Footprint) -> MemoryTerms:
        """The teacher beside the student (or a micro-batch of its stored scores); distill_loss's chunks replace
        the next-token loss's (shardlm.objectives.distill.memory)."""
        dm = distill_memory(cfg, f.tokens, f.shard, f.csize, f.on_device, f.use_fsdp, f.chunk, f.head, f.tokenizer)
        return MemoryTerms(resident=dm.resident, loss=dm.loss, notes=dm.notes)

    @classmethod
    def describe_val(cls, cfg: Config, result: dict[str, Any], held_out: int) -> str:
        return (f"loss {result['loss']:.4f} (distill/loss {result['distill/loss']:.4f}, distill/nll "
                f"{result['distill/nll']:.4f}, ppl {result['ppl']:.2f}) "
                + held_out_words(result["tokens"], held_out, cfg.train.eval_batches))

    @classmethod
    def build(cls, loop: Loop) -> Distill:
        return cls(loop.run, loop.build_model)  # its teacher built beside the model

    def __init__(self, run: Run, build_model: Callable[..., CausalLM]):
        self.build_model = build_model
        self.run, self.d, self.cfg = run, run.cfg.distill, run.cfg
        self.vocab = len(run.tokenizer)
        self.src = teacher_source(self.d.teacher)
        self.identity = teacher_identity(self.src)
        self.key = identity_key(self.identity)
        self.teacher: CausalLM | None = None
        if self.d.teacher_topk > 0:  # built in `prepare` only if it has data to score: its scores stand for it
            check_teacher_tokenizer(run.tokenizer, self.src, run.cfg.model.trust_remote_code)
        else:
            self.teacher = self._load()
            check_live_teacher(self.teacher.hf.config.model_type, self.teacher.full_logits)
        self.scores: TeacherScores | None = None

    def _load(self) -> CausalLM:
        return load_teacher(self.cfg, self.run, self.build_model, self.src)

    # ---- what the run's state keeps: the teacher's identity -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"teacher_key": self.key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume with another teacher is refused before any step (the teacher is never in a checkpoint)."""
        saved = state.get("teacher_key")
        if saved is not None and saved not in (self.key, former_key(self.src, self.identity)):
            raise teacher_changed(self.cfg, saved, self.key)

    def resumed(self, loop: Loop) -> None:
        """A resumed top-K run's stored scores are read (and checked) before the run writes anything."""
        self.prepare(loop)

    # ---- one micro-batch ---------------------------------------------------------------------------------------
    def prepare(self, trainer: Loop) -> None:
        """Top-K: the stored scores, scored now (a scoring cut short continued) if the run is at step 0, the teacher
        built for it and let go after; past step 0 they must exist, and no teacher is built."""
        if self.d.teacher_topk <= 0 or self.scores is not None:
            return
        scorer = self._load() if trainer.step == 0 else None
        self.scores = prepare_teacher_topk(self.run, scorer, self.d.teacher_topk, self.d.temperature,
                                           identity=self.identity, step=trainer.step, batch=trainer.batch,
                                           autocast=trainer.autocast)

    def teacher_for(self, batch: Batch, split: str, indices: np.ndarray | None) -> LiveTeacher | TopKTeacher:
        if self.scores is not None:
            assert indices is not None
            return self.scores.for_rows(split, indices, batch)
        assert self.teacher is not None
        view = self.teacher.teacher_view(batch.inputs, batch.targets, batch.positions)
        reshard(self.teacher)  # a frozen model keeps nothing gathered for a backward it never has
        return view

    def loss(self, model: nn.Module, batch: Batch, split: str, indices: np.ndarray | None = None,
             sampled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(the objective's sum over the batch's targets, the sums of PARTS): `indices` are the batch's rows of
        `split` (stored top-K scores are addressed by them). On the student's own completions (`sampled`) the
        objective is the divergence alone: a sampled token is no label, and its next-token loss has zero expected
        gradient at sample_temperature 1 (it only sharpens below), so `distill.alpha` weighs the data's steps."""
        teacher = self.teacher_for(batch, split, indices)
        student = cast("CausalLM", model)
        loss_sum, parts = student.distill(batch.inputs, batch.targets, batch.positions, teacher, beta=self.d.beta,
                                          temperature=self.d.temperature, alpha=1.0 if sampled else self.d.alpha,
                                          vocab=self.vocab)
        return loss_sum, torch.stack([parts[k].float() for k in PARTS])

    # ---- one optimizer step --------------------------------------------------------------------------------
    def micro_steps(self, trainer: Loop) -> StepOut:
        """A step's micro-batches: (the step's global targets, this rank's loss sum, the RECORDS' sums)."""
        self.prepare(trainer)
        model, accum = trainer.model, trainer.accum
        sampled = self._on_policy_batches(trainer)
        if sampled is not None:
            local = torch.tensor(float(sum(int((b.targets != IGNORE).sum()) for b in sampled)),
                                 device=trainer.device)
            targets = max(1, int(trainer.dist.all_reduce_sum(local).item()))
        else:
            targets = trainer.step_targets()
        per_rank = targets * trainer.batch * accum / trainer.global_batch  # gradients are averaged over ranks
        loss_sum = torch.zeros((), device=trainer.device)
        stats = torch.zeros(len(RECORDS), device=trainer.device)
        for m in range(accum):
            batch = sampled[m] if sampled is not None else trainer.train_batch(m)
            rows = trainer.indices(trainer.position, m) if self.scores is not None else None
            set_gradient_sync(model, m == accum - 1)
            with trainer.autocast():
                part_sum, parts = self.loss(model, batch, "train", rows, sampled=sampled is not None)
            loss = part_sum / per_rank
            (trainer.scaler.scale(loss) if trainer.scaler else loss).backward()
            loss_sum += part_sum.detach()
            stats[:len(PARTS)] += parts.detach()
            if sampled is not None:
                stats[len(PARTS)] += (batch.targets != IGNORE).sum()
        return targets, loss_sum, stats

    def _on_policy_batches(self, trainer: Loop) -> list[Batch] | None:
        """On a step `distill.on_policy` draws: the step's micro-batches with the student's own answers (sampled
        in one round for the whole step; each example keyed by its place in the data order). Else None."""
        if not on_policy_step(self.cfg.train.seed, trainer.step, self.d.on_policy):
            return None
        d = trainer.dist
        batches = [trainer.train_batch(m) for m in range(trainer.accum)]
        keys = [row_keys(micro_batch_position(trainer.position, m, d.data_rank, d.data_world, trainer.batch),
                         trainer.batch) for m in range(trainer.accum)]
        sampled = step_completions(trainer.model, batches, self.run.tokenizer, self.cfg, keys, trainer.autocast)
        trainer.model.train()
        return sampled

    def validate(self, trainer: Loop) -> dict[str, Any]:
        """The same objective on the validation split (offline data: no completions sampled)."""
        self.prepare(trainer)
        return trainer.validator.validate(trainer.model, blocks(self.run.val), DistillScores(self))


class DistillScores:
    """Validation of distillation (shardlm.objectives.validate's Scorer): the objective, its parts and the student's
    next-token loss per target; `ppl` is the student's own perplexity, exp of `distill/nll`."""

    fields = ("loss_sum", *PARTS, "tokens")

    def __init__(self, distill: Distill):
        self.distill = distill

    def sums(self, model: nn.Module, batch: Batch, share: Share) -> Mapping[str, torch.Tensor | float]:
        real = torch.from_numpy(share.valid).to(batch.targets.device)
        batch = batch._replace(targets=batch.targets.masked_fill(~real[:, None], IGNORE))  # padding rows: none
        loss_sum, parts = self.distill.loss(model, batch, "val", np.where(share.valid, share.indices, -1))
        return {"loss_sum": loss_sum, **dict(zip(PARTS, parts, strict=True)),
                "tokens": (batch.targets != IGNORE).sum()}

    def result(self, totals: dict[str, float]) -> dict[str, Any]:
        n = totals["tokens"]
        if n == 0:
            raise ShardlmError("nothing to evaluate: the validation data has no targets.")
        nll = totals["nll"] / n
        return {"loss": totals["loss_sum"] / n, "ppl": math.exp(min(nll, 700)),
                **{f"distill/{k if k != 'distill' else 'loss'}": totals[k] / n for k in PARTS}, "tokens": int(n)}
