"""The stateful parts a checkpoint is made of, each with `state_dict()` / `load_state_dict()` (torchtitan's
Stateful): the sharded model and optimizer (DCP), and each rank's random generators (JSON).

A resume restores the optimizer's moments and step, but the learning rate, weight decay and betas stay this
run's config (`OptimizerState.load_state_dict`): a changed train.lr is what the user asked for.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardlm.distributed import tensor, xla
from shardlm.models import lora
from shardlm.models.state_keys import tied_keys

HYPERPARAMETERS = ("initial_lr", "weight_decay", "betas", "eps")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in HYPERPARAMETERS if k in g} for g in optimizer.param_groups]


class ModelState:
    """The model's weights as DCP-sharded tensors; of a LoRA run (`adapters_only`) the adapter weights alone.

    A tied tensor (the input embedding that is also the head) is saved once; loading gives it to every name
    that shares it, so the tie holds. Checkpoints written with both names still load (DCP reads the keys asked
    for and ignores the rest)."""

    def __init__(self, model: torch.nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only
        self.tied = tied_keys(model)

    def state_dict(self) -> dict[str, Any]:
        weights = get_model_state_dict(self.model)
        if self.adapters_only:
            return lora.adapter_state(weights)
        return tensor.storable({k: v for k, v in weights.items() if k not in self.tied or self.tied[k] not in weights})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = tensor.restored(state, get_model_state_dict(self.model))
        state = {**{alias: state[key] for alias, key in self.tied.items() if key in state}, **state}
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.adapters_only))


class OptimizerState:
    """The optimizer's state, keyed by parameter name and sharded like the parameters."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return tensor.storable(get_optimizer_state_dict(self.model, self.optimizer))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The moments and step come back; the hyperparameters stay this run's. Loaded after the model (DCP's
        parts load in order), so on XLA both are resharded here."""
        configured = hyperparameters(self.optimizer)
        state = tensor.restored(state, get_optimizer_state_dict(self.model, self.optimizer))
        set_optimizer_state_dict(self.model, self.optimizer, state)
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)
        if next(self.model.parameters()).device.type == "xla":
            xla.shard_parameters(self.model, self.optimizer)


class RngState:
    """Python, NumPy, torch (and CUDA or XLA) generators of this rank, as JSON."""

    def __init__(self, xla_device: bool = False):
        self.xla = xla_device

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        np_state["state"] = {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {"python": [version, list(internal), gauss], "numpy": np_state,
                                 "torch": torch.get_rng_state().tolist()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state().tolist()
        if self.xla:
            state["xla"] = xla.rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np_state = state["numpy"]
        np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
        np.random.set_state(np_state)
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
        if "xla" in state and self.xla:
            xla.set_rng_state(state["xla"])


def model_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                adapters_only: bool = False) -> dict[str, Stateful]:
    """The sharded parts: what `dcp.save` writes (benchmarks/checkpoint_io.py measures exactly this)."""
    return {"model": ModelState(model, adapters_only), "optim": OptimizerState(model, optimizer)}
