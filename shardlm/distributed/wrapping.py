"""`parallel.wrap`: which modules become FSDP2 units (each gathers its parameters for its forward and backward
and frees them after), and the run header's account of the units formed.

`block` makes each transformer block a unit and leaves the rest (embeddings, final norm, head) to the root;
`blocks:K` makes K consecutive blocks one unit (`fully_shard([...])`: one all-gather and one reduce-scatter for
all of them); `auto` (the default) groups blocks up to AUTO_UNIT_PARAMS parameters a unit, so small blocks stop
paying FSDP2's per-unit host cost (hooks, events, one collective each) a dozen times a step while large ones
(past AUTO_UNIT_PARAMS each: Llama 7B's 200M) stay one a unit. benchmarks/README.md has the measurements.
`size:N` is FSDP1's `size_based_auto_wrap_policy(min_num_params=N)`: children first, a module whose
parameters not already in a unit below it number N or more becomes a unit, and what remains goes to the root.
Fewer, larger units mean fewer collectives; smaller ones a lower peak of gathered weights.
"""

from __future__ import annotations

import re
from collections import defaultdict

from torch import nn

from shardlm import ShardlmError
from shardlm.config.checks import wrap_blocks
from shardlm.models.causal_lm import transformer_blocks
from shardlm.models.state_keys import hf_name, state_key

# auto's unit: at least this many parameters gathered together, or one block when a block holds more. On GPT-2
# 124M (7M a block) units of 6 blocks: ~170 MB of bf16 weights held gathered at once, against FSDP2's host cost
# of 12 units measured at 1.6x a step on 2 ranks (benchmarks/README.md).
AUTO_UNIT_PARAMS = 50_000_000
WRAPPED = "_checkpoint_wrapped_module"  # activation checkpointing's (and offload's) wrapper's child


def blocks_per_unit(spec: str, blocks: nn.ModuleList) -> int:
    """How many consecutive blocks each FSDP2 unit holds (0: units by size:N). auto takes as many blocks as fit in
    AUTO_UNIT_PARAMS (at least one), then evens the units out: 12 blocks that fit 7 become 2 units of 6."""
    k = wrap_blocks(spec)
    if k is not None:
        return k
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    fit = max(1, AUTO_UNIT_PARAMS // max(largest, 1))
    units = -(-len(blocks) // fit)
    return -(-len(blocks) // max(units, 1))


def size_units(hf: nn.Module, size: int, whole_blocks: bool) -> tuple[list[str], tuple[int, str]]:
    """`parallel.wrap=size:N`'s units, as names under `hf`, children before parents (the order fully_shard takes
    them); the root is not listed. Only modules of the body qualify (its forward is called: shardlm's loss reads
    the head's weight itself), never a ModuleList (no forward of its own), an activation wrapper's child (the
    wrapper is the unit), or a module holding a tied parameter whose other owner lies outside it (FSDP2 refuses
    a parameter in two units: tied embeddings and head stay one parameter, in the root). With `whole_blocks`
    (blocks compiled, where dynamo would have to trace FSDP2's hooks) none inside a block qualifies.
    Also the largest count a qualifying module reached, and its name (what size:N must not exceed)."""
    body = next(name for name, m in hf.named_modules() if m is hf.base_model)
    blocks = transformer_blocks(hf)
    block_names = [name for name, m in hf.named_modules() if any(m is b for b in blocks)]
    ties = _tie_owners(hf)

    def eligible(name: str, module: nn.Module) -> bool:
        return (bool(name) and _within(name, body) and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
                and not name.endswith("." + WRAPPED)
                and not (whole_blocks and any(name.startswith(b + ".") for b in block_names))
                and not any(_splits(owners, name) for owners in ties))

    units: list[str] = []
    largest = (0, "")

    def visit(name: str, module: nn.Module) -> int:
        nonlocal largest
        left = sum(p.numel() for p in module._parameters.values() if p is not None)
        for child, sub in module.named_children():
            left += visit(f"{name}.{child}" if name else child, sub)
        if eligible(name, module):
            largest = (left, name) if left > largest[0] else largest  # the first of equals
            if left >= size:
                units.append(name)
                return 0
        return left

    visit("", hf)
    return units, largest


def check_size(hf: nn.Module, size: int, whole_blocks: bool, spec: str) -> list[str]:
    """The units of `size:N`, refused in one line when it forms none (every parameter in the root)."""
    units, (most, name) = size_units(hf, size, whole_blocks)
    if not units:
        raise ShardlmError(f"parallel.wrap={spec} forms no FSDP2 unit: no module that can be one holds {size:,} "
                           f"parameters (the largest, '{state_key(name)}', holds {most:,}), so all "
                           f"would stay in the root. Set N <= {most:,}, or parallel.wrap=block (each block a unit).")
    return units


def describe_units(model: nn.Module, spec: str) -> str | None:
    """The header's line: the FSDP2 units the model holds (read from the sharded model, so it names the units
    formed), grouped by name with the block numbers starred, each with the parameters it gathers."""
    from torch.distributed.fsdp import FSDPModule

    named = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not named:
        return None
    owned = owned_params(model, [name for name, _ in named])
    by_state: dict[int, list[str]] = defaultdict(list)  # fully_shard([a, b]): one unit, one state, two modules
    for name, m in named:
        by_state[id(m._get_fsdp_state())].append(name)
    units = list(by_state.values())
    groups: dict[tuple[str, int], int] = defaultdict(int)
    for unit in units:
        shown = re.sub(r"\.\d+(?=\.|$)", ".*", hf_name(state_key(unit[0]))) or "root"
        shown += f" ({len(unit)} blocks)" if len(unit) > 1 else ""
        groups[shown, sum(owned[n] for n in unit)] += 1
    parts = [f"{name} x{n} of {size:,}" if n > 1 else f"{name} of {size:,}" for (name, size), n in groups.items()
             if name != "root"]
    return (f"FSDP2 units (parallel.wrap={spec}): {len(units)}, each gathering its parameters: "
            + ", ".join([*parts, f"root of {owned['']:,}"]))


def owned_params(model: nn.Module, units: list[str]) -> dict[str, int]:
    """The parameters each unit gathers: its subtree's, less those of the units inside it ('' is the root, always
    counted: it holds what no unit does)."""
    owned: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            owned[max((u for u in ["", *units] if _within(name, u)), key=len)] += p.numel()
    return owned


def _within(name: str, ancestor: str) -> bool:
    return not ancestor or name == ancestor or name.startswith(ancestor + ".")


def _tie_owners(hf: nn.Module) -> list[list[str]]:
    """For each parameter held by more than one module (tied embeddings and head), the names of its owners."""
    owners: dict[int, list[str]] = defaultdict(list)
    for name, module in hf.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)].append(name)
    return [names for names in owners.values() if len(names) > 1]


def _splits(owners: list[str], name: str) -> bool:
    """A unit at `name` would hold some owners of the tied parameter but not all."""
    inside = [_within(o, name) for o in owners]
    return any(inside) and not all(inside)
