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


def _modules() -> list[tuple[str, str]]:
    """(package folder relative to shardlm/, e.g. '' or 'training/optim/', module file name) of every module."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "assets" or path.name == "__init__.py":
            continue
        folder = "".join(f"{p}/" for p in rel.parts[:-1])
        found.append((folder, path.name))
    return found


def _design_sections() -> dict[str, str]:
    """docs/design.md's sections by the package folder their heading names ('' for the top level)."""
    text = (ROOT / "docs" / "design.md").read_text()
    sections: dict[str, str] = {}
    for chunk in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = chunk.partition("\n")
        folder = re.search(r"`([\w/]+/)`", heading)
        sections["" if heading.startswith("Top level") else folder.group(1) if folder else heading] = body
    return sections


def _readme_layout() -> dict[str, set[str]]:
    """README's Layout block: the module names listed on each package folder's line."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    listed: dict[str, set[str]] = {}
    folder = ""
    for line in block.splitlines():
        words = line.split()
        if words and words[0].endswith("/"):  # a package's line; one without a folder goes on the one above
            folder, words = ("" if words[0] == "shardlm/" else words[0]), words[1:]
        listed.setdefault(folder, set()).update(words)
    return listed


def test_every_module_has_its_line_in_the_design_page_and_the_readme_layout():
    """A module added (or moved) without its one line in docs/design.md and its name in the README's Layout fails
    here: the two pages are where a newcomer looks for 'where is X'."""
    sections, layout = _design_sections(), _readme_layout()
    missing = [f"docs/design.md: `{name}` under `{folder or 'Top level'}`" for folder, name in _modules()
               if f"`{name}`" not in sections.get(folder, "")]
    missing += [f"README.md Layout: {name} on the `shardlm/{folder}` line" for folder, name in _modules()
                if name not in layout.get(folder, set())]
    assert not missing, "modules without their line:\n" + "\n".join(missing)


def _contract_layers() -> list[set[str]]:
    import tomllib

    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    return [{name.strip().removeprefix("shardlm.") for name in layer.split("|")} for layer in contract["layers"]
            if layer.strip() != "shardlm.__main__"]


def _layer_line(text: str) -> list[set[str]]:
    """The `a | b -> c -> ...` line (two lines in a code block) as a list of layers, top first."""
    arrows = next(block for block in text.split("```")[1::2] if "->" in block and "cli" in block)
    arrows = " ".join(line.strip() for line in arrows.splitlines() if "->" in line)
    return [{name.strip() for name in layer.split("|")} for layer in arrows.split("->") if layer.strip()]


@pytest.mark.parametrize("page", ["README.md", "docs/design.md"])
def test_the_layer_line_is_the_import_linter_contract(page):
    """The pages' layer line is the contract lint-imports enforces, so it cannot drift (it said `training |
    inference` after inference had begun to import training)."""
    assert _layer_line((ROOT / page).read_text()) == _contract_layers()
