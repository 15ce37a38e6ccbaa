"""Provenance: what a checkpoint says it holds (architecture, shardlm version, LoRA settings, the base model's
identity), and the checks that refuse to resume or load it into something else.

A LoRA checkpoint holds only the adapter; the manifest records the base's identity (`base_identity`: name,
folder, sha256 of config.json and every weight file) and a resume or load onto another base is refused.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from pathlib import Path

from shardlm import ShardlmError, __version__
from shardlm.checkpoint.layout import read_manifest
from shardlm.models import lora

ARCH_KEYS = ("model_type", "n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "num_hidden_layers",
             "hidden_size", "num_attention_heads", "max_position_embeddings")


def arch_of(hf_config) -> dict:
    d = hf_config.to_dict()
    return {k: d[k] for k in ARCH_KEYS if k in d}


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")) or sorted(folder.glob("*.pt"))
    return files


def _sampled_digest(path: Path, samples: int = 16, size: int = 65536) -> str:
    """The identity of checkpoints written before full hashing (manifests without "weights"): sha256 of the
    file's name, size, safetensors header and 16 evenly spaced 64 KiB data samples."""
    h = hashlib.sha256()
    total = path.stat().st_size
    h.update(f"{path.name}:{total}".encode())
    with open(path, "rb") as f:
        start = 0
        if path.suffix == ".safetensors" and total >= 8:
            n = struct.unpack("<Q", f.read(8))[0]
            h.update(f.read(min(n, 100 * 2**20)))
            start = 8 + n
        span = max(0, total - start)
        for i in range(samples):
            f.seek(start + span * i // samples)
            h.update(f.read(size))
    return h.hexdigest()


def _file_record(path: Path, known: dict | None) -> dict:
    """name, size, mtime and sha256 of one weight file. The whole file is hashed (1.3 GB/s here: ~2 s for a
    1B bf16 base, once per run); a file whose name, size and mtime equal the checkpoint's record is not read
    again, so a resume costs nothing."""
    st = path.stat()
    record = {"file": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if known and known.get("sha256") and all(known.get(k) == v for k, v in record.items()):
        return {**record, "sha256": known["sha256"]}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return {**record, "sha256": h.hexdigest()}


def local_base(name: str) -> Path | None:
    from shardlm.models.hf_config import model_source

    source = Path(model_source(name))
    if source.is_dir():
        return source.resolve()
    try:  # a hub name: the snapshot in the local HF cache, if there is one
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached: the identity is the name alone
        return None


def base_identity(name: str, known: dict | None = None) -> dict:
    """Who the base model is: its name, resolved folder, sha256 of config.json and of every weight file.
    `known`: the identity a checkpoint recorded; its files that are unchanged on disk are not read again."""
    folder = local_base(name)
    ident: dict = {"name": name, "path": str(folder) if folder else None, "config_sha256": None,
                   "weights_sha256": None}
    if folder is None:
        return ident
    config = folder / "config.json"
    if config.is_file():
        ident["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    files = _weight_files(folder)
    if not files:
        return ident
    h = hashlib.sha256()
    if known and known.get("weights_sha256") and "weights" not in known:  # recorded by an earlier shardlm
        for f in files:
            h.update(_sampled_digest(f).encode())
    else:
        saved = {r["file"]: r for r in (known or {}).get("weights", [])}
        ident["weights"] = [_file_record(f, saved.get(f.name)) for f in files]
        for r in ident["weights"]:
            h.update(f"{r['file']}:{r['sha256']}".encode())
    ident["weights_sha256"] = h.hexdigest()
    return ident


def check_base(saved: dict, current: dict, where: Path, what: str = "resume") -> None:
    """Refuse a LoRA checkpoint on a base other than the one it was trained on."""
    diffs = [k for k in ("config_sha256", "weights_sha256")
             if saved.get(k) and current.get(k) and saved[k] != current[k]]
    unhashed = not saved.get("weights_sha256") and not current.get("weights_sha256")
    if unhashed and saved.get("name") != current.get("name"):
        diffs.append("name")
    if diffs:
        parts = " and ".join({"config_sha256": "config.json", "weights_sha256": "weights", "name": "name"}[d]
                             for d in diffs)
        raise ShardlmError(
            f"checkpoint {where} holds a LoRA adapter trained on base model '{saved.get('name')}' "
            f"({saved.get('path')}), but model.name '{current.get('name')}' ({current.get('path')}) differs in its "
            f"{parts}: an adapter only fits its own base. To {what}, set model.name to the original base; to "
            "train this base, use a new out_dir or checkpoint.resume=none.")


def check_resumable(path: Path, cfg, hf_config, base_of: Callable[[dict | None], dict | None]) -> dict:
    """The checks before loading `path` into this config (the run's and `train --dry-run`'s); its manifest.
    `base_of(recorded identity)`: the LoRA base's identity now (None for full fine-tuning)."""
    manifest = read_manifest(path)
    check_lora(manifest, cfg, path, base_of(manifest.get("base")))
    check_compatible(manifest, hf_config, path)
    return manifest


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
    if saved and not lora.enabled(cfg.lora):
        raise ShardlmError(f"checkpoint {path} holds a LoRA adapter (lora.r={saved['r']}), but this run has lora.r=0 "
                           f"(full fine-tuning). Set lora.r={saved['r']} to resume it, or use a new out_dir or "
                           "checkpoint.resume=none.")
    if not saved and lora.enabled(cfg.lora):
        raise ShardlmError(f"checkpoint {path} holds a full fine-tuning run, but this run has lora.r={cfg.lora.r}. "
                           "Set lora.r=0 to resume it, or use a new out_dir or checkpoint.resume=none.")
    if saved:
        check_base(manifest.get("base") or {}, base or {}, path)
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
