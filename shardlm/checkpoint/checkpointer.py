"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `OUT/checkpoints/step_000123/` that appears whole: every rank writes its shard
of model + optimizer into `step_000123.tmp/`, rank 0 adds the trainer state, the config, the tokenizer
and finally `manifest.json`, then renames the folder and moves `latest`. "Complete" means: manifest
present, DCP metadata readable, every shard file it names present. Nothing here unpickles anything but
DCP's own metadata; extra state is JSON.

What is saved is a dict of stateful parts (`stateful_parts`: model, optimizer, schedule, the trainer's
`train_state`, RNG), each with `state_dict()` / `load_state_dict()` as in torchtitan: the Checkpointer knows
where each part goes on disk, not what it is, so it never reads or writes Trainer fields.

A LoRA run (`lora.r > 0`) saves only what changes: the adapter weights (not the frozen base), their optimizer
state, the schedule, the data position and the RNG; the manifest records the base's identity
(`shardlm.models.lora.base_identity`) and a resume or load onto another base is refused.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardlm import ShardlmError, __version__
from shardlm.config import save_config
from shardlm.distributed import xla
from shardlm.models import lora
from shardlm.training.schedule import WarmupCosine

if TYPE_CHECKING:
    from shardlm.training.build import Run

# One process without a process group saves and loads through the same DCP path; DCP warns about it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # torch 2.9's DCP writer

ARCH_KEYS = ("model_type", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "num_hidden_layers",
             "hidden_size", "num_attention_heads", "max_position_embeddings")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def is_complete(path: Path) -> str | None:
    """None if `path` is a complete checkpoint, else why not (one line)."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "no manifest.json (the write did not finish)"
    try:
        json.loads(manifest.read_text())
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read means torn
        return f"unreadable metadata ({type(e).__name__})"
    for item in metadata.storage_data.values():
        shard = path / item.relative_path
        if not shard.is_file() or shard.stat().st_size < item.offset + item.length:
            return f"shard file {item.relative_path} is missing or truncated"
    return None


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders under `root` (a run dir or its checkpoints/ folder), newest first."""
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def newest_complete(root: Path, log=print) -> Path | None:
    for path in list_checkpoints(root):
        problem = is_complete(path)
        if problem is None:
            return path
        log(f"warning: skipping checkpoint {path.name}: {problem}")
    return None


def resolve_checkpoint(path: str | Path, log=print) -> Path:
    """A checkpoint folder, or a run dir's newest complete one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlmError(f"checkpoint path '{path}' does not exist. Give a run dir (its newest checkpoint is used) "
                           "or a checkpoint folder RUN/checkpoints/step_N; to train, checkpoint.resume=auto resumes "
                           "out_dir's own and checkpoint.resume=none starts fresh.")
    if (path / "manifest.json").is_file() or path.name.startswith("step_"):
        problem = is_complete(path)
        if problem:
            raise ShardlmError(f"checkpoint '{path}' is incomplete: {problem}. Use an earlier one or the run dir.")
        return path
    found = newest_complete(path, log)
    if found is None:
        what = "every checkpoint in it is incomplete" if list_checkpoints(path) else "it has none"
        raise ShardlmError(f"no complete checkpoint in '{path}' ({what}): give a run dir that has saved one (a run "
                           "saves at its end and every checkpoint.every steps) or a checkpoint folder "
                           "RUN/checkpoints/step_N; to train from the start, use checkpoint.resume=none.")
    return found


def arch_of(hf_config) -> dict:
    d = hf_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


# Wrappers that add a level to parameter names but not to state-dict keys (activation checkpointing, compile).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def state_key(name: str) -> str:
    """A parameter or module name as state dicts spell it: without the wrappers' levels."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_keys(model: torch.nn.Module) -> dict[str, str]:
    """State-dict key of each tied parameter's other names -> the key it is stored under (GPT-2's
    `hf.lm_head.weight` -> `hf.transformer.wte.weight`): one tensor, stored once."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = state_key(name)
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


class ModelState:
    """The model's weights as DCP-sharded tensors; of a LoRA run (`adapters_only`) the adapter weights alone.

    A tied tensor (the input embedding that is also the head) is saved once; loading gives it to every name
    that shares it, so the tie holds. Checkpoints written with both names still load (DCP reads the keys asked
    for and ignores the rest)."""

    def __init__(self, model: torch.nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only
        self.tied = tied_keys(model)

    def state_dict(self) -> dict[str, Any]:
        weights = get_model_state_dict(self.model)
        if self.adapters_only:
            return lora.adapter_state(weights)
        return {k: v for k, v in weights.items() if k not in self.tied or self.tied[k] not in weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {**{alias: state[key] for alias, key in self.tied.items() if key in state}, **state}
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.adapters_only))


class OptimizerState:
    """The optimizer's state, keyed by parameter name and sharded like the parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class RngState:
    """Python, NumPy, torch (and CUDA or XLA) generators of this rank, as JSON."""

    def __init__(self, xla_device: bool = False):
        self.xla = xla_device

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        np_state["state"] = {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"python": [version, list(internal), gauss], "numpy": np_state,
                                 "torch": torch.get_rng_state().tolist()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state().tolist()
        if self.xla:
            state["xla"] = xla.rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np_state = state["numpy"]
        np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
        np.random.set_state(np_state)
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
        if "xla" in state and self.xla:
            xla.set_rng_state(state["xla"])


# Where each part of a checkpoint goes: tensors into DCP's shards; per-rank parts into PART_rankNNNNN.json;
# the rest into rank 0's trainer_state.json (train_state's keys at the top, every other part under its name).
SHARDED, PER_RANK = ("model", "optim"), ("rng",)


def model_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                adapters_only: bool = False) -> dict[str, Stateful]:
    """The sharded parts: what `dcp.save` writes (benchmarks/checkpoint_io.py measures exactly this)."""
    return {"model": ModelState(model, adapters_only), "optim": OptimizerState(model, optimizer)}


def stateful_parts(run: Run, train_state: Stateful) -> dict[str, Stateful]:
    """Everything a resume restores: model, optimizer, schedule, the trainer's own state and the RNG."""
    return {**model_parts(run.model, run.optimizer, lora.enabled(run.cfg)), "scheduler": run.scheduler,
            "train_state": train_state, "rng": RngState(run.dist.device.type == "xla")}


class Checkpointer:
    """Saves and restores `parts` (name -> object with state_dict/load_state_dict), plus what makes a
    checkpoint readable on its own (config, HF config, tokenizer, manifest), from the Run. It never sees the
    Trainer: the trainer is one part among others (`train_state`). `on_saved(step, path)` runs on every rank
    once a checkpoint is complete."""

    def __init__(self, run: Run, parts: dict[str, Stateful], on_saved: Callable[[int, Path], None] | None = None):
        self.run, self.cfg, self.dist = run, run.cfg.checkpoint, run.dist
        self.parts, self.on_saved = parts, on_saved
        self.root = run.out_dir / "checkpoints"
        self.pending: tuple[Any, Path, Path, int, float] | None = None  # (future, tmp, final, step, began)
        self.signal_received = False
        self._flag: tuple[torch.Tensor, torch.Tensor] | None = None  # (device, pinned host) on CUDA
        self.lora = lora.enabled(run.cfg)
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

        On CUDA the agreement costs no host-device sync: each step all-reduces the flag into a pinned host
        tensor without waiting, and reads the previous step's result, which the step's own grad-norm sync
        has already completed. Ranks therefore stop one step after the signal, all at the same step.
        """
        if not self.dist.distributed:
            return self.signal_received
        if self.dist.device.type != "cuda":
            flag = torch.tensor([1.0 if self.signal_received else 0.0])
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            return bool(flag.item())
        if self._flag is None:
            self._flag = (torch.zeros(1, device=self.dist.device), torch.zeros(1).pin_memory())
        on_device, on_host = self._flag
        stop = bool(on_host.item())
        on_device.fill_(1.0 if self.signal_received else 0.0)
        torch.distributed.all_reduce(on_device, op=torch.distributed.ReduceOp.MAX)
        on_host.copy_(on_device, non_blocking=True)
        return stop

    # ---- save ----------------------------------------------------------------------------------------
    def _sharded(self) -> dict[str, Any]:
        state = {name: self.parts[name].state_dict() for name in SHARDED if name in self.parts}
        return xla.host_copy(state) if self.dist.device.type == "xla" else state

    def base_identity(self, known: dict | None = None) -> dict:
        """Computed once per run; `known` (a resumed checkpoint's record) spares re-reading unchanged files."""
        if self._base is None:
            assert self.run.cfg.model.name is not None  # config validation: LoRA adapts a named base
            self._base = lora.base_identity(self.run.cfg.model.name, known)
        return self._base

    def save(self, step: int) -> Path:
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
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        save_config(self.run.cfg, tmp / "config.yaml")
        (tmp / "hf_config.json").write_text(self.run.hf_config.to_json_string())
        self.run.tokenizer.save_pretrained(str(tmp / "tokenizer"))

    def write_manifest(self, tmp: Path, step: int, began: float) -> None:
        """Rank 0, once every shard is on disk: the manifest makes the folder a complete checkpoint (after
        the rename). tests/faults.py stops a run here to leave a torn checkpoint behind."""
        manifest = {"step": step, "world_size": self.dist.world_size, "shardlm_version": __version__,
                    "arch": arch_of(self.run.hf_config), "saved_at": time.time(),
                    "save_seconds": time.perf_counter() - began, "lora": lora.describe(self.run.cfg)}
        if self.lora:
            manifest["base"] = self.base_identity()
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))

    def _publish(self, tmp: Path, final: Path, step: int, began: float) -> None:
        self.dist.barrier()  # every rank's shard is on disk
        if self.dist.is_main:
            self.write_manifest(tmp, step, began)
            os.replace(tmp, final)
            latest = self.root / "latest"
            latest_tmp = self.root / "latest.tmp"
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
        manifest = check_resumable(path, self.run.cfg, self.run.hf_config,
                                   lambda known: self.base_identity(known) if self.lora else None)
        configured = hyperparameters(self.run.optimizer)
        planned = {id(f): copy.copy(f) for f in self.run.scheduler.lr_lambdas if isinstance(f, WarmupCosine)}
        sharded = self._sharded()
        dcp.load(sharded, checkpoint_id=str(path))
        for name, state in sharded.items():
            self.parts[name].load_state_dict(state)
        if self.dist.device.type == "xla":
            xla.shard_parameters(self.run.model, self.run.optimizer)
        saved = json.loads((path / "trainer_state.json").read_text())
        for name, part in self.parts.items():
            if name in PER_RANK:
                files = sorted(path.glob(f"{name}_rank*.json"))  # another world size: ranks reuse them in turn
                part.load_state_dict(json.loads(files[self.dist.rank % len(files)].read_text()))
            elif name not in SHARDED:
                part.load_state_dict(saved if name == "train_state" else saved[name])
        self.dist.print(f"resumed from {path} (step {manifest['step']}, saved on {manifest['world_size']} rank(s))")
        for schedule in {id(f): f for f in self.run.scheduler.lr_lambdas}.values():
            if isinstance(schedule, WarmupCosine) and (moved := schedule.configure(planned[id(schedule)],
                                                                                   manifest["step"])):
                self.dist.print(f"note: {moved}")
        apply_hyperparameters(self.run.optimizer, self.run.scheduler, configured)


def resume_target(spec: str, root: Path, log=print) -> Path | None:
    """The checkpoint `checkpoint.resume` names: none, the newest complete one under `root` (auto), or a path."""
    if spec == "none":
        return None
    return newest_complete(root, log) if spec == "auto" else resolve_checkpoint(spec, log)


def check_resumable(path: Path, cfg, hf_config, base_of: Callable[[dict | None], dict | None]) -> dict:
    """The checks before loading `path` into this config (the run's and `train --dry-run`'s); its manifest.
    `base_of(recorded identity)`: the LoRA base's identity now (None for full fine-tuning)."""
    manifest = json.loads((path / "manifest.json").read_text())
    check_lora(manifest, cfg, path, base_of(manifest.get("base")))
    check_compatible(manifest, hf_config, path)
    return manifest


HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas", "eps")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, configured: list[dict[str, Any]]) -> None:
    """A resume restores the moments and the step, but the learning rate, weight decay and betas are this run's
    config: loading the optimizer and LambdaLR states put back the saved ones (a changed train.lr was reported
    and ignored). The schedule's factor at the restored step is the config's own."""
    for group, values in zip(optimizer.param_groups, configured, strict=True):
        group.update(values)
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def check_compatible(manifest: dict, hf_config, path: Path) -> None:
    saved_major = str(manifest.get("shardlm_version", "0")).split(".")[0]
    if saved_major != __version__.split(".")[0]:
        raise ShardlmError(f"checkpoint {path} was written by shardlm {manifest.get('shardlm_version')}, "
                           f"this is {__version__}: major versions differ.")
    now = arch_of(hf_config)
    diffs = [f"{k}: checkpoint {v} vs config {now.get(k)}" for k, v in manifest["arch"].items() if now.get(k) != v]
    if diffs:
        raise ShardlmError(f"checkpoint {path} holds a different model ({'; '.join(diffs)}). Resume with the "
                           "checkpoint's architecture, or set checkpoint.resume=none / a new out_dir.")


def _spelled(targets: list[str] | None) -> str:
    return "null (every linear layer of the blocks)" if targets is None else str(targets)


def check_lora(manifest: dict, cfg, path: Path, base: dict | None) -> None:
    """A LoRA checkpoint resumes only as LoRA (same rank) on the same base; a full one only as full."""
    saved = manifest.get("lora")
    if saved and not lora.enabled(cfg):
        raise ShardlmError(f"checkpoint {path} holds a LoRA adapter (lora.r={saved['r']}), but this run has lora.r=0 "
                           f"(full fine-tuning). Set lora.r={saved['r']} to resume it, or use a new out_dir or "
                           "checkpoint.resume=none.")
    if not saved and lora.enabled(cfg):
        raise ShardlmError(f"checkpoint {path} holds a full fine-tuning run, but this run has lora.r={cfg.lora.r}. "
                           "Set lora.r=0 to resume it, or use a new out_dir or checkpoint.resume=none.")
    if saved:
        lora.check_base(manifest.get("base") or {}, base or {}, path)
        if saved["r"] != cfg.lora.r:
            raise ShardlmError(f"checkpoint {path} holds a LoRA adapter of rank {saved['r']}, this run has lora.r="
                               f"{cfg.lora.r}. Set lora.r={saved['r']} to resume it, or use a new out_dir or "
                               "checkpoint.resume=none.")
        if saved.get("alpha", cfg.lora.alpha) != cfg.lora.alpha:  # the adapter's scale alpha / r
            raise ShardlmError(f"checkpoint {path} holds a LoRA adapter trained with lora.alpha={saved['alpha']}, this "
                               f"run has lora.alpha={cfg.lora.alpha}: it would rescale what was learned. Set "
                               f"lora.alpha={saved['alpha']} to resume it, or use a new out_dir or "
                               "checkpoint.resume=none.")
        if saved.get("target_modules") != cfg.lora.target_modules:
            raise ShardlmError(f"checkpoint {path} holds adapters on lora.target_modules="
                               f"{_spelled(saved.get('target_modules'))}, this run has "
                               f"{_spelled(cfg.lora.target_modules)}. Set "
                               "lora.target_modules to the checkpoint's to resume it, or use a new out_dir or "
                               "checkpoint.resume=none.")
