"""A resumed preference run trains against the reference it started with: the precomputed values must be on
disk, whole; a live reference must rebuild the same initial model. Refused before anything is written (build
and the dry run call this), not at the first step."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from shardlm.checkpoint import layout
from shardlm.config import Config
from shardlm.data import ExampleRows
from shardlm.data.cache import cache_root
from shardlm.data.examples import reference_problem
from shardlm.objectives.preference.reference import (
    damaged_reference,
    initial_key,
    live_reference_changed,
    missing_reference,
    pair_rows,
    reference_key,
    unscored,
)


def check_reference(cfg: Config, hf_cfg: Any, train: Any, val: Any, resumed: Path, on_main: Any) -> None:
    """The reference a resumed run (past step 0) needs: the live one's initial model, or the stored values."""
    saved = json.loads(on_main(lambda: json.dumps(_resumed_state(resumed))))
    if not saved["step"]:
        return
    run = SimpleNamespace(cfg=cfg, hf_config=hf_cfg)  # what the reference's keys read of a run
    if cfg.preference.reference == "live":  # the initial model's key hashes a base's files: once, on rank 0
        if on_main(lambda: "changed" if saved["reference_key"] not in (None, initial_key(run)) else ""):
            raise live_reference_changed(cfg)
        return
    problem = on_main(lambda: _stored_reference(cfg, reference_key(run), train, val))
    if problem:
        name, found = problem.split("\t")
        raise damaged_reference(name) if found == "damaged" else missing_reference(name, found == "found")


def _resumed_state(path: Path) -> dict[str, Any]:
    state_file = path / layout.TRAINER_STATE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return {"step": layout.read_manifest(path).get("step", 0), "reference_key": state.get("reference_key")}


def _stored_reference(cfg: Config, key: str, train: Any, val: Any) -> str:
    """'' if each example set's stored reference is there with every pair scored, else 'NAME\tfound|missing'. The
    folder is named from the cache root, so a dry run's examples (rendered in memory) point at the run's cache."""
    for splits in _example_sets([pair_rows(train, "training"), pair_rows(val, "validation")]):
        folder = splits[0].examples.meta.get("folder")
        if not folder:
            continue
        path = cache_root(cfg.data.cache_dir) / Path(folder).name / f"reference-{key}.npy"
        if not path.is_file():
            return f"{path.name}\tmissing"
        if (damaged := reference_problem(path)) is not None:  # truncated or changed: named, not numpy's traceback
            return f"{damaged}\tdamaged"
        if unscored(np.load(path, mmap_mode="r"), splits, True):
            return f"{path.name}\tfound"
    return ""


def _example_sets(splits: list[ExampleRows]) -> list[list[ExampleRows]]:
    """The splits grouped by the example set they cut (a held-out tail shares the training pairs' set and file)."""
    groups: list[list[ExampleRows]] = []
    for rows in splits:
        group = next((g for g in groups if g[0].examples is rows.examples), None)
        if group is None:
            groups.append([rows])
        elif rows is not group[0]:
            group.append(rows)
    return groups
