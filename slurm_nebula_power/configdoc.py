"""The reference of every configuration key, made from the code's schema (config.SCHEMA, NODESET_OPTIONS:
type, default, constraint) and the example configuration's comments (what each key is for), so neither the
docs nor the example can drift from what the loader accepts (tests/test_configdoc.py).

    python -m slurm_nebula_power.configdoc docs/configuration.md     # rewrites the generated part
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from .config import NODESET_OPTIONS, SCHEMA
from .schema import REQUIRED, Key

BEGIN = "<!-- every key: generated, do not edit -->"
END = "<!-- end of every key -->"
_KEY_LINE = re.compile(r"^#?\s*([a-z_]+)\s*=\s*(?:\"[^\"]*\"|[^#]*?)\s*(?:#\s*(.*))?$")
SECTIONS = {"opennebula": "[opennebula]", "slurm": "[slurm]", "log": "[log]", "power": "[power]",
            "nodeset": "[[nodeset]]"}


def example_text() -> str:
    """The example configuration installed with the package (etc/nebula-power.toml)."""
    return resources.files("slurm_nebula_power").joinpath("examples/nebula-power.toml").read_text("utf-8")


def descriptions(text: str) -> dict[tuple[str, str], str]:
    """(section, key) -> what the example's comments say of it: the comment lines just above the key's
    line (set or commented out) and the comment at its end."""
    found: dict[tuple[str, str], str] = {}
    section, prose = "", list[str]()
    for raw in text.splitlines():
        line = raw.strip()
        header = re.fullmatch(r"\[\[?([a-z_]+)\]\]?", line)
        if header:
            section, prose = header.group(1), []
            continue
        match = _KEY_LINE.match(line)
        if match and section:
            key, trailing = match.group(1), match.group(2)
            said = " ".join([*prose, trailing or ""]).strip()
            if said and (section, key) not in found:
                found[(section, key)] = said
            prose = []
        elif line.startswith("#") and section:
            prose.append(line.lstrip("#").strip())
        else:
            prose = []
    return found


def _type(spec: Key) -> str:
    if float in spec.types:
        return "number"
    names = {int: "integer", str: "string", bool: "boolean"}
    return " or ".join(names.get(t, t.__name__) for t in spec.types)


def _default(spec: Key) -> str:
    if spec.default is REQUIRED:
        return "**required**"
    if spec.default is None:
        return "unset"
    if isinstance(spec.default, bool):
        return f"`{str(spec.default).lower()}`"
    if isinstance(spec.default, str):
        return f'`"{spec.default}"`'
    value = spec.default
    return f"`{int(value) if isinstance(value, float) and value.is_integer() else value}`"


def _constraint(spec: Key) -> str:
    """What the key's check demands, in the check's own words (it is asked about a value that fails)."""
    if spec.check is None:
        return ""
    probe: Any = "\0" if str in spec.types else -1.0
    said = spec.check(probe)
    return (said or "").removeprefix("must be ").removeprefix("must ")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference(text: str | None = None) -> str:
    """The markdown tables of every key, one per section, node set options last."""
    said = descriptions(example_text() if text is None else text)
    out: list[str] = []
    tables: list[tuple[str, str, Mapping[str, Key]]] = [
        (name, SECTIONS[name], keys) for name, keys in SCHEMA.items()]
    tables.append(("nodeset", "[[nodeset]] options for `template` and `slurm-conf`", NODESET_OPTIONS))
    for section, title, keys in tables:
        out += [f"### {title}", "", "| key | type | default | constraint | what it is |",
                "| --- | --- | --- | --- | --- |"]
        for key, spec in keys.items():
            out.append(f"| `{key}` | {_type(spec)} | {_default(spec)} | {_cell(_constraint(spec))} | "
                       f"{_cell(said.get((section, key), ''))} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def rewrite(path: Path) -> bool:
    """Put the reference between the markers of a markdown file; True when the file changed."""
    text = path.read_text(encoding="utf-8")
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers")
    new = f"{head}{BEGIN}\n{reference()}{END}{tail}"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: {'rewritten' if rewrite(Path(name)) else 'up to date'}")
