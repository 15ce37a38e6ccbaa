"""Run under torchrun: after sharding and two steps, lm_head and wte hold the same values."""

import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlm.config import load_config
from shardlm.dist import shutdown
from shardlm.trainer import Trainer

trainer = Trainer.from_config(load_config(None, sys.argv[1:]))
hf = trainer.model.hf
assert hf.lm_head.weight is hf.transformer.wte.weight, "tie broken by sharding"
before = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
trainer.train_step()
trainer.train_step()
state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if trainer.dist.is_main:
    wte, head = state["hf.transformer.wte.weight"], state.get("hf.lm_head.weight", state["hf.transformer.wte.weight"])
    assert torch.equal(wte, head)
    assert not torch.equal(wte, before["hf.transformer.wte.weight"]), "weights did not train"
    print("TIED OK", flush=True)
shutdown(0)
