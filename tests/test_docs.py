import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_readme import runnable, small_overrides

from shardlm.config import load_config
from shardlm.docs import readme_block

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# A guide whose commands are shown at their real size (a GPU config, 4 or 8 ranks) carries this line; its
# `shardlm train`/`tune` commands then run with tests/test_readme.py's tiny overrides and at most 2 ranks.
TINY_RUNS = "<!-- test_docs: tiny runs"


def test_config_reference_matches_code():
    assert readme_block() in (DOCS / "config.md").read_text(), "run: python -m shardlm.docs --write"


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


DOC_PAGES = sorted(p for p in DOCS.glob("*.md") if "```bash" in p.read_text())


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_doc_page_commands_run_as_written(page, tmp_path, corpus, cache_dir):
    """Each line of a docs page's bash blocks runs, in order, in a fresh folder (offline, on the CPU); the
    page's first `text` block is the output of its first dry run, so the page shows what the command prints.
    On a page marked TINY_RUNS, train/tune commands get the README test's tiny overrides (`configs/` is there)."""
    text = page.read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "SHARDLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    tiny_runs = TINY_RUNS in text
    if tiny_runs:
        (tmp_path / "configs").symlink_to(ROOT / "configs")
    small = small_overrides(corpus, cache_dir)
    outputs = []
    for argv in (shlex.split(line, comments=True) for line in lines):
        if not argv:
            continue
        if tiny_runs:
            cmd = runnable(argv, small)
            assert cmd is not None, f"{page.name}: {shlex.join(argv)} is not run"
        else:
            cmd = [*{"shardlm": [sys.executable, "-m", "shardlm"], "python": [sys.executable]}[argv[0]], *argv[1:]]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{page.name}: {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
        outputs.append((argv, proc.stdout))
    shown = re.findall(r"```text\n(.*?)```", text, re.S)
    dry = next((out for argv, out in outputs if "--dry-run" in argv), None)
    if shown and dry is not None:
        assert dry.strip() == shown[0].strip(), f"{page.name}: the dry run now prints\n{dry}"


def test_mkdocs_nav_lists_every_page():
    """mkdocs.yml's nav names every docs page (a page left out is not reachable), and each exists."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(items):
        for item in items:
            value = item if isinstance(item, str) else next(iter(item.values()))
            yield from pages(value) if isinstance(value, list) else [value]

    listed = list(pages(nav))
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md")), listed


def test_readme_links_resolve():
    """The README is a door into docs/: each relative link names a file of the checkout."""
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_mkdocs_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page missing from nav, fails (mkdocs-material)."""
    pytest.importorskip("material")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
