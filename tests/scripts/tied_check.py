"""Run under torchrun with parallel.wrap=block: only the last block and the root (torch's rule: the head it holds
starts the backward) stay gathered after their forward; after two steps lm_head and wte
hold the same values; AdamW's update runs on the local shards (no op of its step sees a DTensor) while its
state stays DTensors for DCP."""

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from shardlm.config import load_config
from shardlm.distributed.process_group import shutdown
from shardlm.training.trainer import Trainer


class DTensorOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = [*args, *(kwargs or {}).values()]
        flat = [t for a in leaves for t in (a if isinstance(a, (list, tuple)) else [a])]
        if any(isinstance(t, DTensor) for t in flat):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


trainer = Trainer.from_config(load_config(None, sys.argv[1:]))
hf = trainer.model.hf
assert hf.lm_head.weight is hf.transformer.wte.weight, "tie broken by sharding"
groups = [block._get_fsdp_state()._fsdp_param_group for block in hf.transformer.h]
assert groups[0].post_forward_mesh_info is not None and groups[-1].post_forward_mesh_info is None, \
    "only the last block stays gathered after its forward"
before = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
trainer.train_step()
trainer.train_step()
root = trainer.model._get_fsdp_state()._fsdp_param_group  # its lazy init (the first forward) applies the rule
assert root.post_forward_mesh_info is None, "the root is resharded after its forward, to be gathered again at once"
state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if trainer.dist.is_main:
    wte, head = state["hf.transformer.wte.weight"], state.get("hf.lm_head.weight", state["hf.transformer.wte.weight"])
    assert torch.equal(wte, head)
    assert not torch.equal(wte, before["hf.transformer.wte.weight"]), "weights did not train"
    print("TIED OK", flush=True)

opt = trainer.run.optimizer
trainer.forward_backward_step(trainer.train_batch(0))
weight = next(p for p in trainer.model.parameters() if p.dim() == 2)
old = weight._local_tensor.clone()
with DTensorOps() as mode:
    opt.step()
assert not mode.seen, f"AdamW dispatched on DTensors: {sorted(set(mode.seen))[:5]}"
assert isinstance(opt.state[weight]["exp_avg"], DTensor) and not torch.equal(old, weight._local_tensor)
if trainer.dist.is_main:
    print("LOCAL STEP OK", flush=True)
shutdown(0)
