"""OpenNebula template syntax: the `KEY = "value"` / `KEY = [ A = "b" ]` string form and the XML form.

A template is a dict from attribute name to the list of its values (oned keeps a multimap: NIC, DISK and PCI
may repeat). A value is a string (single attribute) or a dict of strings (vector attribute).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

Value = str | dict[str, str]
Template = dict[str, list[Value]]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_BARE = re.compile(r"[^\s#\"\[\],=]+")
_VECTOR_BARE = re.compile(r"[^\s\"\[\],=]+")

# Top-level attributes oned keeps in a VM's TEMPLATE (share/doc/xsd/vm.xsd); every other attribute of the
# merged template ends up in USER_TEMPLATE.
VM_TEMPLATE_ATTRIBUTES = frozenset(
    """AUTOMATIC_DS_REQUIREMENTS AUTOMATIC_NIC_REQUIREMENTS AUTOMATIC_REQUIREMENTS CLONING_TEMPLATE_ID
    CONTEXT CPU CPU_COST DISK DISK_COST EMULATOR FEATURES HYPERV_OPTIONS GRAPHICS VIDEO IMPORTED INPUT
    MEMORY MEMORY_COST MEMORY_MAX MEMORY_SLOTS MEMORY_RESIZE_MODE NIC NIC_ALIAS NIC_DEFAULT NUMA_NODE OS
    PCI QEMU_GA_EXEC RAW SECURITY_GROUP_RULE SNAPSHOT SPICE_OPTIONS SUBMIT_ON_HOLD TEMPLATE_ID
    TM_MAD_SYSTEM TOPOLOGY TPM MEMORY_ENCRYPTION VCPU VCPU_MAX VMGROUP VMID VROUTER_ID
    VROUTER_KEEPALIVED_ID VROUTER_KEEPALIVED_PASSWORD""".split()
)


class TemplateSyntaxError(ValueError):
    """The text is not a valid OpenNebula template."""


def parse_template(text: str) -> Template:
    """Parse either template form; an empty string gives an empty template."""
    stripped = text.strip()
    if stripped.startswith("<"):
        return _parse_xml(stripped)
    return _Parser(text).parse()


def merge(base: Template, extra: Template) -> Template:
    """oned's Template::merge: each attribute named in `extra` replaces all of `base`'s values wholesale.

    An empty vector in `extra` removes the attribute (so `CONTEXT = []` drops the template's CONTEXT).
    """
    merged = {key: list(values) for key, values in base.items()}
    for key, values in extra.items():
        kept = [v for v in values if not (isinstance(v, dict) and not v)]
        merged.pop(key, None)
        if kept:
            merged[key] = kept
    return merged


def split_vm_template(tmpl: Template) -> tuple[Template, Template]:
    """Split a merged instantiate template into (TEMPLATE, USER_TEMPLATE) as oned does when it allocates."""
    vm: Template = {}
    user: Template = {}
    for key, values in tmpl.items():
        (vm if key in VM_TEMPLATE_ATTRIBUTES else user)[key] = values
    return vm, user


def first(tmpl: Template, key: str, default: str = "") -> str:
    """The first single value of `key` (vector values are skipped)."""
    for value in tmpl.get(key, ()):
        if isinstance(value, str):
            return value
    return default


def vectors(tmpl: Template, key: str) -> list[dict[str, str]]:
    """All vector values of `key` (NIC, PCI, ...)."""
    return [v for v in tmpl.get(key, ()) if isinstance(v, dict)]


def to_plain(tmpl: Template) -> dict[str, object]:
    """A snapshot shaped like pyone's dicts: one value -> the value, several -> a list."""
    out: dict[str, object] = {}
    for key, values in tmpl.items():
        copies = [dict(v) if isinstance(v, dict) else v for v in values]
        out[key] = copies[0] if len(copies) == 1 else copies
    return out


def _parse_xml(text: str) -> Template:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise TemplateSyntaxError(f"Error parsing XML template: {exc}") from None
    out: Template = {}
    for child in root:
        if len(child):
            vector = {sub.tag: (sub.text or "") for sub in child}
            out.setdefault(child.tag, []).append(vector)
        else:
            out.setdefault(child.tag, []).append(child.text or "")
    return out


class _Parser:
    """A small recursive-descent reader of oned's template grammar."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse(self) -> Template:
        out: Template = {}
        while True:
            self._skip(newlines=True, stray=True)
            if self.pos >= len(self.text):
                return out
            name = self._name()
            self._skip(newlines=False, stray=True)
            self._expect("=")
            self._skip(newlines=False)
            value: Value = self._vector() if self._peek() == "[" else self._single(_BARE)
            out.setdefault(name, []).append(value)

    def _vector(self) -> dict[str, str]:
        self.pos += 1  # '['
        vector: dict[str, str] = {}
        while True:
            self._skip(newlines=True, stray=True)
            if self._peek() == "]":
                self.pos += 1
                return vector
            name = self._name()
            self._skip(newlines=True, stray=True)
            self._expect("=")
            self._skip(newlines=True)
            vector[name] = self._single(_VECTOR_BARE)
            self._skip(newlines=True, stray=True)
            if self._peek() == ",":
                self.pos += 1
            elif self._peek() != "]":
                self._fail("expecting COMMA or CBRACKET")

    def _single(self, bare: re.Pattern[str]) -> str:
        if self._peek() == '"':
            return self._quoted()
        match = bare.match(self.text, self.pos)
        if match is None:
            return ""  # `KEY =` followed by a newline: oned's EQUAL_EMPTY, an empty value
        self.pos = match.end()
        return match.group()

    def _quoted(self) -> str:
        self.pos += 1
        chunks: list[str] = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\\" and self.text[self.pos + 1 : self.pos + 2] in ('"', "\\"):
                chunks.append(self.text[self.pos + 1])
                self.pos += 2
            elif char == '"':
                self.pos += 1
                return "".join(chunks)
            else:
                chunks.append(char)
                self.pos += 1
        self._fail("unterminated string")
        raise AssertionError("unreachable")

    def _name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if match is None:
            self._fail("expecting VARIABLE")
            raise AssertionError("unreachable")
        self.pos = match.end()
        return match.group().upper()

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            self._fail("expecting EQUAL")
        self.pos += 1

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _skip(self, newlines: bool, stray: bool = False) -> None:
        """Skip blanks and comments; with `stray` (outside a value, oned's lexer state INITIAL) also the
        characters no rule of oned's lexer matches there, which flex's default rule drops: a `"` after a vector
        (OneGate's escaping of `CONTEXT=[A=b]` + newline makes `CONTEXT=[A="b"]"`) is ignored as oned ignores it."""
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif char in " \t\r" or (newlines and char == "\n"):
                self.pos += 1
            elif stray and not (char.isalnum() or char in "_-=,[]#\n"):
                self.pos += 1
            else:
                return

    def _fail(self, expecting: str) -> None:
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        found = repr(self._peek()) if self._peek() else "end of template"
        raise TemplateSyntaxError(
            f"Parse error: syntax error, unexpected {found}, {expecting} at line {line}, column {column}"
        )
