"""One home per objective, and the registry the loop finds them in by `train.objective`.

| family | train.objective | trains on | home |
|---|---|---|---|
| language modelling | sft | text blocks, examples' answers | `lm.py` |
| preference pairs | dpo, ipo, simpo, orpo | chosen/rejected pairs | `preference/pairs.py` |
| unpaired preference | kto | examples labelled desirable or not | `preference/kto.py` |
| online RL | grpo, rloo | prompts, sampled completions scored by rewards | `rl/` |
| distillation | distill | text or examples, and a teacher | `distill/` |

Each family implements `base.Objective`; the Trainer, build, the dry run, `estimate`, `eval` and `export` ask the
family, never test its name (docs/design.md, "Adding an objective"). Importing this package imports every family.
"""

from __future__ import annotations

from shardlm.objectives.base import Loop, Objective, StepOut
from shardlm.objectives.defaults import Defaults
from shardlm.objectives.distill.step import Distill
from shardlm.objectives.lm import LanguageModeling
from shardlm.objectives.preference.kto import KTO
from shardlm.objectives.preference.pairs import Preference
from shardlm.objectives.rl.step import RLStep

FAMILIES: tuple[type[Objective], ...] = (LanguageModeling, Preference, KTO, RLStep, Distill)
NAMES: tuple[str, ...] = tuple(name for family in FAMILIES for name in family.names)

__all__ = ["FAMILIES", "NAMES", "Defaults", "Loop", "Objective", "StepOut", "objective_family"]


def objective_family(name: str) -> type[Objective]:
    """The family that trains `train.objective=name` (the config's checks name the choices first)."""
    for family in FAMILIES:
        if name in family.names:
            return family
    raise KeyError(f"unknown objective {name!r}; one of {', '.join(NAMES)}")
