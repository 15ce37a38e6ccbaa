"""The checks a run makes before it builds its model or writes a file, as one list: `build()` runs it on the real
run, `shardlm train --dry-run` (shardlm.preflight.dryrun) on counted data and a model on `meta`, so what one
refuses the other refuses with the same message. In the run's order:

- `check_setup`, before the tokenizer: `check_settings` (the trackers' libraries, QLoRA's device and plan, the
  optimizer's name, arguments and library, the schedule's names: what `shardlm sweep` checks of each value it will
  try), out_dir, and the optimizer of the checkpoint the run would resume;
- `check_data`, once the blocks are cut: packing on the model's family, the objective against the data (pairs
  for dpo/ipo/simpo/orpo, none for sft), one global batch, the schedule against the run's steps;
- `check_resume`, where a checkpoint would be resumed: a preference run's reference is the one it started with.

The model's config (shardlm.models.hf_config `model_config`), the checkpoint against the config (`check_resumable`,
at load, before anything is written) and train.gen_every's needs (shardlm.inference.genquality
`check_generation`, a layer above this one) are shared the same way: one function each, called by both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from shardlm import ShardlmError
from shardlm.checkpoint import layout
from shardlm.config import Config
from shardlm.config.grpo import RL_OBJECTIVES
from shardlm.data import ExampleRows, Split, TokenBlocks, check_prompts_fit, describe
from shardlm.data.blocks import counted
from shardlm.data.cache import cache_root
from shardlm.data.examples import reference_problem
from shardlm.data.prompts import PromptRows, completion_for_rewards
from shardlm.distributed.parallelize import Plan, plan
from shardlm.distributed.process_group import pick_device
from shardlm.models import lora
from shardlm.models.hf_config import check_packing
from shardlm.objectives.preference.losses import OBJECTIVES, REFERENCE_FREE
from shardlm.objectives.preference.pairs import (
    check_objective,
    damaged_reference,
    initial_key,
    live_reference_changed,
    missing_reference,
    pair_rows,
    reference_key,
    unscored,
)
from shardlm.objectives.rl.rewards import call, load_rewards
from shardlm.observe import tracking
from shardlm.training.optim import optimizers
from shardlm.training.schedule import check_schedule

OnMain = Callable[[Callable[[], str]], str]  # Dist.run_on_main: rank 0 does it, every rank gets its result or error
PAIR_REFERENCE = tuple(o for o in OBJECTIVES if o != "sft" and o not in REFERENCE_FREE)  # dpo, ipo


def _here(fn: Callable[[], str]) -> str:
    return fn()


def check_out_dir(path: str) -> Path:
    """`out_dir` as a Path, checked but not created: a command that fails before training leaves nothing
    behind (the folder is made by the first thing a run writes)."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise ShardlmError(f"out_dir '{out}' is a file, not a folder. Choose another out_dir.")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ShardlmError(f"cannot create out_dir '{out}': '{existing}' is a file. Choose another out_dir.")
    if not os.access(existing, os.W_OK):
        raise ShardlmError(f"out_dir '{out}' is not writable ('{existing}' is not). Choose a writable out_dir.")
    return out


def planned(cfg: Config, world_size: int) -> tuple[torch.device, Plan]:
    """The device and parallel plan a run of `world_size` processes would have, checked, with nothing started (a dry
    run; a sweep's trials). A run picks its device by its local rank: here the first one, or under `auto` CUDA
    where there is one."""
    from shardlm.distributed import xla

    explicit = cfg.parallel.device != "auto" or xla.wanted("auto")
    device = pick_device(cfg.parallel.device, 0) if explicit else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, plan(cfg, world_size, world_size, device)


def check_settings(cfg: Config, pl: Plan, device: Any) -> None:
    """The checks that need neither out_dir nor data nor a model: what a sweep checks of each range end and choice."""
    tracking.require(cfg.log)
    lora.check(cfg.lora, device, sharded=pl.use_fsdp)  # QLoRA's refusals come before any data work
    name = optimizers.check_optimizer(cfg)  # a misspelled optimizer or a missing library too
    check_schedule(cfg.train, 0, name)  # its names and ranges; against the run's steps in check_data


def check_setup(cfg: Config, pl: Plan, device: Any, on_main: OnMain = _here) -> tuple[Path, Path | None]:
    """The checks that need no tokenizer, model or data: (out_dir, the checkpoint the run would resume or None)."""
    check_settings(cfg, pl, device)
    out = Path(on_main(lambda: str(check_out_dir(cfg.out_dir))))
    resumed = resume_point(cfg, out, on_main)
    if resumed is not None:
        check_resumed_optimizer(cfg, resumed, on_main)
    return out, resumed


def resume_point(cfg: Config, out: Path, on_main: OnMain = _here) -> Path | None:
    """The checkpoint the run would resume (checkpoint.resume: out_dir's newest complete one, or a path)."""
    def find() -> str:
        path = layout.resume_target(cfg.checkpoint.resume, layout.checkpoints_dir(out), log=lambda _: None)
        return str(path) if path is not None else ""

    found = on_main(find)
    return Path(found) if found else None


def check_resumed_optimizer(cfg: Config, path: Path, on_main: OnMain = _here) -> None:
    """The checkpoint a run resumes holds its optimizer's state: another optimizer cannot load it (DCP would stop on
    the first missing key, with a traceback)."""
    saved = on_main(lambda: layout.read_config(path).train.optimizer if (path / layout.CONFIG).is_file() else "")
    if not saved:
        return
    before, now = optimizers.optimizer_name(saved), optimizers.optimizer_name(cfg.train.optimizer)
    if before != now:
        raise ShardlmError(f"checkpoint '{path}' holds the state of train.optimizer={before}, and this run asks for "
                           f"{now}: resume with train.optimizer={before}, or start a new run from its weights "
                           f"(shardlm export {path} DIR, then model.name=DIR).")


def check_resumed_masks(cfg: Config, path: Path, on_main: OnMain = _here) -> None:
    """An example run resumes with the answer masks it trained with. data.answer_end's default changed (a run saved
    before keeps end_of_turn), so resuming an old chat run from a config of one's own would otherwise train other
    tokens from the next step on (and a DPO run would miss its stored reference, for a reason it could not name)."""
    saved = on_main(lambda: layout.read_config(path).data.answer_end if (path / layout.CONFIG).is_file() else "")
    if saved and saved != cfg.data.answer_end:
        raise ShardlmError(f"checkpoint '{path}' trained its answers with data.answer_end={saved}, and this run asks "
                           f"for data.answer_end={cfg.data.answer_end} (the default is template since the key "
                           f"exists): resume with data.answer_end={saved}, or start a new run from its weights "
                           f"(shardlm export {path} DIR, then model.name=DIR).")


def count_steps(cfg: Config, train: Split, world: int) -> int:
    """train.epochs counts the blocks of all sampled sources of a mixture together (weight 0: left out)."""
    if isinstance(train, PromptRows):
        return _count_rl_steps(cfg, train, world)
    t = cfg.train
    global_batch = world * t.batch_size * t.grad_accum
    blocks = getattr(train, "sampled_blocks", len(train))  # a mixture's weight-0 sources are left out
    if blocks < global_batch:
        raise ShardlmError(
            f"the training data has {counted(train, blocks, cfg.data.seq_len)}, fewer than one global "
            f"batch of {global_batch} (= {world} device{'s' * (world != 1)} x train.batch_size={t.batch_size} x "
            f"train.grad_accum={t.grad_accum}). Use more data or lower train.batch_size"
            f"{' / data.seq_len' if isinstance(train, TokenBlocks) else ''}.")
    if t.max_steps is not None:
        return t.max_steps
    return int(t.epochs * blocks // global_batch)


def check_data(cfg: Config, hf_cfg: Any, train: Split, val: Split, world: int,
               warn: Callable[[str], None] = print) -> int:
    """The checks of the cut blocks against the model and the objective; the run's steps. `hf_cfg` None: a dry
    run whose model could not be loaded (a hub name offline), so packing is not checked."""
    if cfg.train.objective in RL_OBJECTIVES:
        check_prompts(cfg, train, val)
    else:
        if hf_cfg is not None:
            check_packing(hf_cfg, cfg.data.packing and bool(describe(train)))
        check_objective(cfg, train, val)
    if cfg.train.objective == "distill" and cfg.distill.on_policy > 0 and \
            not all(isinstance(part, ExampleRows) for part in getattr(train, "parts", [train])):
        raise ShardlmError(f"distill.on_policy={cfg.distill.on_policy} samples the student's answers to the "
                           "examples' prompts, and data.train was read as text blocks, which have none: give "
                           "examples (prompt/completion or chat records), or set distill.on_policy=0.")
    total = count_steps(cfg, train, world)
    check_schedule(cfg.train, total, optimizers.optimizer_name(cfg.train.optimizer))
    note = long_warmup(cfg, total)
    if note:
        warn(note)
    return total


def _count_rl_steps(cfg: Config, train: PromptRows, world: int) -> int:
    """A step trains on global_batch / grpo.group prompts' completions; a round of them serves
    grpo.num_iterations steps, so an epoch is num_iterations times the rounds the prompts make."""
    t, g = cfg.train, cfg.grpo
    global_batch = world * t.batch_size * t.grad_accum
    per_step = global_batch // g.group
    if len(train) < per_step:
        raise ShardlmError(
            f"the training data has {len(train):,} prompt{'s' * (len(train) != 1)}, fewer than one step's "
            f"{per_step} (a global batch of {global_batch} completions = {world} device{'s' * (world != 1)} x "
            f"train.batch_size={t.batch_size} x train.grad_accum={t.grad_accum}, grpo.group={g.group} per prompt). "
            "Use more prompts or lower train.batch_size / train.grad_accum.")
    if t.max_steps is not None:
        return t.max_steps
    return int(t.epochs * len(train) // per_step) * g.num_iterations


def check_prompts(cfg: Config, train: Split, val: Split) -> list[str]:
    """Online RL samples from prompts: each split is PromptRows whose longest prompt leaves room for a completion
    in data.seq_len, and every reward function loads, takes the data's fields and scores dummy completions of
    the first prompt. The probe's lines (what the rewards returned) for the dry run."""
    for name, split in (("data.train", train), ("data.val", val)):
        if not isinstance(split, PromptRows):
            raise ShardlmError(f"train.objective={cfg.train.objective} samples completions of prompts, but {name} "
                               f"was read as {type(split).__name__}: give records such as "
                               '{"prompt": "...", "answer": "..."} or chat data ({"messages": [...]}).')
        check_prompts_fit(split, cfg)
    assert isinstance(train, PromptRows)
    return probe_rewards(cfg, train)


def probe_rewards(cfg: Config, rows: PromptRows) -> list[str]:
    """Every reward of grpo.rewards called once, as the run calls it, on two completions of the first prompt: its
    `answer` (or 'x') and the empty completion a model may sample. A module that does not import, a signature that
    does not take the call, a field the data lacks, a raise, a wrong count, NaN or a wrong type then stop the run
    before the model is loaded, not at its first step."""
    rewards = load_rewards(cfg.grpo, rows.field_names)
    if not len(rows):
        return []
    p, ids = rows.prompt(0), rows.token_ids(0)
    answer = p.fields.get("answer")
    texts = [answer if isinstance(answer, str) and answer.strip() else "x", ""]
    completion_ids = [ids[:max(1, min(len(ids), cfg.grpo.max_completion_length))], []]  # their lengths only
    fields = {k: [v] * len(texts) for k, v in p.fields.items()}
    lines = []
    for reward in rewards.rewards:
        try:
            values = call(reward, [p.prompt] * len(texts), [completion_for_rewards(t, p) for t in texts],
                          completion_ids, fields)
        except ShardlmError as e:
            raise ShardlmError(f"on dummy completions ({texts[0]!r} and '', which a model can sample) of the first "
                               f"prompt ({rows.where(0)}), called before training: {e}") from None
        lines.append(f"{reward.name}: {', '.join('None' if v is None else f'{float(v):g}' for v in values)}")
    return [f"rewards of the completions {texts[0]!r} and '' of the first prompt: " + "; ".join(lines)]


def long_warmup(cfg: Config, total: int) -> str | None:
    """Under train.schedule=auto a warmup longer than the run is allowed (a named schedule refuses it), but the
    rate then never reaches train.lr: one warning line says where it ends."""
    t = cfg.train
    if t.schedule != "auto" or not 0 < total < t.warmup_steps:
        return None
    return (f"warning: train.warmup_steps={t.warmup_steps} is longer than the run's {total} steps: the learning "
            f"rate ends its warmup at {total / t.warmup_steps:.2g} x train.lr and never reaches it. Set "
            f"train.warmup_steps below {total} to train at train.lr.")


def check_resume(cfg: Config, hf_cfg: Any, train: Split, val: Split, resumed: Path | None,
                 on_main: OnMain = _here) -> None:
    """A resumed preference run trains against the reference it started with: the precomputed values must be
    on disk, whole; a live reference must rebuild the same initial model. Refused here, before anything is written,
    not at the first step (after the run folder's config and event files)."""
    if resumed is not None and isinstance(train, ExampleRows):
        check_resumed_masks(cfg, resumed, on_main)
    if resumed is None or hf_cfg is None or cfg.train.objective not in PAIR_REFERENCE:
        return
    saved = json.loads(on_main(lambda: json.dumps(_resumed_state(resumed))))
    if not saved["step"]:
        return
    run = SimpleNamespace(cfg=cfg, hf_config=hf_cfg)  # what the reference's keys read of a run
    if cfg.preference.reference == "live":  # the initial model's key hashes a base's files: once, on rank 0
        if on_main(lambda: "changed" if saved["reference_key"] not in (None, initial_key(run)) else ""):
            raise live_reference_changed(cfg)
        return
    problem = on_main(lambda: _stored_reference(cfg, reference_key(run), train, val))
    if problem:
        name, found = problem.split("\t")
        raise damaged_reference(name) if found == "damaged" else missing_reference(name, found == "found")


def _resumed_state(path: Path) -> dict[str, Any]:
    state_file = path / layout.TRAINER_STATE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return {"step": layout.read_manifest(path).get("step", 0), "reference_key": state.get("reference_key")}


def _stored_reference(cfg: Config, key: str, train: Split, val: Split) -> str:
    """'' if each example set's stored reference is there with every pair scored, else 'NAME\tfound|missing'. The
    folder is named from the cache root, so a dry run's examples (rendered in memory) point at the run's cache."""
    for splits in _example_sets([pair_rows(train, "training"), pair_rows(val, "validation")]):
        folder = splits[0].examples.meta.get("folder")
        if not folder:
            continue
        path = cache_root(cfg.data.cache_dir) / Path(folder).name / f"reference-{key}.npy"
        if not path.is_file():
            return f"{path.name}\tmissing"
        if (damaged := reference_problem(path)) is not None:  # truncated or changed: named, not numpy's traceback
            return f"{damaged}\tdamaged"
        if unscored(np.load(path, mmap_mode="r"), splits, True):
            return f"{path.name}\tfound"
    return ""


def _example_sets(splits: list[ExampleRows]) -> list[list[ExampleRows]]:
    """The splits grouped by the example set they cut (a held-out tail shares the training pairs' set and file)."""
    groups: list[list[ExampleRows]] = []
    for rows in splits:
        group = next((g for g in groups if g[0].examples is rows.examples), None)
        if group is None:
            groups.append([rows])
        elif rows is not group[0]:
            group.append(rows)
    return groups
