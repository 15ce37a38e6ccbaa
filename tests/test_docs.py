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


def test_configs_ship_in_the_package_and_the_checkout_links_to_them():
    from shardlm.config import BUNDLED_CONFIGS

    assert (ROOT / "configs").is_symlink() and (ROOT / "configs").resolve() == BUNDLED_CONFIGS.resolve()
    assert BUNDLED_CONFIGS.parent == ROOT / "shardlm" and len(list(BUNDLED_CONFIGS.glob("*.yaml"))) >= 7
    assert '"configs/*.yaml"' in (ROOT / "pyproject.toml").read_text()  # [tool.setuptools.package-data]
