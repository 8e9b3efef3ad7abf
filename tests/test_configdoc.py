"""docs/configuration.md's reference of every key is made from the code's schema and the example's comments
(slurm_nebula_power/configdoc.py): it cannot drift from what the loader accepts (issue 25)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from slurm_nebula_power import configdoc
from slurm_nebula_power.config import NODESET_OPTIONS, SCHEMA

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_example_says_what_every_key_the_loader_accepts_is_for() -> None:
    said = configdoc.descriptions(configdoc.example_text())
    keys = [(section, key) for section, table in SCHEMA.items() for key in table]
    keys += [("nodeset", key) for key in NODESET_OPTIONS]
    assert [k for k in keys if not said.get(k)] == [], "add a comment above the key in etc/nebula-power.toml"
    known = set(keys)
    assert [k for k in said if k not in known] == [], "the example documents a key the loader refuses"


def test_the_example_loads_as_toml() -> None:
    tomllib.loads(configdoc.example_text())


def test_the_reference_in_docs_is_what_the_code_makes() -> None:
    text = DOC.read_text(encoding="utf-8")
    generated = text.partition(configdoc.BEGIN)[2].partition(configdoc.END)[0]
    assert generated == "\n" + configdoc.reference(), \
        "docs/configuration.md is stale: run python -m slurm_nebula_power.configdoc docs/configuration.md"


def test_a_key_added_to_the_schema_shows_in_the_reference(monkeypatch) -> None:
    from slurm_nebula_power.schema import Key

    monkeypatch.setitem(SCHEMA["power"], "brand_new", Key((int,), 7))
    assert "| `brand_new` | integer | `7` |" in configdoc.reference()
