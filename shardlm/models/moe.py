"""Mixture-of-experts models: the router's auxiliary loss their own forward adds, and the expert load.

shardlm computes the language-model loss itself, from the base model's hidden states (no full logits). A
mixture-of-experts `*ForCausalLM.forward` adds a term to that loss when its config sets
`output_router_logits`: `router_aux_loss_coef` x the Switch Transformer load-balancing loss of the routers'
logits (the module's own `load_balancing_loss_func`; Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, Granite-MoE, PhiMoE
... share that template). Without it the router collapses onto few experts. `RouterObjective` reproduces that
term with the family's own function, so the loss shardlm optimizes is the model's own (tested per family); a
model whose config asks for router outputs but whose family does not follow the template is refused rather
than trained on plain cross-entropy.

The routers' logits also give the expert load (tokens routed to each expert, per layer), accumulated in a
buffer during training so a collapsing router shows in the records (`expert_load_cv` ...), at no host sync.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardlm import ShardlmError

# Families whose objective was checked against their own forward (tests/test_families.py). DeepSeek-V2/V3 route
# with a bias-corrected top-k and add no auxiliary term in transformers: their objective is cross-entropy.
TESTED_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class RouterObjective:
    """What a mixture-of-experts family's forward adds to cross-entropy, and how to read its routers."""

    balance: Callable  # the family's load_balancing_loss_func(router_logits, num_experts, top_k, mask)
    num_experts: int
    top_k: int
    coef: float  # router_aux_loss_coef
    in_loss: bool  # config.output_router_logits: the model's own loss adds coef x balance
    layers: int  # layers with a router

    def aux_loss(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.balance(router_logits, self.num_experts, self.top_k, None)

    def expert_counts(self, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(layers, experts) tokens routed to each expert (each token counts top_k times), no host sync."""
        counts = []
        for logits in router_logits:
            chosen = torch.topk(logits.detach().float(), self.top_k, dim=-1).indices
            counts.append(torch.histc(chosen.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts))
        return torch.stack(counts)


def router_objective(hf_model: nn.Module) -> RouterObjective | None:
    """The routed family's objective (None for a dense model or a family with no auxiliary term to add)."""
    cfg: Any = hf_model.config
    module = sys.modules.get(type(hf_model).__module__)
    balance = getattr(module, "load_balancing_loss_func", None)
    wants = bool(getattr(cfg, "output_router_logits", False))
    names = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
    attrs: dict[str, Any] = {a: getattr(hf_model, a, None) for a in names}
    if balance is None or None in attrs.values():
        if wants:
            raise ShardlmError(
                f"{cfg.model_type} sets output_router_logits=true, but shardlm cannot reproduce what its forward adds "
                f"to the loss (it does not follow the load-balancing template of {', '.join(TESTED_MOE_FAMILIES[:5])}"
                "): it would train a different objective. Set model.config_overrides='{\"output_router_logits\": "
                "false}' to train plain cross-entropy knowingly.")
        return None
    forward = inspect.getsource(type(hf_model).forward)
    if wants and forward.count("loss +=") + forward.count("loss = loss +") > 1:
        raise ShardlmError(f"{cfg.model_type}'s forward adds more than the router load-balancing loss to the "
                           "cross-entropy; shardlm reproduces only that one. Set model.config_overrides="
                           "'{\"output_router_logits\": false}' to train plain cross-entropy knowingly.")
    layers = sum(1 for m in hf_model.modules() if type(m).__name__.endswith(("TopKRouter", "Router", "Gate"))
                 and hasattr(m, "weight"))
    return RouterObjective(balance, int(attrs["num_experts"]), int(attrs["num_experts_per_tok"]),
                           float(attrs["router_aux_loss_coef"]), wants, layers)


def is_moe(hf_config) -> bool:
    return any(isinstance(getattr(hf_config, a, None), int) and getattr(hf_config, a) > 1 for a in EXPERT_COUNTS)


def load_summary(counts: torch.Tensor) -> dict[str, list[float]]:
    """Per layer, each expert's share of the routed tokens over the uniform share (1 = balanced): min, max, and
    the coefficient of variation of the counts (0 = balanced; it grows as the router collapses)."""
    share = counts / counts.sum(dim=1, keepdim=True).clamp(min=1) * counts.shape[1]
    cv = counts.std(dim=1, unbiased=False) / counts.mean(dim=1).clamp(min=1e-9)
    return {"expert_load_min": share.min(dim=1).values.tolist(), "expert_load_max": share.max(dim=1).values.tolist(),
            "expert_load_cv": cv.tolist()}


def router_record(model: nn.Module, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """The record fields since the last call (every rank's routing summed), the accumulators zeroed: the mean
    auxiliary loss and, for the layer whose load is most uneven, the expert load (`load_summary`); per layer
    in `expert_load_cv_by_layer`. Empty for a dense model."""
    stats = getattr(model, "router_stats", None)
    router: RouterObjective | None = getattr(model, "router", None)
    if stats is None or router is None:
        return {}
    total = all_reduce_sum(stats.detach().clone().double())
    stats.zero_()
    if total[1] == 0:
        return {}
    load = load_summary(total[2:].view(router.layers, router.num_experts))
    cv = load["expert_load_cv"]
    return {"router_aux_loss": (total[0] / total[1]).item(), "expert_load_cv": max(cv),
            "expert_load_min": min(load["expert_load_min"]), "expert_load_max": max(load["expert_load_max"]),
            "expert_load_cv_by_layer": [round(c, 4) for c in cv]}


def active_fraction(hf_config) -> float:
    """The share of expert weights one token runs through: top_k / experts (1 for a dense model)."""
    experts = next((getattr(hf_config, a) for a in EXPERT_COUNTS if isinstance(getattr(hf_config, a, None), int)), 0)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    return top_k / experts if experts > 1 and isinstance(top_k, int) else 1.0


def idle_expert_params(model: nn.Module, hf_config) -> int:
    """Routed-expert parameters one token does not run through: all of them x (1 - top_k / experts)."""
    return round(expert_params(model) * (1 - active_fraction(hf_config)))


def expert_params(model: nn.Module) -> int:
    """Parameters of the routed experts (named `...experts...`, shared experts excluded), each tensor once."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if ".experts." in f".{name}" and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
