"""SCHED_REQUIREMENTS as oned's scheduler evaluates them against a host (src/parsers/expr_bool.y and
expr_parser.l): `ATTR = value`, `!=`, `>`, `<`, `@>` (a listed value), `&`, `|`, `!` and parentheses, all
three operators of one precedence and left-associative as oned's grammar declares them; a quoted or bare
value is compared with fnmatch (so `"nvl*"` is a pattern), a number as a number. ATTR is a top-level HOST
element (ID, NAME, STATE, CLUSTER_ID) or a HOST/TEMPLATE attribute (what `onehost update` sets)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping

_TOKEN = re.compile(r'\s*(?:(?P<op>[@!&|=<>()])|(?P<str>[A-Za-z][0-9A-Za-z_]*)|"(?P<q>[^"]*)"'
                    r'|(?P<float>-?[0-9]+\.[0-9]+)|(?P<int>-?[0-9]+))')


class RequirementError(ValueError):
    """An expression oned's parser refuses (`syntax error`)."""


def _tokens(text: str) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise RequirementError("syntax error")
        pos = match.end()
        kind = match.lastgroup or ""
        value: object = match.group(kind)
        if kind == "q":
            kind, value = "str", value or None  # "" is no value: it matches nothing
        elif kind == "int":
            value = int(str(value))
        elif kind == "float":
            value = float(str(value))
        out.append((kind, value))
    return out


def matches(expression: str, host: Mapping[str, str]) -> bool:
    """Whether `host` (its attributes by name) meets `expression`; an empty expression is met by every host."""
    tokens = _tokens(expression)
    if not tokens:
        return True
    value, rest = _expr(tokens, host)
    if rest:
        raise RequirementError("syntax error")
    return value


Tokens = list[tuple[str, object]]


def _expr(tokens: Tokens, host: Mapping[str, str]) -> tuple[bool, Tokens]:
    """unit (('&' | '|') unit)*, folded left to right: oned declares `%left '!' '&' '|'`."""
    value, rest = _unit(tokens, host)
    while rest and rest[0] in (("op", "&"), ("op", "|")):
        operator = rest[0][1]
        right, rest = _unit(rest[1:], host)
        value = (value and right) if operator == "&" else (value or right)
    return value, rest


def _unit(tokens: Tokens, host: Mapping[str, str]) -> tuple[bool, Tokens]:
    if not tokens:
        raise RequirementError("syntax error")
    if tokens[0] == ("op", "!"):
        value, rest = _unit(tokens[1:], host)
        return not value, rest
    if tokens[0] == ("op", "("):
        value, rest = _expr(tokens[1:], host)
        if not rest or rest[0] != ("op", ")"):
            raise RequirementError("syntax error")
        return value, rest[1:]
    return _comparison(tokens, host)


def _comparison(tokens: Tokens, host: Mapping[str, str]) -> tuple[bool, Tokens]:
    if tokens[0][0] != "str" or tokens[0][1] is None or len(tokens) < 3:
        raise RequirementError("syntax error")
    name = str(tokens[0][1])
    ops = {(("op", "=")): "=", (("op", "<")): "<", (("op", ">")): ">"}
    if tokens[1] == ("op", "!") and tokens[2] == ("op", "="):
        operator, rest = "!=", tokens[3:]
    elif tokens[1] == ("op", "@") and tokens[2] == ("op", ">"):
        operator, rest = "@>", tokens[3:]
    elif tokens[1] in ops:
        operator, rest = ops[tokens[1]], tokens[2:]
    else:
        raise RequirementError("syntax error")
    if not rest or rest[0][0] not in ("str", "int", "float") or (operator in "<>" and rest[0][0] == "str"):
        raise RequirementError("syntax error")
    kind, wanted = rest[0]
    return _compare(host.get(name), operator, kind, wanted), rest[1:]


def _compare(have: str | None, operator: str, kind: str, wanted: object) -> bool:
    if have is None:
        return False  # oned's search found nothing: false whatever the operator
    if kind == "str":
        if wanted is None:
            return False
        hit = fnmatch.fnmatchcase(have, str(wanted))
        return not hit if operator == "!=" else hit
    try:
        number = int(have) if kind == "int" else float(have)
    except ValueError:
        return False
    target = float(str(wanted))
    return {"=": number == target, "!=": number != target, ">": number > target, "<": number < target,
            "@>": number == target}[operator]
