"""Running a docs page's bash lines as written (tests/test_docs.py and tests/test_docs_finetune.py, which runs the
slowest page in a file of its own so that `pytest --dist loadfile` runs it beside the others)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from test_readme import runnable, small_overrides

from helpers import ROOT, run_command

DOCS = ROOT / "docs"
# A guide whose commands are shown at their real size (a GPU config, 4 or 8 ranks) carries this line; its
# `shardlm train`/`tune` commands then run with tests/test_readme.py's tiny overrides and at most 2 ranks.
TINY_RUNS = "<!-- test_docs: tiny runs"


def doc_pages() -> list[Path]:
    """The docs pages with a bash block."""
    return sorted(p for p in DOCS.glob("*.md") if "```bash" in p.read_text())


def run_page_commands(page: Path, tmp_path: Path, corpus: Path, cache_dir: Path) -> None:
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
        proc = run_command(cmd, env, 300, tmp_path)
        assert proc.returncode == 0, f"{page.name}: {shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
        outputs.append((argv, proc.stdout))
    shown = re.findall(r"```text\n(.*?)```", text, re.S)
    dry = next((out for argv, out in outputs if "--dry-run" in argv), None)
    if shown and dry is not None:
        assert dry.strip() == shown[0].strip(), f"{page.name}: the dry run now prints\n{dry}"
