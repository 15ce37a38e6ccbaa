"""Run under torchrun (tests/test_parallelize.py): shardlm's CPU reduce-scatter against gloo's own
reduce_scatter_tensor, for SUM and AVG, an odd size and a large one; then a tiny GPT-2 sharded by shardlm's `shard`
(which gives its units this comm) against a copy sharded alike and left on gloo's: the same gradients. Writes the
comparison as JSON to argv[1] on rank 0."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

from shardlm.config import load_config
from shardlm.distributed.cpu_comms import ALL_TO_ALL_MAX_BYTES, CpuReduceScatter
from shardlm.distributed.parallelize import device_mesh, plan, shard
from shardlm.models.causal_lm import CausalLM, transformer_blocks

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
comm, result = CpuReduceScatter(), {}
for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg")):
    for n in (6, 1001, ALL_TO_ALL_MAX_BYTES // 4 // world + 1):  # all-to-all twice, then the all-reduce
        x = torch.randn(world * n)
        ours, theirs = comm.allocate((n,), dtype=x.dtype, device=x.device), torch.empty(n)
        comm(ours, x.clone(), dist.group.WORLD, op)
        dist.reduce_scatter_tensor(theirs, x.clone(), op=op)
        result[f"{name}_{min(n, 9999)}"] = (ours - theirs).abs().max().item()

torch.manual_seed(0)  # a tiny GPT-2 sharded by shardlm (2 units: blocks, root), and a copy left on gloo's comm
model = CausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_layer=2, n_embd=16, n_head=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))
plain = copy.deepcopy(model)
cfg = load_config(None, [])
pl = plan(cfg, world, world, torch.device("cpu"))
shard(model, transformer_blocks(model.hf), cfg.parallel, pl, device_mesh(pl, torch.device("cpu"))[0])
fully_shard(list(transformer_blocks(plain.hf)))
fully_shard(plain)
states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]  # 2 blocks, 1 unit: 1 state
groups = {id(g): g for state in states  # torch 2.9 keeps one param group a state, 2.13 a list
          for g in getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]}
result["installed"] = [type(g._reduce_scatter_comm).__name__ for g in groups.values()]
torch.manual_seed(1 + rank)
tokens = torch.randint(0, 40, (3, 16))
for m in (model, plain):
    m(tokens, torch.roll(tokens, -1, 1))[0].backward()
result["grads"] = max((a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
                      for a, b in zip(model.parameters(), plain.parameters(), strict=True))
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
