"""Run under torchrun with 2 ranks (tests/test_grpo.py): each rank samples half the prompts from an FSDP2-sharded
tiny GPT-2 (blocks, then the root, as shardlm.distributed.parallelize shards it); writes the completions of both
ranks, those of an unsharded copy on all prompts, the all-gathers and block forwards of the round, and a training
forward/backward after it next to the unsharded copy's."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel

from shardlm.models.causal_lm import CausalLM
from shardlm.objectives.rl.gather import fsdp_units
from shardlm.objectives.rl.sampling import SamplingParams, TransformersSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=40, n_positions=64, n_layer=3, n_embd=32, n_head=2, bos_token_id=39, eos_token_id=39,
                 initializer_range=0.3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = CausalLM(GPT2LMHeadModel(cfg))
reference = copy.deepcopy(model)
for block in model.hf.transformer.h:
    fully_shard(block)
fully_shard(model)

prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [12]]
params = SamplingParams(group=2, max_tokens=6, temperature=1.0, top_p=0.95, seed=3)
forwards = [0]
model.hf.transformer.h[0].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
mine = slice(2 * rank, 2 * rank + 2)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    rollout = TransformersSampler(model.hf, pad=39, root=model).sample(prompts[mine], list(range(4))[mine], params)
round_forwards = forwards[0]
gathers = sum(1 for e in prof.events() if e.name.startswith("FSDP::all_gather") and "copy" not in e.name)
everyone = [None, None]
dist.all_gather_object(everyone, rollout.completions)
resharded = all(isinstance(p, DTensor) for p in model.parameters())

tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 2)
targets = torch.roll(tokens, -1, 1)
with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    model(tokens, targets)  # the counter's check: a plain forward gathers every unit
per_forward = sum(1 for e in prof.events() if e.name.startswith("FSDP::all_gather") and "copy" not in e.name)
loss, _ = model(tokens, targets)
loss.backward()
ref_loss, _ = reference(tokens, targets)
ref_loss.backward()
grad = model.hf.transformer.wte.weight.grad.full_tensor()
if rank == 0:
    want = TransformersSampler(reference.hf, pad=39).sample(prompts, range(4), params)
    result = {"completions": [c for part in everyone for c in part], "reference": want.completions,
              "all_gathers": gathers, "units": len(fsdp_units(model)), "forwards": round_forwards,
              "per_forward": per_forward, "resharded": resharded, "loss": loss.item(),
              "reference_loss": ref_loss.item(),
              "grad_close": torch.allclose(grad, reference.hf.transformer.wte.weight.grad, atol=1e-6)}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
