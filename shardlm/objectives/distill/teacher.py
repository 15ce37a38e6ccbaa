"""The teacher of `train.objective=distill`: found from `distill.teacher`, checked against the student's tokenizer,
built frozen beside the student, and identified so that a resume refuses another one.

`distill.teacher` is read as `model.name` is (an HF folder, an export being one, or a hub name: loaded by the
same code, shardlm.models.hf_config and instantiate) or as `shardlm generate` reads a run folder or checkpoint
(its newest complete checkpoint's weights, a LoRA adapter merged into its base: shardlm.checkpoint.load). Either
way the model is built by the student's own `build_model` with the run's plan, so FSDP2 shards it into the same
kind of units and computes it in `parallel.precision`; it is frozen (no gradient, so no optimizer state), in eval
mode (no dropout), and is no part of a checkpoint: a resume builds it again and compares its identity (the
files' hashes) with the one the run's state recorded.

Both models must read the same ids: the same token -> id map and the same end-of-text and beginning ids. Their
heads may differ by padding rows (model.vocab_multiple): the loss compares the tokenizer's rows alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.checkpoint.layout import read_hf_config, resolve_checkpoint, tokenizer_dir
from shardlm.checkpoint.load import is_adapter_folder, is_hf_folder, load_for_inference
from shardlm.checkpoint.provenance import base_identity
from shardlm.config import Config, LoraConfig, ModelConfig
from shardlm.hub import looks_like_path, nearest_path
from shardlm.models.attention import attention
from shardlm.models.causal_lm import CausalLM, num_params
from shardlm.models.hf_config import check_model, model_config
from shardlm.tokenizer import load_tokenizer

KINDS = "an HF model folder, a hub name, a shardlm run folder or checkpoint, or an export"


@dataclass
class TeacherSource:
    """Where the teacher comes from: a name `model.name` can load (`model_name`), or a shardlm checkpoint."""

    name: str  # distill.teacher as given
    model_name: str | None = None
    checkpoint: Path | None = None

    def describe(self) -> str:
        return self.name if self.checkpoint is None else f"{self.name} ({self.checkpoint.name})"


def teacher_source(name: str | None) -> TeacherSource:
    """What `distill.teacher` names, or one line saying why it names nothing usable."""
    if not name:
        raise ShardlmError(f"train.objective=distill needs distill.teacher: {KINDS} sharing the student's tokenizer.")
    path = Path(name).expanduser()
    if path.is_dir() and is_hf_folder(path):
        return TeacherSource(name, model_name=str(path))
    if path.is_dir() and is_adapter_folder(path):
        raise ShardlmError(f"distill.teacher '{name}' is a LoRA adapter folder: export the run merged instead "
                           f"(`shardlm export RUN OUT` without --adapter) and give that folder, or the run folder.")
    if path.exists():
        try:
            return TeacherSource(name, checkpoint=resolve_checkpoint(path, log=lambda _: None))
        except ShardlmError as e:
            raise ShardlmError(f"distill.teacher '{name}' is no model: {e} Give {KINDS}.") from None
    if looks_like_path(name):
        raise ShardlmError(f"distill.teacher '{name}' is a path that does not exist.{nearest_path(name)} "
                           f"Give {KINDS}.")
    return TeacherSource(name, model_name=name)


def teacher_tokenizer(src: TeacherSource, trust_remote_code: bool = False) -> Any:
    spec = src.model_name if src.checkpoint is None else str(tokenizer_dir(src.checkpoint))
    assert spec is not None
    return load_tokenizer(spec, trust_remote_code)


def tokenizer_difference(student: Any, teacher: Any) -> str | None:
    """How two tokenizers read text differently (their token -> id maps, end-of-text or beginning ids), or None."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        differ = sorted((t for t in sv.keys() | tv.keys() if sv.get(t) != tv.get(t)),
                        key=lambda t: min(sv.get(t, 1 << 62), tv.get(t, 1 << 62)))
        t = differ[0]
        return (f"{len(differ):,} token{'s' * (len(differ) != 1)} map to other ids, e.g. {t!r}: "
                f"{sv.get(t, 'absent')} in the student's {len(sv):,} tokens, {tv.get(t, 'absent')} in the teacher's "
                f"{len(tv):,}")
    for what in ("eos_token_id", "bos_token_id"):
        if getattr(student, what, None) != getattr(teacher, what, None):
            return f"the {what} differs: {getattr(student, what, None)} vs {getattr(teacher, what, None)}"
    return None


def check_teacher_tokenizer(student_tok: Any, teacher: str | TeacherSource, trust_remote_code: bool = False,
                            teacher_tok: Any = None) -> None:
    """The teacher's scores are over its ids: a tokenizer that maps text to other ids would distill nonsense."""
    src = teacher if isinstance(teacher, TeacherSource) else teacher_source(teacher)
    why = tokenizer_difference(student_tok, teacher_tok or teacher_tokenizer(src, trust_remote_code))
    if why is not None:
        raise ShardlmError(f"distill.teacher '{src.name}' does not share the student's tokenizer ({why}): its scores "
                           "would be of other tokens. Distill from a teacher with the student's tokenizer, or set "
                           "model.tokenizer to the teacher's (a student from scratch can take any).")


def teacher_config(cfg: Config, src: TeacherSource) -> Config:
    """The run's config with the teacher as the model: the run's precision, sharding and plan; no LoRA, no dropout,
    no activation checkpointing (without a backward it saves nothing), none of the student's model overrides."""
    model = ModelConfig(name=src.model_name, attention=cfg.model.attention,
                        trust_remote_code=cfg.model.trust_remote_code)
    return dataclasses.replace(cfg, model=model, lora=LoraConfig(),
                               parallel=dataclasses.replace(cfg.parallel, activation_checkpointing="none"))


def teacher_hf_config(cfg: Config, src: TeacherSource, tokenizer: Any) -> Any:
    """The teacher's HF config, checked against data.seq_len as the student's is."""
    tcfg = teacher_config(cfg, src)
    if src.checkpoint is None:
        return model_config(tcfg, tokenizer)
    hf_cfg = read_hf_config(src.checkpoint)
    hf_cfg.use_cache = False
    check_model(hf_cfg, tcfg)
    hf_cfg._attn_implementation = attention(hf_cfg)
    return hf_cfg


def teacher_identity(src: TeacherSource) -> dict[str, Any]:
    """Who the teacher is, by its files' contents wherever they lie: a model folder's sha256 of config.json and of
    its weight files (as a LoRA base's identity is taken, provenance.base_identity); a checkpoint's sha256 of its
    files (their names inside it and their bytes). A byte-identical copy in another folder is the same teacher. A
    hub name keeps its name beside the hashes of its cached snapshot (the name alone when not cached)."""
    if src.checkpoint is None:
        assert src.model_name is not None
        ident = base_identity(src.model_name)
        local = Path(src.model_name).expanduser().is_dir()
        keys = ("config_sha256", "weights_sha256") if local and ident.get("weights_sha256") else \
            ("name", "config_sha256", "weights_sha256")
        return {k: ident.get(k) for k in keys}
    h = hashlib.sha256()
    for f in sorted(p for p in src.checkpoint.rglob("*") if p.is_file()):
        h.update(f.relative_to(src.checkpoint).as_posix().encode())
        with open(f, "rb") as stream:
            while chunk := stream.read(16 * 2**20):
                h.update(chunk)
    return {"checkpoint_sha256": h.hexdigest()}


def former_key(src: TeacherSource, identity: dict[str, Any]) -> str:
    """The key a run saved before identities left out the folder: the same files at the same path resume."""
    if src.checkpoint is None:
        return identity_key({"name": src.model_name, **{k: identity.get(k) for k in ("config_sha256",
                                                                                      "weights_sha256")}})
    return identity_key({"name": str(src.checkpoint.resolve()), **identity})


def identity_key(identity: dict[str, Any]) -> str:
    """The identity as a run's state records it (`teacher_key`); with the same files, the same key."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def teacher_changed(cfg: Config, saved: str, now: str) -> ShardlmError:
    return ShardlmError(f"distill.teacher '{cfg.distill.teacher}' is not the teacher this run trained with (its "
                        f"identity {now} differs from the checkpoint's {saved}: other weights or config). Give the "
                        "run's teacher again to resume, or start over with checkpoint.resume=none or a new out_dir.")


def load_teacher(cfg: Config, run: Any, build_model: Callable[..., CausalLM],
                 src: TeacherSource | None = None) -> CausalLM:
    """The frozen teacher, built as the student was (build_model with the run's plan: FSDP2 units alike, the same
    precision), after its tokenizer is checked. The global RNG is left as it was."""
    src = src or teacher_source(cfg.distill.teacher)
    trust = cfg.model.trust_remote_code
    tokenizer = teacher_tokenizer(src, trust)
    check_teacher_tokenizer(run.tokenizer, src, teacher_tok=tokenizer)
    hf_cfg = teacher_hf_config(cfg, src, tokenizer)
    ckpt = src.checkpoint
    weights = None if ckpt is None else lambda: load_for_inference(ckpt)[0]
    d = run.dist
    with torch.random.fork_rng(devices=[d.device.index or 0] if d.device.type == "cuda" else []):
        model = build_model(teacher_config(cfg, src), hf_cfg, run.plan, d, weights)
    model.requires_grad_(False)
    model.eval()
    d.print(f"teacher: {src.describe()}, {num_params(model) / 1e6:.2f}M parameters, frozen"
            + (", sharded as the student" if run.plan.use_fsdp else ""))
    return model
