"""The package's layout holds: each piece of knowledge has one owner. State-dict key prefixes are spelled only in
shardlm/models/state_keys.py, the run folder's file names only in shardlm/checkpoint/layout.py (the import
layers and the optional backends' homes are import-linter's contracts in pyproject.toml, run by make lint)."""

import re

import pytest

from helpers import ROOT

PACKAGE = ROOT / "shardlm"
OWNERS = {
    "state-dict key prefixes": (r"""["'](model\.)?hf\.|removeprefix\(["'](model\.)?hf\.""", "models/state_keys.py"),
    "run folder file names": (r"""["'](manifest\.json|config\.yaml|hf_config\.json|trainer_state\.json|"""
                              r"""metrics\.jsonl|checkpoints|latest)["']""", "checkpoint/layout.py"),
}


@pytest.mark.parametrize("what", OWNERS)
def test_one_owner(what):
    pattern, owner = OWNERS[what]
    strays = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
              for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE).as_posix() != owner
              for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert not strays, f"{what} belong in shardlm/{owner}:\n" + "\n".join(strays)
