"""vLLM as online RL's `Sampler` (`grpo.use_vllm`, `vllm_mode: colocate`): an engine inside each trainer process
generates the completions, and the policy's weights are pushed into it after every `grpo.weight_sync_steps`
optimizer steps.

Token ids in, token ids and their log-probabilities out: the engine is given the prompts' ids (it never sees
text) and returns the sampled ids with their `processed_logprobs` (after temperature, top-k and top-p), which the
importance-sampling correction compares with the trainer's. Each completion is its own request, seeded from
(seed, the prompt's key, its index) as the built-in sampler's rows are, so a completion does not depend on the
rank that samples it or on the batch around it; vLLM's per-request generators make that hold on one engine, and
across engines where the rows' logits come out bit-equal (this is what the 2-ranks test checks on CPU).

The engine starts from the model's config with dummy weights and takes the real ones at its first sync, which the
step makes before its first round (after a resume's checkpoint has loaded).
A sync reloads the weights in place (vLLM's `reload_weights`, which reruns the backend's post-load processing:
the CPU backend repacks its linear weights, so TRL's `load_weights` call does not work there), under the
transformers names the export writes, then resets the prefix cache, whose entries were computed by the old
weights. Under FSDP2 each tensor is gathered (`full_tensor`) and handed over as it comes, so a rank holds the
engine's copy and one tensor more. With LoRA the engine takes the frozen base once and then the adapters alone,
as PEFT writes them, loaded in place as its one LoRA (`grpo.vllm_lora_adapters`); merged weights instead are folded
into a full state first (each rank holds the model once more for the length of a sync), as the exports fold them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shardlm import ShardlmError
from shardlm.config.grpo import VLLM_LORA_RANKS, require_vllm
from shardlm.objectives.rl.sampling import Rollout, SamplingParams, row_seed


def engine_dtype(precision: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")



def start_engine(config: Any, precision: str, max_model_len: int, seed: int, on_gpu: bool, rows: int,
                 gpu_memory_utilization: float = 0.3, sleep_mode: bool = False, external: bool = False,
                 lora_rank: int | None = None) -> tuple[Any, str]:
    """A vLLM engine in this process for `config` (a transformers config) with dummy weights, and the folder of
    its config.json (the caller removes it). `external`: one engine per rank of the trainer's torchrun world;
    `lora_rank`: the engine applies LoRA adapters of that rank itself."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights in place
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO lines would outnumber the run's own
    from vllm import LLM

    folder = tempfile.mkdtemp(prefix="shardlm-vllm-")
    atexit.register(shutil.rmtree, folder, True)
    config.save_pretrained(folder)
    extra: dict[str, Any] = {}
    if on_gpu:
        extra |= {"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep_mode}
    else:  # vLLM's CPU backend would take 90% of the host's memory for its KV cache: what a round needs
        extra["kv_cache_memory_bytes"] = kv_cache_bytes(config, max_model_len, rows, precision)
        # a whole round's prefill in one scheduling step: a prompt prefilled in chunks rewinds its request's
        # seeded generator, which CPU generators cannot ("CPU Generator does not use offset")
        extra["max_num_batched_tokens"] = max(4096, rows * max_model_len)
    if external:
        extra["distributed_executor_backend"] = "external_launcher"  # TRL's colocate: one engine per rank
    if lora_rank:
        extra |= {"enable_lora": True, "max_loras": 1,
                  "max_lora_rank": next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank)}
    try:
        llm = LLM(model=folder, skip_tokenizer_init=True, load_format="dummy", dtype=engine_dtype(precision),
                  max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
                  enable_prefix_caching=True, enforce_eager=not on_gpu, **extra)
    except Exception as e:  # vLLM's own message, named as the engine's: the model may be one it cannot run
        shutil.rmtree(folder, ignore_errors=True)
        last = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise ShardlmError(f"vLLM could not start an engine for this model ({type(config).__name__}, "
                           f"{config.model_type}): {last}. Set grpo.use_vllm=false to sample with shardlm's own "
                           "sampler.") from e
    return llm, folder


def reload(llm: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """The engine's weights replaced in place under their transformers names, its prefix cache emptied."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()


def generate(llm: Any, prompts: Sequence[Sequence[int]], keys: Sequence[int], params: SamplingParams,
             vocab: int | None = None, lora: Any = None) -> Rollout:
    """`params.group` completions of each prompt, each its own request seeded by (seed, key, j); ids below
    `vocab` only, where set; through the LoRA adapter `lora` (a vLLM LoRARequest), where given."""
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt

    allowed = list(range(vocab)) if vocab is not None else None
    requests, settings = [], []
    for p, key in zip(prompts, keys, strict=True):
        for j in range(params.group):
            requests.append(TokensPrompt(prompt_token_ids=list(p)))
            settings.append(VParams(n=1, temperature=params.temperature, top_p=params.top_p,
                                    top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_tokens,
                                    seed=row_seed(params.seed, key, j), stop_token_ids=list(params.stop),
                                    logprobs=0, detokenize=False, allowed_token_ids=allowed))
    outputs = llm.generate(requests, settings, use_tqdm=False, lora_request=lora) if requests else []
    out = Rollout([list(p) for p in prompts], [], [], params.group)
    stop = set(params.stop)
    for o in outputs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        out.completions.append(ids)
        out.logps.append([float(d[t].logprob) if d and t in d else float("nan")
                          for t, d in zip(ids, c.logprobs or [None] * len(ids), strict=True)])
    out.truncated = [not c or c[-1] not in stop for c in out.completions]
    return out


class VLLMSampler:
    """`Sampler` on a vLLM engine in this process (`vllm_mode: colocate`). `model` is the trainer's CausalLM
    (sharded or not), `vocab` the tokenizer's ids (a padded head's extra ids are never drawn)."""

    def __init__(self, model: Any, g: Any, max_model_len: int, precision: str, seed: int, device: torch.device,
                 vocab: int | None = None, rows: int = 64):
        require_vllm()
        self.model, self.syncs, self.lora = model, 0, None
        config = engine_config(model)
        self.vocab = vocab if vocab is not None and vocab < config.vocab_size else None
        self.lora_rank = adapter_rank(model) if g.vllm_lora_adapters else None
        external = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self.llm, self.folder = start_engine(config, precision, max_model_len, seed, device.type == "cuda", rows,
                                             g.vllm_gpu_memory_utilization, g.vllm_enable_sleep_mode, external,
                                             self.lora_rank)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def sync(self) -> None:
        """Push the policy into the engine; every rank calls it (the gathers are collective). With LoRA adapters
        the frozen base goes once, then the adapters alone, loaded in place as one LoRA of the engine's."""
        if self.lora_rank is None or self.syncs == 0:
            reload(self.llm, policy_weights(self.model, base=self.lora_rank is not None))
        if self.lora_rank is not None:
            from vllm.lora.request import LoRARequest

            folder = os.path.join(self.folder, "policy")
            write_adapters(self.model, folder)
            self.lora = LoRARequest("policy", 1, folder, load_inplace=True)
        self.syncs += 1

    def sample(self, prompts: Sequence[Sequence[int]], keys: Sequence[int], params: SamplingParams) -> Rollout:
        return generate(self.llm, prompts, keys, params, self.vocab, self.lora)


def engine_config(model: Any) -> Any:
    """The model's transformers config as the engine reads it: `architectures` names the causal LM class (a
    from-scratch config has none, and vLLM would take GPT-2's or GPT-NeoX's base model for an embedding model)."""
    import copy

    config = copy.deepcopy(model.hf.config)
    config.architectures = [type(model.hf).__name__]
    return config


def check_heads(cfg: Any, hf_cfg: Any) -> None:
    """vLLM's CPU attention takes heads of 64 or more: a colocated engine on CPU with smaller ones is refused before
    the model loads, in the run and its dry run (a server may run on a GPU: it says so itself)."""
    import torch

    g, device = cfg.grpo, cfg.parallel.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not (g.use_vllm and g.vllm_mode == "colocate" and on_cpu):
        return
    head = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    if head < 64:
        raise ShardlmError(f"vLLM's CPU attention needs heads of 64 or more; this model's are {head} "
                           f"({hf_cfg.hidden_size} / {hf_cfg.num_attention_heads} heads): use fewer, wider heads "
                           "(model.n_head), a GPU, or grpo.use_vllm=false for shardlm's own sampler.")


def adapter_rank(model: Any) -> int | None:
    """The rank of the policy's LoRA adapters, or None for full fine-tuning."""
    from shardlm.models.lora import ADAPTER

    configs = getattr(model.hf, "peft_config", None)
    return configs[ADAPTER].r if configs else None


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The policy's LoRA adapters, gathered (every rank: collective), under PEFT's saved names."""
    from torch.distributed.tensor import DTensor

    from shardlm.models import lora
    from shardlm.models.state_keys import to_hf

    state = {k: v for k, v in model.state_dict().items() if lora.is_adapter_key(k)}
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu").clone()
            for k, v in state.items()}
    return {lora.peft_adapter_key(k): v for k, v in to_hf(full).items()}


def write_adapters(model: Any, folder: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """adapter_config.json and adapter_model.safetensors as PEFT writes them, what vLLM's LoRA loads."""
    from safetensors.torch import save_file

    from shardlm.models.lora import ADAPTER

    os.makedirs(folder, exist_ok=True)
    model.hf.peft_config[ADAPTER].save_pretrained(folder)
    save_file(adapter_tensors(model) if tensors is None else tensors, os.path.join(folder, "adapter_model.safetensors"))


def kv_cache_bytes(config: Any, max_model_len: int, rows: int, precision: str) -> int:
    """Room for `rows` sequences of `max_model_len` tokens (twice over, for the engine's block rounding), at
    least 64 MiB."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * (4 if engine_dtype(precision) == "float32" else 2)
    return max(64 << 20, 2 * per_token * max_model_len * max(rows, 1))


def policy_weights(model: Any, base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the transformers names (the export's), one tensor at a time: each FSDP2 shard
    gathered where it is needed; with LoRA, the adapters folded into their base weights first, or (`base`) left
    out, the base alone."""
    from torch.distributed.tensor import DTensor

    from shardlm.models import lora
    from shardlm.models.fp8 import plain_state_dict
    from shardlm.models.state_keys import is_hf, to_hf

    state = model.state_dict()
    if any(lora.is_adapter_key(k) for k in state):
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
        fold = lora.base_state if base else lora.inference_state
        merged = fold(plain_state_dict(full), model, model.hf.config)
        yield from ((k, v.detach()) for k, v in to_hf(merged).items())
        return
    for key, value in state.items():
        if not is_hf(key):
            continue
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        (name, plain), = to_hf(plain_state_dict({key: tensor})).items()
        yield name, plain.detach()
