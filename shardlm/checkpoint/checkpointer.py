"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `OUT/checkpoints/step_000000123/` that appears whole: every rank writes its shard
of model + optimizer into `step_000000123.tmp/`, rank 0 adds the trainer state, the config, the tokenizer
and finally `manifest.json`, then renames the folder and moves `latest`. "Complete" means: manifest
present, DCP metadata readable, every shard file it names present. Nothing here unpickles anything but
DCP's own metadata; extra state is JSON.

What is saved is a dict of stateful parts (`stateful_parts`: model, optimizer, schedule, the trainer's
`train_state`, RNG), each with `state_dict()` / `load_state_dict()` as in torchtitan: the Checkpointer knows
where each part goes on disk, not what it is, so it never reads or writes Trainer fields.

A LoRA run (`lora.r > 0`) saves only what changes: the adapter weights (not the frozen base), their optimizer
state, the schedule, the data position and the RNG; the manifest records the base's identity
(`shardlm.checkpoint.provenance.base_identity`) and a resume or load onto another base is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from shardlm import ShardlmError, __version__
from shardlm.checkpoint import layout
from shardlm.checkpoint.layout import is_complete, list_checkpoints, resume_target, step_dir
from shardlm.checkpoint.provenance import arch_of, base_identity, check_resumable
from shardlm.config import Config, save_config
from shardlm.distributed import xla
from shardlm.distributed.process_group import Dist
from shardlm.models import lora

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase



# Where each part of a checkpoint goes: tensors into DCP's shards; per-rank parts into PART_rankNNNNN.json;
# the rest into rank 0's trainer_state.json (train_state's keys at the top, every other part under its name).
SHARDED, PER_RANK = ("model", "optim"), ("rng",)


class Checkpointer:
    """Saves and restores `parts` (name -> object with state_dict/load_state_dict) under `root`, plus what makes
    a checkpoint readable on its own: the run's config, HF config and tokenizer, and the manifest. Like
    torchtitan's CheckpointManager it is given its dependencies, never the Trainer or the Run: the trainer is
    one part among others (`train_state`). `on_saved(step, path)` runs on every rank once a checkpoint is
    complete."""

    def __init__(self, run_config: Config, dist: Dist, root: Path, parts: dict[str, Stateful], *,
                 hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 on_saved: Callable[[int, Path], None] | None = None,
                 before_save: Callable[[], None] | None = None):
        """`before_save` brings the parts up to date first (the trainer's step reads its norm a step late)."""
        self.run_config, self.cfg, self.dist = run_config, run_config.checkpoint, dist
        self.parts, self.on_saved, self.before_save = parts, on_saved, before_save
        self.hf_config, self.tokenizer = hf_config, tokenizer
        self.root = root
        self.pending: tuple[Any, Path, Path, int, float] | None = None  # (future, tmp, final, step, began)
        self.signal_received = False
        self._flag: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None  # (device, pinned host, copied)
        self.lora = lora.enabled(run_config.lora)
        self._base: dict | None = None  # the LoRA base's identity, computed once
        # An async save's collectives run in DCP's background thread: on the training group they would interleave
        # with the step's all-reduces (ranks hung for the timeout). Its own gloo group, made on every rank here.
        self._save_group = torch.distributed.new_group(backend="gloo") \
            if self.cfg.async_save and self.dist.distributed else None
        if self.dist.is_main:  # the folder itself is made by the first save
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)

    # ---- when ----------------------------------------------------------------------------------------
    def due(self, step: int, total: int) -> bool:
        return (self.cfg.every > 0 and step % self.cfg.every == 0) or (step == total and self.cfg.save_final)

    @contextlib.contextmanager
    def catch_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT finish the step, save and stop, while the run lasts; the previous handlers (e.g. a
        notebook's KeyboardInterrupt) come back after it."""
        def handler(signum, _frame):
            self.signal_received = True
            self.dist.print(f"received {signal.Signals(signum).name}: finishing this step, saving, exiting")

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def should_stop(self) -> bool:
        """Did any rank get SIGTERM/SIGINT? All ranks must agree on the step they stop at.

        On CUDA the agreement costs no wait on the current step: each step all-reduces the flag into a pinned
        host tensor without waiting, and reads the previous step's result, waiting for that copy alone (an
        event; by then the GPU is on this step). Ranks therefore stop one step after the signal, all at the
        same step.
        """
        if not self.dist.distributed:
            return self.signal_received
        if self.dist.device.type != "cuda":
            flag = torch.tensor([1.0 if self.signal_received else 0.0])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return bool(flag.item())
        if self._flag is None:
            self._flag = (torch.zeros(1, device=self.dist.device), torch.zeros(1).pin_memory(), torch.cuda.Event())
            self._flag[2].record()
        on_device, on_host, copied = self._flag
        copied.synchronize()
        stop = bool(on_host.item())
        on_device.fill_(1.0 if self.signal_received else 0.0)
        torch.distributed.all_reduce(on_device, op=torch.distributed.ReduceOp.MAX)
        on_host.copy_(on_device, non_blocking=True)
        copied.record()
        return stop

    # ---- save ----------------------------------------------------------------------------------------
    def _sharded(self) -> dict[str, Any]:
        state = {name: self.parts[name].state_dict() for name in SHARDED if name in self.parts}
        return xla.host_copy(state) if self.dist.device.type == "xla" else state

    def base_identity(self, known: dict | None = None) -> dict:
        """Computed once per run; `known` (a resumed checkpoint's record) spares re-reading unchanged files."""
        if self._base is None:
            assert self.run_config.model.name is not None  # config validation: LoRA adapts a named base
            self._base = base_identity(self.run_config.model.name, known)
        return self._base

    def save(self, step: int) -> Path:
        if self.before_save is not None:
            self.before_save()
        self.finish_pending()
        final = step_dir(self.root, step)
        if final.exists() and is_complete(final) is None:
            return final  # this step is already saved (e.g. final save right after a periodic one)
        tmp = final.with_name(final.name + ".tmp")
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.dist.barrier()
        began = time.perf_counter()
        try:
            self._write_host_parts(tmp)
            if self.cfg.async_save and self.dist.device.type != "xla":  # XLA: host copies are made already
                future = dcp.async_save(self._sharded(), checkpoint_id=str(tmp), process_group=self._save_group)
                self.pending = (future, tmp, final, step, began)
                return final
            dcp.save(self._sharded(), checkpoint_id=str(tmp))
        except OSError as e:
            raise ShardlmError(f"saving checkpoint step {step} failed: {e.strerror or e}. Earlier "
                               f"checkpoints in {self.root} are intact; free disk space and resume.") from None
        self._publish(tmp, final, step, began)
        return final

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, step, began = self.pending
        self.pending = None
        future.result()
        self._publish(tmp, final, step, began)

    def _write_host_parts(self, tmp: Path) -> None:
        """The JSON parts (see SHARDED, PER_RANK), then what makes the folder readable on its own."""
        for name in PER_RANK:
            (tmp / f"{name}_rank{self.dist.rank:05d}.json").write_text(json.dumps(self.parts[name].state_dict()))
        if not self.dist.is_main:
            return
        host = {name: part.state_dict() for name, part in self.parts.items() if name not in SHARDED + PER_RANK}
        state = {**host.pop("train_state", {}), **host, "world_size": self.dist.world_size}
        (tmp / layout.TRAINER_STATE).write_text(json.dumps(state))
        save_config(self.run_config, tmp / layout.CONFIG)
        (tmp / layout.HF_CONFIG).write_text(self.hf_config.to_json_string())
        self.tokenizer.save_pretrained(str(tmp / layout.TOKENIZER))

    def write_manifest(self, tmp: Path, step: int, began: float) -> None:
        """Rank 0, once every shard is on disk: the manifest makes the folder a complete checkpoint (after
        the rename). tests/faults.py stops a run here to leave a torn checkpoint behind."""
        manifest = {"step": step, "world_size": self.dist.world_size, "shardlm_version": __version__,
                    "arch": arch_of(self.hf_config), "saved_at": time.time(),
                    "save_seconds": time.perf_counter() - began, "lora": lora.describe(self.run_config.lora)}
        if self.lora:
            manifest["base"] = self.base_identity()
        (tmp / layout.MANIFEST).write_text(json.dumps(manifest, indent=1))

    def _publish(self, tmp: Path, final: Path, step: int, began: float) -> None:
        self.dist.barrier()  # every rank's shard is on disk
        if self.dist.is_main:
            self.write_manifest(tmp, step, began)
            os.replace(tmp, final)
            latest = self.root / layout.LATEST
            latest_tmp = self.root / (layout.LATEST + ".tmp")
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, latest)
            self._retain(final)
        self.dist.barrier()
        if self.on_saved is not None:
            self.on_saved(step, final)

    def _retain(self, newest: Path) -> None:
        complete = [p for p in list_checkpoints(self.root) if is_complete(p) is None]
        for old in complete[self.cfg.keep:]:
            if old != newest and len(complete) > 1:
                shutil.rmtree(old, ignore_errors=True)

    # ---- resume --------------------------------------------------------------------------------------
    def maybe_resume(self) -> Path | None:
        path = self.dist.run_on_main(lambda: str(p) if (p := resume_target(self.cfg.resume, self.root,
                                                                          self.dist.print)) else None)
        if path is None:
            return None
        self.load(Path(path))
        return Path(path)

    def load(self, path: Path) -> None:
        manifest = check_resumable(path, self.run_config, self.hf_config,
                                   lambda known: self.base_identity(known) if self.lora else None)
        sharded = self._sharded()
        dcp.load(sharded, checkpoint_id=str(path))
        for name, state in sharded.items():
            self.parts[name].load_state_dict(state)
        saved = json.loads((path / layout.TRAINER_STATE).read_text())
        self.dist.print(f"resumed from {path} (step {manifest['step']}, saved on {manifest['world_size']} rank(s))")
        for name, part in self.parts.items():
            if name in PER_RANK:
                files = sorted(path.glob(f"{name}_rank*.json"))  # another world size: ranks reuse them in turn
                part.load_state_dict(json.loads(files[self.dist.rank % len(files)].read_text()))
            elif name not in SHARDED:
                part.load_state_dict(saved if name == "train_state" else saved[name])
