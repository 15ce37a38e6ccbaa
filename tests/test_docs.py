from pathlib import Path

import pytest

from shardlm.config import load_config
from shardlm.docs import readme_block

ROOT = Path(__file__).resolve().parent.parent


def test_readme_config_reference_matches_code():
    assert readme_block() in (ROOT / "README.md").read_text(), "run: python -m shardlm.docs --write"


def test_readme_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_bundled_config_loads(path):
    cfg = load_config(path)
    assert cfg.out_dir.startswith("runs/")
    assert path.name in (ROOT / "README.md").read_text()
