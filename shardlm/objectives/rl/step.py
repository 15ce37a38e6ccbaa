"""Online RL from rewards in the training loop (`train.objective` grpo, rloo): the generation rounds, the
micro-batches of completions and their loss, the step's statistics and the RL validation.

A step (TRL's GRPOTrainer with steps_per_generation = grad_accum) takes `global_batch / group` prompts of the data
order, each rank its contiguous share (whole groups), samples `group` completions of each (one generation round,
the FSDP2 units gathered once for it), scores them with the reward functions, and trains on its
`batch_size x grad_accum` completions in micro-batches of `batch_size`. A round serves `num_iterations` steps
(μ); with μ > 1 the policy's log-probabilities at sampling time (the old ones) are kept with it. Each completion
is scored by `CausalLM.completion_logps`, the training forward, on the ids that were sampled (never re-tokenized
text). The loss of a micro-batch is its share of the step's (shardlm.objectives.rl.loss.step_loss with the step's
global counts), so 2 ranks train what 1 process trains.

Sampling keys are the prompts' positions in the data order: a resumed run samples what the uninterrupted one
sampled, and no sampling state is checkpointed; checkpoints are taken at a round's end (`cycle_done`). Forwards
run eager (`torch.compiler.set_stance("force_eager")`): a compiled block (dynamic=False) would recompile at every
new length of a KV-cache decode or a completion batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as tdist

from shardlm.config import objectives as specs
from shardlm.config.grpo import steps_per_round
from shardlm.distributed.parallelize import reshard, set_gradient_sync
from shardlm.models import lora
from shardlm.models.causal_lm import shares_prefix
from shardlm.objectives.base import Footprint, Loop, MemoryTerms, StepOut
from shardlm.objectives.defaults import Defaults
from shardlm.objectives.preference.reference import frozen_reference
from shardlm.objectives.rl import checks, memory
from shardlm.objectives.rl.ahead import Pipeline, Sampled
from shardlm.objectives.rl.correction import correct, correction_stats, sampler_logps
from shardlm.objectives.rl.dynamic import dynamic_round
from shardlm.objectives.rl.engine import VLLMSampler, check_heads
from shardlm.objectives.rl.logps import micro_batch, shared_batch, shared_pays
from shardlm.objectives.rl.loss import (
    clip_counts,
    rloo_advantages,
    rloo_loss,
    step_loss,
    token_loss,
)
from shardlm.objectives.rl.rollout import ScoredRound, eager, prompt_split, round_metrics, sampling_params, score_round
from shardlm.objectives.rl.sampling import Sampler, TransformersSampler
from shardlm.objectives.rl.server import ServerSampler, wait_for_server
from shardlm.objectives.rl.tools import load_toolbox, tool_fields, with_environment_reward
from shardlm.objectives.rl.validate import describe_prompts, validate_prompts
from shardlm.tokenizer import end_of_turn_id


@dataclass
class MicroBatch:
    """`batch_size` completions as rows prompt + completion (right-padded, positions 0..L-1), the targets their
    completion tokens; `mask` (rows, longest completion) marks the tokens the loss counts."""
    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor  # (rows, T) True at a completion's tokens
    mask: torch.Tensor  # (rows, T) float: lengths, zero for a completion the loss leaves out
    advantages: torch.Tensor
    old: torch.Tensor | None = None  # (rows, T) the policy's at sampling time (μ > 1, rloo with β > 0)
    ref: torch.Tensor | None = None  # (rows, T) the reference's (β > 0)
    attention: torch.Tensor | None = None  # shared_batch's 4D mask: rows hold a prompt and its completions
    sampling: torch.Tensor | None = None  # (rows, T) the sampler's own (its importance-sampling correction)
    weights: torch.Tensor | None = None  # that correction's ratios, (rows, T) or (rows, 1), once computed


@dataclass
class Round:
    scored: ScoredRound
    micro: list[MicroBatch]
    tokens: list[float]  # completion tokens the loss counts in each step's slice, over every rank
    metrics: dict[str, float]
    used: int = 0  # steps trained on it so far
    texts: list[str] = field(default_factory=list)


class RLStep(Defaults):
    """One per run: `micro_steps` is a step's forward and backward, `validate` the RL validation."""

    names: ClassVar[tuple[str, ...]] = specs.names("rl")
    stats: ClassVar[tuple[str, ...]] = ()  # the step's statistics come reduced over every rank, as a dict
    sampled: ClassVar[bool] = True
    perplexity: ClassVar[bool] = False

    # ---- before the run (shardlm.objectives.rl.checks) -----------------------------------------------------------
    @classmethod
    def load_data(cls, cfg: Any, tokenizer: Any, dist: Any, load: Callable | None = None) -> tuple[Any, Any]:
        return checks.load_prompts(cfg, tokenizer, dist)  # rendered, never counted: `load` is for blocks

    @classmethod
    def check_data(cls, cfg: Any, hf_cfg: Any, train: Any, val: Any) -> None:
        checks.check_prompts(cfg, train, val)
        check_heads(cfg, hf_cfg)
        if cfg.grpo.use_vllm and cfg.grpo.vllm_mode == "server":
            wait_for_server(cfg.grpo)

    @classmethod
    def count_steps(cls, cfg: Any, train: Any, world: int) -> int:
        return checks.count_rl_steps(cfg, train, world)

    @classmethod
    def data_line(cls, cfg: Any, train: Any, val: Any, steps: int, rows: int) -> str:
        return checks.data_line(cfg, train, val, steps, rows)

    @classmethod
    def count_line(cls, cfg: Any, train: Any, val: Any, steps: int, rows: int) -> str:
        return checks.count_line(cfg, train, val, steps, rows)

    @classmethod
    def preflight_lines(cls, cfg: Any, tokenizer: Any, train: Any) -> list[str]:
        return checks.prompt_lines(cfg, tokenizer, train)

    @classmethod
    def answer_tokens(cls, cfg: Any) -> int:
        """The closing answers are as long as the run's completions may be, not train.sample_tokens."""
        return min(cfg.train.sample_tokens, cfg.grpo.max_completion_length)

    @classmethod
    def card_line(cls, cfg: Any) -> str | None:
        g = cfg.grpo
        return (f"{cfg.train.objective} from rewards ({', '.join(g.rewards)}; grpo.group {g.group}, beta {g.beta:g}, "
                f"loss_type {g.loss_type}, max_completion_length {g.max_completion_length}, temperature "
                f"{g.temperature:g})")

    @classmethod
    def memory_rows(cls, cfg: Any, hf_cfg: Any) -> tuple[int, int, bool]:
        return memory.rl_rows(cfg, hf_cfg)

    @classmethod
    def memory(cls, cfg: Any, f: Footprint) -> MemoryTerms:
        return memory.rl_memory(cfg, f)

    @classmethod
    def describe_val(cls, cfg: Any, result: dict[str, Any], held_out: int) -> str:
        return describe_prompts(result, held_out)

    # ---- in the run ----------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, loop: Loop) -> RLStep:
        return cls(loop.run, loop.batch, loop.accum, loop.autocast, loop.build_model)

    def __init__(self, run: Any, batch: int, accum: int, autocast: Callable[[], AbstractContextManager[Any]],
                 build_model: Callable | None = None):
        from shardlm.objectives.rl.rewards import load_rewards

        cfg, g = run.cfg, run.cfg.grpo
        self.run, self.g, self.dist, self.model, self.tok = run, g, run.dist, run.model, run.tokenizer
        self.objective, self.batch, self.accum, self.autocast = cfg.train.objective, batch, accum, autocast
        self.build_model = build_model
        self.world = run.dist.data_parallel
        self.per_rank = batch * accum // g.group  # prompts of a step on each rank
        self.per_step = self.per_rank * self.world
        self.steps = steps_per_round(g, batch, accum, self.world)  # optimizer steps a round serves, each its slice
        self.box = load_toolbox(g, self.tok)
        self.rewards = with_environment_reward(load_rewards(g, tool_fields(
            prompt_split(run.train, "training").field_names, self.box)), self.box)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        # token ids in, token ids (and their log-probabilities) out: shardlm's own decode, or a vLLM engine
        self.engine: VLLMSampler | ServerSampler | None = None
        self.sampler: Sampler = TransformersSampler(run.model.hf, self.pad, root=run.model,
                                                    max_rows=max(batch * accum, g.group), vocab=run.model.vocab)
        if g.use_vllm:
            length = g.vllm_max_model_length or cfg.data.seq_len
            rows = max(batch * accum * self.steps, g.group, batch * cfg.train.eval_batches)  # a request's at most
            self.engine = ServerSampler(run.model, g, length, cfg.parallel.precision, cfg.train.seed, run.dist,
                                        run.model.vocab, rows) if g.vllm_mode == "server" else \
                VLLMSampler(run.model, g, length, cfg.parallel.precision, cfg.train.seed, run.dist.device,
                            run.model.vocab, rows)
            self.sampler = self.engine
        self.trained, self.synced_at = 0, 0  # optimizer steps so far; their count when the engine last synced
        self.ahead = g.max_staleness  # rounds generated ahead on the server (asynchronous generation)
        self.pipeline = Pipeline(self.ahead)
        # TRL's vLLM importance-sampling correction, for any sampler that gives its log-probabilities (grpo's loss)
        self.correct = g.vllm_importance_sampling_correction and self.objective == "grpo"
        stop = [t for t in (end_of_turn_id(self.tok), self.tok.eos_token_id) if t is not None]
        self.params = sampling_params(g, stop, cfg.train.seed)
        self.round: Round | None = None
        self.taken = 0  # prompts the last step drew from the data (0: it reused its round)
        self.sampled_tokens = 0  # prompt and completion tokens sampled, over every rank
        self.frozen: Any = None  # β > 0 without LoRA: the frozen initial model
        self.shared = shares_prefix(run.model)  # a prompt's completions in one row (shared_batch)

    # ---- state --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rl_tokens": self.sampled_tokens, "rl_round_used": self.round.used if self.round else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampled_tokens = int(state.get("rl_tokens", 0))
        used = int(state.get("rl_round_used", 0))
        if 0 < used < self.round_steps:  # a callback's stop inside a round (signals wait for its end)
            self.dist.print(f"note: this checkpoint was saved after {used} of the {self.round_steps} steps of its "
                            "generation round (grpo.num_iterations x the steps a round feeds), which checkpoints do "
                            "not hold: the run samples a new round now, and differs from an uninterrupted one from "
                            "here on")

    @property
    def round_steps(self) -> int:
        """The optimizer steps a round serves: each of its slices, num_iterations times over."""
        return self.steps * self.g.num_iterations

    def cycle_done(self) -> bool:
        """Whether the last round has served all its steps: a checkpoint then loses nothing."""
        return self.round is None or self.round.used >= self.round_steps

    def may_save(self, step: int, total: int) -> bool:
        """Checkpoints, periodic or for a signal, wait for a round's end (num_iterations > 1); the last step's
        does not."""
        return self.cycle_done() or step == total

    def tokens_seen(self, loop: Loop) -> int:
        """Prompt and completion tokens sampled."""
        return self.sampled_tokens

    def advance(self, loop: Loop) -> int:
        """The data order holds prompts: a step draws a round's, or none when it reuses its round."""
        return self.taken

    # ---- collectives --------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        if not self.dist.distributed:
            return
        on = tensor.to(self.dist.device)
        tdist.all_reduce(on, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
        tensor.copy_(on.to(tensor.device))

    # ---- a round ------------------------------------------------------------------------------------------------
    def slots(self) -> list[int]:
        """The places in a round's prompts that are this rank's: its share of each step's, in step order."""
        first = self.dist.rank * self.per_rank
        return [s * self.per_step + first + j for s in range(self.steps) for j in range(self.per_rank)]

    def _share(self, order: np.ndarray, position: int) -> tuple[list[Any], list[list[int]], list[int]]:
        """This rank's prompts of a round (its share of each step's, as if sampled step by step), their ids and
        sampling keys (their places in the data order)."""
        rows = prompt_split(self.run.train, "training")
        mine = self.slots()
        return ([rows.prompt(int(order[j])) for j in mine], [rows.token_ids(int(order[j])) for j in mine],
                [position + j for j in mine])

    def _new_round(self, loop: Loop, position: int, ready: tuple[Any, int] | None = None) -> Round:
        """The round at `position`: sampled now (with dynamic sampling, until its groups' rewards differ), or
        `ready` (generated ahead: its rollout and the step count of the weights that sampled it), then scored."""
        extra: dict[str, float] = {}
        if self.g.dynamic_sampling:
            scored, self.taken, extra = dynamic_round(self, loop, position)
        else:
            prompts, ids, keys = self._share(loop.sampler.indices(position, self.taken), position)
            sampler: Any = self.sampler if ready is None else Sampled(ready[0])
            with eager(), self.autocast():  # the run's compute context (plain bf16's blocks expect autocast)
                scored = score_round(sampler, self.tok, prompts, ids, keys, self.rewards, self.g, self.params,
                                     self.objective, self.all_reduce, self.box)
        metrics = round_metrics(scored, self.rewards.metric_names, self.all_reduce) | extra
        if self.ahead:
            metrics["sampling/policy_lag"] = float(self.trained - (self.synced_at if ready is None else ready[1]))
        r = scored.rollout
        device = self.dist.device
        micro = []
        for m in range(self.accum * self.steps):
            span = range(m * self.batch, (m + 1) * self.batch)
            completions = [r.completions[i] for i in span]
            attention, group = None, self.g.group
            marks = [r.trainable[i] for i in span] if r.trainable else None
            if self.shared and shared_pays(r.prompts[span.start // group:span.stop // group], completions, group):
                tokens, positions, targets, lengths, attention = shared_batch(
                    r.prompts[span.start // group:span.stop // group], completions, group, self.pad, device, marks)
            else:
                tokens, positions, targets, lengths = micro_batch([r.prompt_of(i) for i in span], completions,
                                                                  self.pad, device, marks)
            mask = lengths.float() * scored.loss_mask[span.start:span.stop, None].to(device)
            micro.append(MicroBatch(tokens, positions, targets, lengths, mask,
                                    scored.scored.advantages[span.start:span.stop].to(device), attention=attention,
                                    sampling=sampler_logps(r, span, lengths) if self.correct or self.ahead
                                    else None))
        per_slice = [sum(mb.mask.sum().item() for mb in micro[s * self.accum:(s + 1) * self.accum])
                     for s in range(self.steps)]
        sampled = torch.tensor([float(sum(len(r.prompt_of(i)) + len(c) for i, c in enumerate(r.completions))),
                                *per_slice], dtype=torch.float64)
        self.all_reduce(sampled)
        self.sampled_tokens += int(sampled[0].item())
        metrics |= {"step_completions": float(self.per_step * self.g.group), "step_tokens": sampled[0].item()}
        out = Round(scored, micro, sampled[1:].tolist(), metrics, texts=scored.texts)
        self._score_before_training(out)
        return out

    @torch.no_grad()
    def _score_before_training(self, r: Round) -> None:
        """The old log-probabilities (a round that serves more than one step: μ > 1 or several slices; rloo with
        β > 0, whose reward takes the KL) and the reference's."""
        beta, rloo = self.g.beta, self.objective == "rloo"
        for mb in r.micro:
            if self.ahead and mb.sampling is not None:  # sampled by older weights: the behaviour policy's, as sampled
                mb.old = mb.sampling.clone()
            elif self.round_steps > 1 or (rloo and beta > 0):
                mb.old = self._logps(self.model, mb)[0].detach()
            if beta > 0:
                mb.ref = self._reference_logps(mb)
        if rloo and beta > 0:  # the KL goes into the reward, before the leave-one-out advantages
            kl = torch.cat([((mb.old - mb.ref) * mb.lengths).sum(1) for mb in r.micro]).cpu()  # type: ignore[operator]
            sums = torch.stack([kl.sum(), torch.cat([mb.lengths.sum(1) for mb in r.micro]).sum().cpu()]).double()
            self.all_reduce(sums)
            r.metrics["kl"] = (sums[0] / sums[1].clamp(min=1)).item()  # TRL's: per token, old policy vs reference
            s = r.scored.scored
            advantages = rloo_advantages(r.scored.per_func, self.rewards.weight_tensor, self.g.group,
                                         self.g.normalize_advantages, kl=kl, beta=beta)
            r.scored.scored = advantages._replace(std_zero=s.std_zero)
            for m, mb in enumerate(r.micro):
                mb.advantages = advantages.advantages[m * self.batch:(m + 1) * self.batch].to(mb.mask.device)

    def _logps(self, model: Any, mb: MicroBatch, with_entropy: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, T) log-probabilities (and entropies) of the micro-batch's completion tokens."""
        with eager(), self.autocast():
            flat, entropy = model.completion_logps(mb.tokens, mb.positions, mb.targets, self.g.temperature,
                                                   with_entropy, mb.attention)
        logps = torch.zeros(mb.lengths.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mb.lengths, flat)
        if entropy is not None:
            entropy = torch.zeros(mb.lengths.shape, device=flat.device).masked_scatter(mb.lengths, entropy.float())
        return logps, entropy

    def _reference_logps(self, mb: MicroBatch) -> torch.Tensor:
        """The initial model's: with LoRA the policy with its adapters off, else a frozen copy sharded alike."""
        if lora.enabled(self.run.cfg.lora):
            with lora.adapters_off(self.model):
                return self._logps(self.model, mb)[0].detach()
        if self.frozen is None:
            self.frozen = frozen_reference(self.run, self.build_model)
        logps = self._logps(self.frozen, mb)[0].detach()
        reshard(self.frozen)
        return logps

    def sync_engine(self, every: int) -> None:
        """The engine takes the policy's weights when it never has (a new or resumed run: it starts with dummy
        ones) or `every` optimizer steps have passed since it last did."""
        if self.engine is not None and (self.engine.syncs == 0 or self.trained - self.synced_at >= every):
            self.engine.sync()
            self.synced_at = self.trained

    # ---- a step -------------------------------------------------------------------------------------------------
    def micro_steps(self, loop: Loop) -> StepOut:
        """A step's forwards and backwards: (1, this rank's share of the step's loss, the step's statistics over
        every rank), on the prompts of the data order (`loop.sampler`) from `loop.position` on."""
        self.taken = 0
        if self.cycle_done():
            count = self.per_step * self.steps
            ready = self.pipeline.take(loop.position)  # its generation is over: the engine is free
            self.sync_engine(self.g.weight_sync_steps)
            self.taken = count  # dynamic sampling may take more
            self.round = self._new_round(loop, loop.position, ready)
            for position in self.pipeline.wanted(loop.position, count):  # sampled while this round trains
                _, ids, keys = self._share(loop.sampler.indices(position, count), position)
                self.pipeline.launch(position, self.sampler, ids, keys, self.params, self.synced_at)
        self.trained += 1  # the optimizer step that follows
        r = self.round
        assert r is not None
        g, part = self.g, r.used % self.steps  # the round's slice this step trains on
        completions, tokens = self.batch * self.accum, r.tokens[part] / self.world  # this rank's share of the step's
        loss_sum = torch.zeros((), device=self.dist.device)
        sums = torch.zeros(6, dtype=torch.float64, device=self.dist.device)  # low, high, counted, kl, entropy, tokens
        fresh, corrected = self.taken > 0, False
        is_sums = torch.zeros(4, dtype=torch.float64, device=self.dist.device)
        is_highs = torch.full((3,), -math.inf, dtype=torch.float64, device=self.dist.device)
        for m, mb in enumerate(r.micro[part * self.accum:(part + 1) * self.accum]):
            set_gradient_sync(self.model, m == self.accum - 1)
            logps, entropy = self._logps(self.model, mb, with_entropy=True)
            if mb.sampling is not None and mb.weights is None:  # once per micro-batch, at its first step
                corrected = True
                mb.weights = correct(mb.sampling, mb.old if mb.old is not None else logps.detach(), mb.lengths, g,
                                     is_sums, is_highs)
            if self.objective == "rloo":
                old = None if mb.old is None else (mb.old * mb.lengths).sum(1)
                loss, ratio = rloo_loss(logps, old, mb.advantages, mb.mask, completions, g.epsilon, g.epsilon_high)
                ratio, kl = ratio.unsqueeze(1), None
            else:
                parts = token_loss(logps, mb.old, mb.advantages, mb.mask, g.epsilon, g.epsilon_high, g.beta, mb.ref,
                                   g.delta, g.importance_sampling_level, mb.weights)
                loss = step_loss(parts.per_token, mb.mask, g.loss_type, completions, tokens, g.max_completion_length)
                ratio, kl = parts.ratio, parts.kl
            loss.backward()
            loss_sum += loss.detach() / self.world
            clipped = clip_counts(ratio.detach(), mb.advantages, mb.mask, g.epsilon, g.epsilon_high)
            counted = mb.mask.sum()
            sums += torch.stack([clipped.low, clipped.high, clipped.tokens,
                                 (kl.detach() * mb.mask).sum() if kl is not None else counted * 0,
                                 (entropy * mb.mask).sum() if entropy is not None else counted * 0, counted]).double()
        r.used += 1
        stats = self._step_stats(sums, r, fresh=fresh)
        if corrected:
            stats |= correction_stats(is_sums, is_highs, self.all_reduce)
        return 1, loss_sum, stats

    def _step_stats(self, sums: torch.Tensor, r: Round, fresh: bool) -> dict[str, float]:
        self.all_reduce(sums)
        low, high, counted, kl, entropy, tokens = sums.tolist()
        stats = {"clip_ratio/low_mean": low / max(counted, 1), "clip_ratio/high_mean": high / max(counted, 1),
                 "clip_ratio/region_mean": (low + high) / max(counted, 1), "entropy": entropy / max(tokens, 1)}
        if self.g.beta > 0 and self.objective != "rloo":  # rloo's is the round's (its metrics)
            stats["kl"] = kl / max(tokens, 1)
        if fresh:  # the round's generation metrics, once (TRL logs them at generation)
            stats |= r.metrics
        return stats

    def sample_lines(self, n: int = 2) -> list[str]:
        """A few of this rank's completions of the last round with their rewards (printed at log steps). The
        prompt's tail and the completion are shown as reprs of at most 40 and 100 characters, cut at whole
        characters ('...' where the completion is cut): an escape such as '\\x01' takes 4 characters and a token
        may decode to many, so an uncut line could run to hundreds."""
        def cut(text: str, width: int, tail: bool = False) -> str:  # the longest end (start) whose repr fits
            part = text[-width:] if tail else text[:width]
            while len(repr(part)) > width:
                part = part[1:] if tail else part[:-1]
            return part

        r = self.round
        if r is None:
            return []
        out = []
        names = self.rewards.metric_names
        for p in range(min(n, len(r.scored.rollout.prompts))):
            i = p * self.g.group
            prompt = cut(self.tok.decode(r.scored.rollout.prompts[p], skip_special_tokens=False), 40, tail=True)
            text = cut(r.texts[i], 100)
            values = ", ".join(f"{k} {v:.2f}" for k, v in zip(names, r.scored.per_func[i].tolist(), strict=True))
            out.append(f"  sample: ...{prompt!r} -> {text!r}{'...' * (text != r.texts[i])} ({values})")
        return out

    # ---- validation ---------------------------------------------------------------------------------------------
    def validate(self, loop: Loop) -> dict[str, Any]:
        self.sync_engine(1)  # the policy as it is now, whatever grpo.weight_sync_steps
        return validate_prompts(self, loop.run.val, loop.run.cfg.train.eval_batches)


def evaluate_prompts(model: Any, tokenizer: Any, cfg: Any, device: torch.device) -> dict[str, Any]:
    """`shardlm eval` of an online RL run: its validation (`RLStep.validate`: the same seeded samples and greedy
    completions) on a loaded model, in one process."""
    from types import SimpleNamespace

    from shardlm.distributed.process_group import Dist, LaunchInfo
    from shardlm.objectives.validate import scoring_model

    dist = Dist(LaunchInfo("single"), device)
    _, val = checks.load_prompts(cfg, tokenizer, dist)  # rendered with the run's tools, as it trained
    lm = scoring_model(model, cfg.train.loss_chunk_size or 0)
    run = SimpleNamespace(cfg=cfg, dist=dist, model=lm, tokenizer=tokenizer, train=val)
    result = validate_prompts(RLStep(run, cfg.train.batch_size, 1, contextlib.nullcontext), val,
                              cfg.train.eval_batches)
    return result | {"held_out_tokens": len(val)}
