import re
import subprocess
import sys

import pytest
import yaml
from doc_commands import DOCS, doc_pages, run_page_commands

from helpers import ROOT
from shardlm.config import load_config
from shardlm.docs import readme_block


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


# The two slowest pages run in files of their own, so that `pytest --dist loadfile` runs them beside this file's
# pages instead of after them on the same worker: finetune.md (three trainings over GPT-2's vocabulary) in
# tests/test_docs_finetune.py, chat.md (chat_tiny's training, eval --exact-match, generate --chat) in test_docs_chat.py.
OWN_FILES = {"finetune.md": "test_docs_finetune.py", "chat.md": "test_docs_chat.py"}
DOC_PAGES = [p for p in doc_pages() if p.name not in OWN_FILES]


def test_pages_in_files_of_their_own_are_run_there():
    for page, test_file in OWN_FILES.items():
        assert f'DOCS / "{page}"' in (ROOT / "tests" / test_file).read_text(), (page, test_file)


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_doc_page_commands_run_as_written(page, tmp_path, corpus, cache_dir):
    run_page_commands(page, tmp_path, corpus, cache_dir)


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
