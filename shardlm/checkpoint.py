"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `OUT/checkpoints/step_000123/` that appears whole: every rank writes its shard
of model + optimizer into `step_000123.tmp/`, rank 0 adds the trainer state, the config, the tokenizer
and finally `manifest.json`, then renames the folder and moves `latest`. "Complete" means: manifest
present, DCP metadata readable, every shard file it names present. Nothing here unpickles anything but
DCP's own metadata; extra state is JSON.

A LoRA run (`lora.r > 0`) saves only what changes: the adapter weights (not the frozen base), their optimizer
state, the schedule, the data position and the RNG; the manifest records the base's identity
(`shardlm.lora.base_identity`) and a resume or load onto another base is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

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

from shardlm import ShardlmError, __version__, lora
from shardlm.config import save_config

# One process without a process group saves and loads through the same DCP path; DCP warns about it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

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
        raise ShardlmError(f"checkpoint path '{path}' does not exist.")
    if (path / "manifest.json").is_file() or path.name.startswith("step_"):
        problem = is_complete(path)
        if problem:
            raise ShardlmError(f"checkpoint '{path}' is incomplete: {problem}. Use an earlier one or the run dir.")
        return path
    found = newest_complete(path, log)
    if found is None:
        raise ShardlmError(f"no complete checkpoint in '{path}'.")
    return found


def _rng_state() -> dict:
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}
    state = {"python": _jsonable(random.getstate()), "numpy": np_state,
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _jsonable(obj):
    return [_jsonable(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def arch_of(hf_config) -> dict:
    d = hf_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


class Checkpointer:
    def __init__(self, run):
        self.run, self.cfg, self.dist = run, run.cfg.checkpoint, run.dist
        self.root = run.out_dir / "checkpoints"
        self.pending: tuple | None = None  # (future, tmp, final) of an async save
        self.signal_received = False
        self._flag: tuple[torch.Tensor, torch.Tensor] | None = None  # (device, pinned host) on CUDA
        self.lora = lora.enabled(run.cfg)
        self._base: dict | None = None  # the LoRA base's identity, computed once
        if self.dist.is_main:  # the folder itself is made by the first save
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        self._install_signal_handlers()

    # ---- when ----------------------------------------------------------------------------------------
    def due(self, step: int, total: int) -> bool:
        return (self.cfg.every > 0 and step % self.cfg.every == 0) or (step == total and self.cfg.save_final)

    def _install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self.signal_received = True
            self.dist.print(f"received {signal.Signals(signum).name}: finishing this step, saving, exiting")

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

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
    def _state(self, trainer) -> dict:
        """Model + optimizer state (DCP-sharded); of a LoRA run the adapter weights only."""
        model, opt = trainer.model, trainer.run.optimizer
        weights = get_model_state_dict(model)
        if self.lora:
            weights = lora.adapter_state(weights)
        return {"model": weights, "optim": get_optimizer_state_dict(model, opt)}

    def base_identity(self) -> dict:
        if self._base is None:
            self._base = lora.base_identity(self.run.cfg.model.name)
        return self._base

    def save(self, trainer) -> Path:
        self.finish_pending()
        final = step_dir(self.root, trainer.step)
        if final.exists() and is_complete(final) is None:
            return final  # this step is already saved (e.g. final save right after a periodic one)
        tmp = final.with_name(final.name + ".tmp")
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.dist.barrier()
        began = time.perf_counter()
        try:
            self._write_extras(trainer, tmp)
            if self.cfg.async_save:
                future = dcp.async_save(self._state(trainer), checkpoint_id=str(tmp))
                self.pending = (future, tmp, final, trainer.step, began)
                return final
            dcp.save(self._state(trainer), checkpoint_id=str(tmp))
        except OSError as e:
            raise ShardlmError(f"saving checkpoint step {trainer.step} failed: {e.strerror or e}. Earlier "
                               f"checkpoints in {self.root} are intact; free disk space and resume.") from None
        self._publish(tmp, final, trainer.step, began)
        return final

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        future, tmp, final, step, began = self.pending
        self.pending = None
        future.result()
        self._publish(tmp, final, step, began)

    def _write_extras(self, trainer, tmp: Path) -> None:
        run = trainer.run
        (tmp / f"rng_rank{self.dist.rank:05d}.json").write_text(json.dumps(_rng_state()))
        if not self.dist.is_main:
            return
        state = {"step": trainer.step, "position": trainer.position, "global_batch": trainer.global_batch,
                 "seq_len": trainer.seq_len, "bad_steps": trainer.bad_steps, "skipped_steps": trainer.skipped_steps,
                 "scheduler": run.scheduler.state_dict(), "world_size": self.dist.world_size}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        save_config(run.cfg, tmp / "config.yaml")
        (tmp / "hf_config.json").write_text(run.hf_config.to_json_string())
        run.tokenizer.save_pretrained(str(tmp / "tokenizer"))

    def _publish(self, tmp: Path, final: Path, step: int, began: float) -> None:
        self.dist.barrier()  # every rank's shard is on disk
        if self.dist.is_main:
            _test_pause_hook(step, self.run.out_dir)
            manifest = {"step": step, "world_size": self.dist.world_size, "shardlm_version": __version__,
                        "arch": arch_of(self.run.hf_config), "saved_at": time.time(),
                        "save_seconds": time.perf_counter() - began, "lora": lora.describe(self.run.cfg)}
            if self.lora:
                manifest["base"] = self.base_identity()
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, final)
            latest = self.root / "latest"
            latest_tmp = self.root / "latest.tmp"
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, latest)
            self._retain(final)
        self.dist.barrier()
        if os.environ.get("SHARDLM_TEST_KILL_AFTER_SAVE") == str(step):  # test hook: kill -9 right after
            os.kill(os.getpid(), signal.SIGKILL)

    def _retain(self, newest: Path) -> None:
        complete = [p for p in list_checkpoints(self.root) if is_complete(p) is None]
        for old in complete[self.cfg.keep:]:
            if old != newest and len(complete) > 1:
                shutil.rmtree(old, ignore_errors=True)

    # ---- resume --------------------------------------------------------------------------------------
    def maybe_resume(self, trainer) -> Path | None:
        spec = self.cfg.resume
        if spec == "none":
            return None
        if spec == "auto":
            path = self.dist.run_on_main(lambda: str(p) if (p := newest_complete(self.root, self.dist.print)) else None)
            if path is None:
                return None
        else:
            path = self.dist.run_on_main(lambda: str(resolve_checkpoint(spec, self.dist.print)))
        self.load(trainer, Path(path))
        return Path(path)

    def load(self, trainer, path: Path) -> None:
        manifest = json.loads((path / "manifest.json").read_text())
        check_lora(manifest, self.run.cfg, path, self.base_identity() if self.lora else None)
        check_compatible(manifest, self.run.hf_config, path)
        state = self._state(trainer)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(trainer.model, state["model"], options=StateDictOptions(strict=not self.lora))
        set_optimizer_state_dict(trainer.model, trainer.run.optimizer, state["optim"])
        ts = json.loads((path / "trainer_state.json").read_text())
        trainer.step, trainer.position = ts["step"], ts["position"]
        trainer.bad_steps, trainer.skipped_steps = ts["bad_steps"], ts["skipped_steps"]
        trainer.run.scheduler.load_state_dict(ts["scheduler"])
        rng_files = sorted(path.glob("rng_rank*.json"))
        rng = rng_files[self.dist.rank % len(rng_files)]
        _set_rng_state(json.loads(rng.read_text()))
        if ts["global_batch"] != trainer.global_batch:
            self.dist.print(f"note: global batch changed {ts['global_batch']} -> {trainer.global_batch} blocks; "
                            f"the data stream continues at block {trainer.position}")
        self.dist.print(f"resumed from {path} (step {trainer.step}, saved on {manifest['world_size']} rank(s))")


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
        if saved.get("target_modules") != cfg.lora.target_modules:
            raise ShardlmError(f"checkpoint {path} holds adapters on lora.target_modules="
                               f"{saved.get('target_modules')}, this run has {cfg.lora.target_modules}. Set "
                               "lora.target_modules to the checkpoint's to resume it, or use a new out_dir or "
                               "checkpoint.resume=none.")


def _test_pause_hook(step: int, out_dir: Path) -> None:
    """Test hook: SHARDLM_TEST_PAUSE_IN_SAVE=STEP stalls between the shard writes and the rename."""
    if os.environ.get("SHARDLM_TEST_PAUSE_IN_SAVE") == str(step):
        (out_dir / "paused_in_save").write_text(str(step))
        time.sleep(3600)
