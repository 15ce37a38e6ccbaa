"""Load a trained model from a checkpoint, a run dir or an exported HF folder, on CPU: for inference (generate,
eval, export) and as a distillation teacher (shardlm.objectives.distill.teacher), which is why it lives below both.

The architecture and tokenizer come from what was saved, never from the command line. A DCP checkpoint is
read into a plain CPU model: DCP reassembles full tensors from however many shards were written.

A LoRA checkpoint holds only the adapter: the base comes from the run's `model.name` (refused when its identity
differs from the one recorded at training), the adapter is read from DCP into PEFT's layers, and for
inference (export, generate, eval) PEFT's `merge_and_unload` folds it into the base weights. An exported PEFT
adapter folder (`shardlm export RUN OUT --adapter`) loads the same way from its `base_model_name_or_path`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp

from shardlm import ShardlmError
from shardlm.checkpoint import provenance
from shardlm.checkpoint.layout import (
    nearby,
    read_config,
    read_hf_config,
    read_manifest,
    resolve_checkpoint,
    tokenizer_dir,
)
from shardlm.config import Config, LoraConfig
from shardlm.models.instantiate import fill_meta_buffers
from shardlm.models.state_keys import CHECKPOINT, checkpoint_key, to_hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors*"))


def is_adapter_folder(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def load_lora_checkpoint(ckpt: Path, cfg: Config):
    """A `peft.PeftModel` (CPU, fp32, unmerged): the run's base model + the checkpoint's adapter weights."""

    from shardlm.models import lora
    from shardlm.models.instantiate import initial_model

    manifest = read_manifest(ckpt)
    saved = manifest.get("base") or {}
    name = cfg.model.name
    if name is None:  # the config check refuses LoRA without a pretrained base
        raise ShardlmError(f"checkpoint {ckpt} holds a LoRA adapter but its config names no base (model.name)")
    if provenance.local_base(name) is None and saved.get("path") and Path(saved["path"]).is_dir():
        cfg.model.name = name = saved["path"]  # e.g. a relative model.name, read from another working directory
    provenance.check_base(saved, provenance.base_identity(name, saved), ckpt, what="load it")
    hf_config = read_hf_config(ckpt)
    base = initial_model(cfg, hf_config, cfg.train.seed)
    model = lora.peft_model(base, cfg.lora)
    inner = model.get_base_model()
    wanted = {checkpoint_key(k): v for k, v in inner.state_dict().items() if lora.is_adapter_key(k)}
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise ShardlmError(f"checkpoint {ckpt} lacks adapter weights for {missing[:3]} (lora.target_modules differ "
                           "from the run's?)")
    state = {k: torch.empty_like(v) for k, v in wanted.items()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    inner.load_state_dict(to_hf(state, CHECKPOINT), strict=False)
    model.peft_config[lora.ADAPTER].base_model_name_or_path = (manifest.get("base") or {}).get("path") \
        or cfg.model.name
    return model


def load_adapter_folder(path: Path, trust_remote_code: bool = False):
    """(merged model, tokenizer) from a PEFT adapter folder and the base it names."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_name = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    try:
        base = AutoModelForCausalLM.from_pretrained(base_name, trust_remote_code=trust_remote_code, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ShardlmError(f"adapter folder '{path}' names base model '{base_name}', which cannot be loaded "
                           f"({str(e).splitlines()[0][:160]}). Edit base_model_name_or_path in its "
                           "adapter_config.json.") from None
    model = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    source = path if (path / "tokenizer_config.json").is_file() else base_name
    return model, AutoTokenizer.from_pretrained(str(source), trust_remote_code=trust_remote_code)


def load_checkpoint_model(ckpt: Path) -> PreTrainedModel:

    from shardlm.models.instantiate import empty_model

    hf_config = read_hf_config(ckpt)
    model = empty_model(hf_config, "meta")
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    state = {checkpoint_key(k): torch.empty_like(v, device="cpu")
             for k, v in model.state_dict().items() if checkpoint_key(k) in saved}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(to_hf(state, CHECKPOINT), strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ShardlmError(f"checkpoint {ckpt} lacks weights for {missing[:3]}")
    return model


def load_for_inference(path: str | Path, device: str = "cpu", trust_remote_code: bool = False):
    """(hf_model in eval mode, tokenizer, training Config or None for an HF folder, checkpoint dir or None).

    Code shipped with a model runs only when allowed: by `trust_remote_code` or, for a checkpoint, by the run's
    own `model.trust_remote_code`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlmError(f"'{path}' does not exist.{nearby(path)} Give a checkpoint, a run dir or an "
                           "exported HF folder.")
    model: PreTrainedModel
    if is_hf_folder(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=trust_remote_code,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        cfg, ckpt = None, None
    elif is_adapter_folder(path):
        model, tokenizer = load_adapter_folder(path, trust_remote_code)
        cfg, ckpt = None, None
    else:
        ckpt = resolve_checkpoint(path, log=lambda m: print(m, file=sys.stderr))
        cfg = read_config(ckpt)
        trust_remote_code = trust_remote_code or cfg.model.trust_remote_code
        if read_manifest(ckpt).get("lora"):
            model = load_lora_checkpoint(ckpt, cfg).merge_and_unload()
            cfg = dataclasses.replace(cfg, lora=LoraConfig())  # what is returned is a plain (merged) model
        else:
            model = load_checkpoint_model(ckpt)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(ckpt)), trust_remote_code=trust_remote_code)
    model.config.use_cache = True
    fill_meta_buffers(model)
    # transformers wraps PreTrainedModel.to in functools.wraps, whose type does not bind `self` in some releases
    return cast(Any, model).to(device).eval(), tokenizer, cfg, ckpt


def inference_config(cfg: Config | None) -> Config:
    return cfg if cfg is not None else Config()
