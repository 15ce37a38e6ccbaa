"""LoRA fine-tuning with PEFT under FSDP2 (`lora.r > 0`).

Design:
- PEFT injects the adapters IN PLACE into the Hugging Face model (`peft.get_peft_model(...)` then
  `.get_base_model()`): every targeted Linear / GPT-2 Conv1D becomes a `peft.tuners.lora.Linear` holding the
  frozen original as `base_layer` and the trainable `lora_A` / `lora_B`. `CausalLM.hf` stays the transformers
  model itself (not the PeftModel wrapper, whose `.base_model` is the LoraModel and not the transformer body),
  so `CausalLM.forward`, `transformer_blocks`, activation checkpointing, compile and `fully_shard` see the same
  modules as in full fine-tuning. State-dict keys are `hf.<module>.base_layer.weight` (frozen) and
  `hf.<module>.lora_A.default.weight` / `lora_B...` (trained).
- Adapters go in before `parallelize`; `fully_shard` shards frozen and trainable parameters alike (FSDP2 shards
  per parameter), but only the adapters have `requires_grad`, so only they get gradients, a reduce-scatter and
  AdamW state (`build_optimizer` takes trainable parameters only).
- The adapter init (PEFT: `lora_A` Kaiming-uniform, `lora_B` zero) is drawn after `torch.manual_seed(seed)`,
  on rank 0's reference model under FSDP (then broadcast), or on the one model without: 1 and N ranks start equal.
- Default targets: every Linear / Conv1D inside the transformer blocks (attention and MLP projections), by
  their last name (`c_attn, c_proj, c_fc` for GPT-2; `q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
  down_proj` for Llama). The embeddings and the (often tied) head stay frozen.
- QLoRA (`lora.quantize=nf4`) holds the blocks' frozen linears in 4 bits under the adapters: with torchao's NF4
  tensors (shardlm.models.nf4), which FSDP2 shards and which run on CPU, or with bitsandbytes in one CUDA process
  (`quantized_base`); `backend` says which, `check` refuses what the chosen one cannot run.
- A checkpoint of a LoRA run holds only the adapter (plus optimizer, schedule, data position, RNG) and the
  base's identity (`base_identity`): resuming or loading it onto another base is refused.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardlm import ShardlmError
from shardlm.config import Config, LoraConfig
from shardlm.models.state_keys import hf_name, state_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ADAPTER = "default"  # PEFT's adapter name


def enabled(lc: LoraConfig) -> bool:
    return lc.r > 0


def backend(lc: LoraConfig, device: torch.device | None = None, sharded: bool = False) -> str | None:
    """QLoRA's backend (None without QLoRA): lora.quant_backend, with auto resolved to bitsandbytes in one CUDA
    process where it is installed (the QLoRA paper's kernels), torchao everywhere else (it shards, and runs on CPU)."""
    if not quantized(lc):
        return None
    if lc.quant_backend != "auto":
        return lc.quant_backend
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    one_gpu = cuda and not sharded and importlib.util.find_spec("bitsandbytes") is not None
    return "bitsandbytes" if one_gpu else "torchao"


def check(lc: LoraConfig, device: torch.device | None = None, sharded: bool = False) -> None:
    """QLoRA's refusals that depend on the device and the plan (the settings are checked with the config; the
    weights' shapes where the model is built, shardlm.models.nf4.check). A backend chosen for no quantization would
    pass for QLoRA while the base trains in full precision: refused."""
    if lc.quant_backend != "auto" and lc.quantize != "nf4":
        raise ShardlmError(f"lora.quant_backend={lc.quant_backend} has no effect without lora.quantize=nf4: set "
                           "lora.quantize=nf4, or drop lora.quant_backend.")
    chosen = backend(lc, device, sharded)
    if chosen is not None and device is not None and device.type == "xla":
        raise ShardlmError("lora.quantize=nf4 (QLoRA) does not run on XLA devices (neither torchao's NF4 tensors nor "
                           "bitsandbytes' 4-bit layers are tested there): use lora.quantize=null on a TPU.")
    if chosen == "torchao":
        from shardlm.models.nf4 import import_problem

        if (problem := import_problem()) is not None:
            raise ShardlmError(f"lora.quantize=nf4 with lora.quant_backend=torchao needs torchao, which does not "
                               f"import here ({problem}): pip install 'torchao>=0.17' (it needs torch >= 2.10), or use "
                               "lora.quant_backend=bitsandbytes in one process on a CUDA GPU.")
        return
    if chosen != "bitsandbytes":
        return
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if not cuda:
        raise ShardlmError("lora.quant_backend=bitsandbytes needs a CUDA GPU (its 4-bit kernels); this run is on "
                           "CPU. Use lora.quant_backend=torchao (or auto), which runs QLoRA on CPU.")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ShardlmError("lora.quant_backend=bitsandbytes needs the bitsandbytes package, which is not installed: "
                           "pip install shardlm[qlora] (or set lora.quant_backend=torchao).")
    if sharded:
        raise ShardlmError("lora.quant_backend=bitsandbytes runs in one process on one GPU: bitsandbytes keeps each "
                           "4-bit weight's quantization state on the parameter, which FSDP2's sharded parameters do "
                           "not carry. Use lora.quant_backend=torchao (or auto), whose NF4 weights FSDP2 shards, "
                           "or launch one process (parallel.fsdp=null, no cpu_offload).")


def quantized(lc: LoraConfig) -> bool:
    return enabled(lc) and lc.quantize == "nf4"


def quantized_note(model: nn.Module, lc: LoraConfig, device: torch.device, sharded: bool) -> str | None:
    """The run header's words on QLoRA: its backend and what the 4-bit base holds (on this rank, measured)."""
    chosen = backend(lc, device, sharded)
    if chosen is None:
        return None
    if chosen == "bitsandbytes":
        return "QLoRA base linears in 4-bit NF4 (bitsandbytes)"
    from shardlm.models import nf4

    layers = sum(1 for p in model.parameters() if nf4.is_nf4(p))
    held = nf4.base_bytes(model)
    size = f"{held / 2**20:.1f} MiB" if held >= 2**20 else f"{held / 2**10:.1f} KiB"
    return f"QLoRA base: {layers} linears in 4-bit NF4 (torchao), {size}" + (" on this rank" if sharded else "")


def quantized_base(cfg: Config, hf_cfg, device: torch.device) -> PreTrainedModel:
    """QLoRA's frozen base (`lora.quantize=nf4`, lora.quant_backend=bitsandbytes): the pretrained model loaded
    straight onto `device` with every linear layer but the head in 4-bit NormalFloat with double quantization
    (bitsandbytes, the QLoRA paper's recipe), dequantized per matmul to the compute dtype of parallel.precision;
    norms and embeddings stay fp32 (PEFT's prepare_model_for_kbit_training). torchao's is shardlm.models.nf4."""
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from shardlm.models.instantiate import initial_model

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.parallel.precision, torch.float32)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute)
    hf = initial_model(cfg, hf_cfg, cfg.train.seed, quantization_config=nf4, device_map={"": str(device)})
    return prepare_model_for_kbit_training(hf, use_gradient_checkpointing=False)  # AC is parallelize's


def _dequantized(state: dict, model: nn.Module) -> tuple[dict, set[str]]:
    """`state` with each 4-bit base weight of a QLoRA `model` (torchao's NF4 tensors, bitsandbytes' Linear4bit) as
    a float (out, in) tensor and bitsandbytes' quantization entries dropped, and the keys of those weights."""
    from shardlm.models import nf4

    out = dict(state)
    keys = {k for k, v in state.items() if nf4.is_nf4(v)}
    for key in keys:
        out[key] = nf4.dequantized(state[key])
    if not any(k.endswith(".quant_map") for k in state):
        return out, keys
    import bitsandbytes as bnb  # only called where a 4-bit layer exists, i.e. bitsandbytes is installed

    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            key = state_key(name) + ".weight"
            for extra in [k for k in out if k.startswith(key + ".")]:
                del out[extra]
            # bitsandbytes types Linear4bit.weight as nn.Linear's Tensor; it always holds a Params4bit
            weight = cast(bnb.nn.Params4bit, module.weight)
            out[key] = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float().cpu()
            keys.add(key)
    return out, keys


def _conv1d_layout(state: dict, keys: set[str], hf_config) -> dict:
    """Weights that bitsandbytes held as (out, in) Linear4bit back in the (in, out) layout of GPT-2's Conv1D."""
    from transformers.pytorch_utils import Conv1D

    from shardlm.models.instantiate import empty_model

    plain = dict(empty_model(hf_config, "meta").named_modules())
    for key in {k.replace(".base_layer.", ".") for k in keys}:
        if isinstance(plain.get(hf_name(key).removesuffix(".weight")), Conv1D):
            state[key] = state[key].T.contiguous()
    return state


def linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def linear_names(hf_model: PreTrainedModel) -> list[str]:
    """Last names of the Linear / Conv1D layers LoRA can target (not the output head), sorted (for messages)."""
    head = hf_model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in hf_model.named_modules()
                   if isinstance(m, linear_types()) and name and m is not head})


def default_targets(hf_model: PreTrainedModel) -> list[str]:
    """The attention and MLP projections: every Linear / Conv1D inside the transformer blocks."""
    from shardlm.models.causal_lm import transformer_blocks

    names = set()
    for block in transformer_blocks(hf_model):
        names |= {n.rsplit(".", 1)[-1] for n, m in block.named_modules() if isinstance(m, linear_types()) and n}
    return sorted(names)


def _matches(name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of target names: the module name equals one or ends with '.' + one."""
    return any(name == t or name.endswith("." + t) for t in targets)


def targets_of(hf_model: PreTrainedModel, lc: LoraConfig) -> list[str]:
    """The target names, checked: each must match at least one Linear / Conv1D layer."""
    targets = list(lc.target_modules) if lc.target_modules is not None else default_targets(hf_model)
    linears = [n for n, m in hf_model.named_modules() if isinstance(m, linear_types()) and n]
    head = [n for n, m in hf_model.named_modules() if m is hf_model.get_output_embeddings() and n]
    on_head = [t for t in targets if any(_matches(n, [t]) for n in head)]
    if on_head:
        raise ShardlmError(f"lora.target_modules {on_head} match the output head ({head[0]}): the loss reads the "
                           "head's weight directly, so an adapter there would never train. Target the blocks' "
                           f"projections ({', '.join(linear_names(hf_model))}); train the head with lora.r=0.")
    unmatched = [t for t in targets if not any(_matches(n, [t]) for n in linears)]
    if unmatched:
        raise ShardlmError(f"lora.target_modules {unmatched} match no linear layer of {type(hf_model).__name__}; "
                           f"its linear layers are: {', '.join(linear_names(hf_model))}. Set lora.target_modules "
                           "to some of these (or null for every attention and MLP projection).")
    return targets


def peft_config(hf_model: PreTrainedModel, lc: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    from transformers.pytorch_utils import Conv1D

    targets = targets_of(hf_model, lc)
    conv1d = any(isinstance(m, Conv1D) and _matches(n, targets) for n, m in hf_model.named_modules())
    return PeftLoraConfig(r=lc.r,
                          lora_alpha=cast(Any, lc.alpha),  # PEFT annotates int; a float only scales (alpha / r)
                          lora_dropout=lc.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM", fan_in_fan_out=conv1d)


def peft_model(hf_model: PreTrainedModel, lc: LoraConfig):
    """A `peft.PeftModel` around `hf_model` (adapters injected in place; on meta they stay on meta)."""
    import warnings

    from peft import get_peft_model

    config = peft_config(hf_model, lc)
    meta = any(p.is_meta for p in hf_model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(hf_model, config, low_cpu_mem_usage=meta)


def apply(hf_model: PreTrainedModel, lc: LoraConfig, seed: int | None = None) -> PreTrainedModel:
    """Inject the adapters into `hf_model` in place, freeze everything else; returns `hf_model`.

    With `seed`, the adapter init is drawn from `torch.manual_seed(seed)` (the same on every launch layout).
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = peft_model(hf_model, lc).get_base_model()
    assert model is hf_model
    for name, p in hf_model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return hf_model


def is_adapter_key(key: str) -> bool:
    """A parameter / state-dict key of a LoRA adapter weight (`...lora_A.default.weight`, `lora_B`, ...)."""
    return ".lora_" in key


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within it, `model` computes its base alone: every LoRA layer skips its adapters (what PEFT's
    `PeftModel.disable_adapter()` does, here without the wrapper shardlm drops). The flag is set directly, not
    through `enable_adapters`, which also switches the adapters' requires_grad (FSDP2's sharded parameters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m.disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, off in zip(layers, before, strict=True):
            m._disable_adapters = off


def adapter_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def count(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, each shared tensor once (shardlm.models.causal_lm.num_params)."""
    from shardlm.models.causal_lm import num_params

    return num_params(model, trainable_only=True), num_params(model)


def inference_state(state: dict, model: nn.Module, hf_config=None) -> dict:
    """`state` (of `model`, a CausalLM or HF model, LoRA-injected or not) with any adapters merged,
    W + (alpha / r) * B @ A with `base_layer.` dropped: a state dict a plain HF model of the same architecture
    loads. A QLoRA model's 4-bit base weights are dequantized first (`hf_config` gives the plain layout). A no-op
    for full fine-tuning. For inference on gathered training weights (the sample at the end of training,
    train.gen_every); the exports use PEFT's own `merge_and_unload` on the full-precision base."""
    configs = getattr(getattr(model, "hf", model), "peft_config", None)
    if not configs or not any(is_adapter_key(k) for k in state):
        return state
    pc = configs[ADAPTER]
    state, four_bit = _dequantized(state, model) if quantized_state(state) else (state, set())
    merged = _merged(state, pc.lora_alpha / pc.r, transpose=pc.fan_in_fan_out)
    return _conv1d_layout(merged, four_bit, hf_config) if four_bit else merged


def base_state(state: dict, model: nn.Module, hf_config=None) -> dict:
    """`state` without its adapters and with `base_layer.` dropped: the frozen base as a plain HF model loads it
    (a 4-bit base dequantized), what an inference engine that applies the adapters itself holds."""
    state, four_bit = _dequantized(state, model) if quantized_state(state) else (state, set())
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_key(k)}
    return _conv1d_layout(out, four_bit, hf_config) if four_bit else out


def peft_adapter_key(key: str) -> str:
    """A transformers-named adapter key (`model.layers.0.self_attn.q_proj.lora_A.default.weight`) as PEFT saves
    it in adapter_model.safetensors (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return "base_model.model." + key.replace(f".{ADAPTER}.", ".")


def quantized_state(state: dict) -> bool:
    """`state` holds 4-bit weights: bitsandbytes' (their quantization entries) or torchao's NF4 tensors."""
    from shardlm.models.nf4 import is_nf4

    return any(k.endswith(".quant_map") or is_nf4(v) for k, v in state.items())


def _merged(state: dict, scale: float, transpose: bool) -> dict:
    """Conv1D (GPT-2, `fan_in_fan_out`) stores W as (in, out): its delta is transposed."""
    out = {}
    for key, value in state.items():
        if is_adapter_key(key):
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            if leaf == "weight" and f"{prefix}.lora_A.{ADAPTER}.weight" in state:
                a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
                delta = (b.float() @ a.float()) * scale
                value = (value.float() + (delta.T if transpose else delta)).to(value.dtype)
            key = f"{prefix}.{leaf}"
        out[key] = value
    return out


def describe(lc: LoraConfig) -> dict | None:
    """What the manifest records about LoRA (None for full fine-tuning)."""
    if not enabled(lc):
        return None
    return {"r": lc.r, "alpha": lc.alpha, "dropout": lc.dropout, "target_modules": lc.target_modules}

