"""FSDP2 parameters gathered once for a whole generation round.

Generating a completion runs the model once per new token. Under FSDP2 each of those forwards would all-gather
every unit's parameters and free them again (reshard after forward): hundreds of all-gathers of the whole model
per round. Inside `gathered(model)` every unit is all-gathered once, stays gathered through any number of
forwards (run under no_grad), and is resharded at the end; the units' reshard-after-forward settings are put
back as they were. Without FSDP it does nothing.

FSDP2 has no public switch for "keep the parameters through these forwards": `set_reshard_after_forward` is
public but also clears the root's automatic setting, so the private fields it changes are saved and restored
here, and the forward-order bookkeeping that the generation's forwards append to (used to prefetch in
backward) is cut back to what it was, so the next training step sees only its own forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def fsdp_units(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    units = fsdp_units(model)
    if not units:
        yield
        return
    states = [u._get_fsdp_state() for u in units]
    states[0]._lazy_init()  # the root (first in modules() order), as its first forward would: sets up the others
    groups = [g for s in states for g in s._fsdp_param_groups]
    saved = [(g, g.post_forward_mesh_info, len(g._post_forward_indices)) for g in groups]
    autos = [(s, s._auto_reshard_after_forward) for s in states]
    order = states[0]._comm_ctx.post_forward_order
    order_len = len(order)
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.unshard()
        yield
    finally:
        for g, mesh_info, n in saved:
            g.post_forward_mesh_info = mesh_info
            del g._post_forward_indices[n:]
        for s, auto in autos:
            s._auto_reshard_after_forward = auto
        del order[order_len:]
        for unit in units:
            unit.reshard()
