"""Load a trained model for inference from a checkpoint, a run dir or an exported HF folder.

The architecture and tokenizer come from what was saved, never from the command line. A DCP checkpoint is
read into a plain CPU model: DCP reassembles full tensors from however many shards were written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn

from shardlm import ShardlmError
from shardlm.checkpoint import resolve_checkpoint
from shardlm.config import Config, config_from_dict
from shardlm.model import fill_meta_buffers


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors*"))


def load_checkpoint_model(ckpt: Path) -> nn.Module:
    from transformers import AutoConfig

    from shardlm.model import empty_model

    hf_config = AutoConfig.for_model(**json.loads((ckpt / "hf_config.json").read_text()))
    model = empty_model(hf_config, "meta")
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    state = {f"model.hf.{k}": torch.empty_like(v, device="cpu")
             for k, v in model.state_dict().items() if f"model.hf.{k}" in saved}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict({k.removeprefix("model.hf."): v for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ShardlmError(f"checkpoint {ckpt} lacks weights for {missing[:3]}")
    return model


def load_for_inference(path: str | Path, device: str = "cpu", trust_remote_code: bool = False):
    """(hf_model in eval mode, tokenizer, training Config or None for an HF folder, checkpoint dir or None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not path.exists():
        raise ShardlmError(f"'{path}' does not exist: give a checkpoint, a run dir or an exported HF folder.")
    if is_hf_folder(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=trust_remote_code,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        cfg, ckpt = None, None
    else:
        ckpt = resolve_checkpoint(path, log=lambda m: print(m, file=sys.stderr))
        model = load_checkpoint_model(ckpt)
        tokenizer = AutoTokenizer.from_pretrained(str(ckpt / "tokenizer"))
        cfg = config_from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    model.config.use_cache = True
    fill_meta_buffers(model)
    return model.to(device).eval(), tokenizer, cfg, ckpt


def inference_config(cfg: Config | None) -> Config:
    return cfg if cfg is not None else Config()
