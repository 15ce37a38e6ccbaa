import os
import re
import shlex
import subprocess
import sys
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


DOC_PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if "```bash" in p.read_text())


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_doc_page_commands_run_as_written(page, tmp_path):
    """Each line of a docs page's bash blocks runs, in order, in a fresh folder (offline, on the CPU); the
    page's first `text` block is the output of its first dry run, so the page shows what the command prints."""
    text = page.read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "SHARDLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    outputs = []
    for argv in (shlex.split(line, comments=True) for line in lines):
        if not argv:
            continue
        program = {"shardlm": [sys.executable, "-m", "shardlm"], "python": [sys.executable]}[argv[0]]
        proc = subprocess.run([*program, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{page.name}: {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
        outputs.append((argv, proc.stdout))
    shown = re.findall(r"```text\n(.*?)```", text, re.S)
    dry = next((out for argv, out in outputs if "--dry-run" in argv), None)
    if shown and dry is not None:
        assert dry.strip() == shown[0].strip(), f"{page.name}: the dry run now prints\n{dry}"
