"""The checks a run makes before it builds its model or writes a file, as one list: `build()` runs it on the real
run, `shardlm train --dry-run` (shardlm.preflight.dryrun) on counted data and a model on `meta`, so what one
refuses the other refuses with the same message. In the run's order:

- `check_setup`, before the tokenizer: `check_settings` (the trackers' libraries, QLoRA's device and plan, the
  optimizer's name, arguments and library, the schedule's names: what `shardlm sweep` checks of each value it will
  try), out_dir, and the optimizer of the checkpoint the run would resume;
- `check_data`, once the data is read: what the objective reads (its `check_data`: pairs for dpo/ipo/simpo/orpo,
  none for sft, prompts for online RL), one global batch (its `count_steps`), the schedule against the run's steps;
- `check_resume`, where a checkpoint would be resumed: the answer masks, and what the objective must find again
  (its `check_resume`: a preference run's reference, a distillation run's teacher).

The model's config (shardlm.models.hf_config `model_config`), the checkpoint against the config (`check_resumable`,
at load, before anything is written) and train.gen_every's needs (shardlm.inference.genquality
`check_generation`, a layer above this one) are shared the same way: one function each, called by both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.checkpoint import layout
from shardlm.config import Config, objectives
from shardlm.data import ExampleRows, Split
from shardlm.distributed.parallelize import Plan, plan
from shardlm.distributed.process_group import pick_device
from shardlm.models import lora
from shardlm.objectives import objective_family
from shardlm.observe import tracking
from shardlm.training.optim import optimizers
from shardlm.training.schedule import check_schedule

OnMain = Callable[[Callable[[], str]], str]  # Dist.run_on_main: rank 0 does it, every rank gets its result or error


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
    if pl.tensor > 1 and name not in ("adamw", "sgd"):  # the others keep row statistics of FSDP2's row shards
        raise ShardlmError(f"parallel.tensor={pl.tensor} with train.optimizer={cfg.train.optimizer}: its statistics "
                           "assume FSDP2's row shards alone, and tensor parallelism splits columns too; use "
                           "train.optimizer=adamw (or sgd), or parallel.tensor=1.")
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


def check_same_objective(cfg: Config, path: Path, on_main: OnMain = _here) -> None:
    """A resume trains on with what the run optimizes: another objective, reward, group size, teacher setting or
    preference beta would silently make the rest of the run another experiment. Refused unless the user says so
    (checkpoint.allow_changes=true); the learning rate, steps, data, logging and the like change freely."""
    saved = on_main(lambda: json.dumps(objectives.changes(layout.read_config(path), cfg))
                    if (path / layout.CONFIG).is_file() else "[]")
    if changed := json.loads(saved):
        raise ShardlmError(f"checkpoint '{path}' was trained with other objective settings ({'; '.join(changed)}): "
                           "resuming would change what the run optimizes. Resume with the run's own settings, add "
                           "checkpoint.allow_changes=true to change them from here on, or start a new out_dir.")


def count_steps(cfg: Config, train: Split, world: int) -> int:
    """The run's steps on this data: train.epochs over its blocks (or online RL's prompts), or train.max_steps."""
    return objective_family(cfg.train.objective).count_steps(cfg, train, world)


def check_data(cfg: Config, hf_cfg: Any, train: Split, val: Split, world: int,
               warn: Callable[[str], None] = print) -> int:
    """The checks of the cut blocks against the model and the objective; the run's steps. `hf_cfg` None: a dry
    run whose model could not be loaded (a hub name offline), so packing is not checked."""
    objective_family(cfg.train.objective).check_data(cfg, hf_cfg, train, val)  # the record kinds it trains on
    total = count_steps(cfg, train, world)
    check_schedule(cfg.train, total, optimizers.optimizer_name(cfg.train.optimizer))
    note = long_warmup(cfg, total)
    if note:
        warn(note)
    return total


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
    """What a resumed run must find again that its checkpoint does not hold: the answer masks it trained with, and
    what its objective needs (a preference run's reference, a distillation run's teacher). Refused here, before
    anything is written, not at the first step (after the run folder's config and event files)."""
    if resumed is not None and isinstance(train, ExampleRows):
        check_resumed_masks(cfg, resumed, on_main)
    if resumed is not None and not cfg.checkpoint.allow_changes:
        check_same_objective(cfg, resumed, on_main)
    objective_family(cfg.train.objective).check_resume(cfg, hf_cfg, train, val, resumed, on_main)
