"""The config reference table in docs/config.md, generated from the dataclasses (a test fails on drift).

Regenerate with: python -m shardlm.docs --write
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from shardlm.config import KEY_ALIASES, Config, all_keys, to_flat_dict
from shardlm.config import schema as config_module

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _comments() -> dict[str, str]:
    """Trailing `# comment` of each field line in config.py, by section class and field name."""
    found, section = {}, None
    for line in inspect.getsource(config_module).splitlines():
        if m := re.match(r"class (\w*)Config:", line):
            section = m.group(1).lower() if m.group(1) else None
        elif m := re.match(r"    (\w+): [^=]+= (.+?)(?:\s+# (.*))?$", line):
            found[f"{section}.{m.group(1)}" if section else m.group(1)] = m.group(3) or ""
    return found


def config_reference() -> str:
    defaults = to_flat_dict(Config())
    public = {v: k for k, v in KEY_ALIASES.items()}
    comments = _comments()
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, field in all_keys().items():
        value = defaults[key]
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value) \
            if isinstance(value, str) else str(value)
        cells = [f"`{public.get(key, key)}`", str(field.type), f"`{shown}`", comments.get(key, "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def readme_block() -> str:
    return f"{BEGIN}\n{config_reference()}\n{END}"


def main() -> None:
    if "--write" not in sys.argv:
        print(config_reference())
        return
    readme = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    text = readme.read_text()
    readme.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: readme_block(), text, flags=re.S))


if __name__ == "__main__":
    main()
