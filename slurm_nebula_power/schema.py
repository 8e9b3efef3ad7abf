"""A TOML table read against its keys: each key's types, default and check; every error names the file and
the key (config.py holds the keys)."""

from __future__ import annotations

import os
import ssl
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .errors import ConfigError

REQUIRED = object()
CA_FILE_CAP = 1 << 20  # bytes of ca_file looked at for a PEM certificate (every public CA is ~220 KB)


@dataclass(frozen=True)
class Key:
    """One configuration key: its types, default and an optional extra check."""

    types: tuple[type, ...]
    default: Any = REQUIRED
    check: Callable[[Any], str | None] | None = None


def positive(value: Any) -> str | None:
    """A number above 0."""
    return None if value > 0 else "must be greater than 0"


def one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    """One of these strings."""

    def check(value: Any) -> str | None:
        return None if value in choices else "must be one of " + ", ".join(repr(c) for c in choices)

    return check


def absolute(value: Any) -> str | None:
    """An absolute path."""
    return None if os.path.isabs(value) else "must be an absolute path"


class Reader:
    """Validates one table against its schema, naming file and key in every error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {problem}")

    def table(self, data: Any, name: str, schema: Mapping[str, Key], extra: Mapping[str, Key] = {}) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise self.fail(name, "must be a table")
        out: dict[str, Any] = {}
        known = {**schema, **extra}
        for key in data:
            if key not in known:
                raise self.fail(f"{name}.{key}", "unknown key; remove it or check its spelling (known: "
                                + ", ".join(sorted(known)) + ")")
        for key, spec in known.items():
            dotted = f"{name}.{key}"
            if key not in data:
                if spec.default is REQUIRED:
                    raise self.fail(dotted, "missing; add it (see `slurm-nebula-power example-config`)")
                out[key] = spec.default
                continue
            value: Any = data[key]
            # bool is an int subclass in Python; TOML keeps them apart, so do we.
            if (isinstance(value, bool) and bool not in spec.types) or not isinstance(value, spec.types):
                raise self.fail(dotted, f"must be {_kind(spec.types)}, not {_kind((type(value),))} {value!r}")
            problem = spec.check(value) if spec.check else None
            if problem:
                raise self.fail(dotted, f"{problem} (got {value!r})")
            out[key] = float(cast(float, value)) if float in spec.types and not isinstance(value, str) else value
        return out


def ca_bundle(reader: Reader, path: Path, verify: bool) -> Path:
    """[opennebula] ca_file, checked at load rather than at the first call: a regular file, readable, holding
    at least one PEM certificate; https_verify = false verifies nothing, so both set is an error."""
    key, fix = "opennebula.ca_file", "give the PEM file of the CA that issued the front end's certificate"
    if not verify:
        raise reader.fail(key, "set with https_verify = false, which trusts any certificate: remove one of them")
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise reader.fail(key, f"{path} is not a regular file; {fix}")
        with path.open("rb") as handle:
            text = handle.read(CA_FILE_CAP)
    except OSError as exc:
        raise reader.fail(key, f"cannot read {path}: {exc.strerror}; {fix}, readable by SlurmUser") from None
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, ValueError, OSError):
        problem = "holds no PEM certificate" if b"-----BEGIN CERTIFICATE-----" not in text else \
            "holds a PEM certificate that does not parse"
        raise reader.fail(key, f"{path} {problem}; {fix} (-----BEGIN CERTIFICATE----- ...)") from None
    return path


def _kind(types: tuple[type, ...]) -> str:
    if float in types:
        return "a number"
    names = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "a table"}
    return " or ".join(names.get(t, t.__name__) for t in types)
