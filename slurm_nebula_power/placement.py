"""Pure decisions of direct placement (node set `placement = "direct"`): which hosts a VM may go to (its
requirements, evaluated as oned's scheduler does), which one it goes to (pack), in what order the nodes go
(jobs first), and whether the user may deploy at all.

The host choice is `choose(rooms, candidates, needs, near)`: a function of the candidate hosts, so a filter
(a node set's NVLink or InfiniBand domain) can stand in front of it. The policy is to pack: a VM goes to a
host of its job if one has room, then to a host of its job's clusters, then to the host it fills most
(fewest matching devices left, then least CPU left). Packing leaves whole hosts free for the VMs that need
many devices, keeps a job's nodes on few hosts, and is what a GPU site asks of a batch system; spreading
would leave every host a device short of the next 8-GPU VM.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from .capacity import PciRequest, fit, pci_request
from .hosts import Host, PciDevice, VmNeeds
from .plan import nodes_by_job

T = TypeVar("T")

# ---- requirement expressions (oned's src/parsers/expr_bool.y) -------------------------------------------


class Unsupported(ValueError):
    """What placement cannot evaluate or honour: the node set is left to oned's scheduler."""


_TOKEN = re.compile(r'\s*(?:(?P<float>-?[0-9]+\.[0-9]+)|(?P<int>-?[0-9]+)|(?P<word>[A-Za-z][0-9A-Za-z_]*)'
                    r'|"(?P<quoted>[^"]*)"|(?P<op>[@!&|=<>()]))')
Predicate = Callable[[Host], bool]
MOST_TOKENS = 1000
MOST_NESTING = 32


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        found = _TOKEN.match(text, pos)
        if found is None or found.end() == pos:
            raise Unsupported(f"cannot read {text[pos:pos + 20]!r}")
        pos = found.end()
        kind = found.lastgroup or ""
        out.append((kind, found.group(kind) or ""))
        if len(out) > MOST_TOKENS:
            raise Unsupported("too long")
    return out


def requirement(text: str) -> Predicate:
    """A requirement expression as a test of a host; Unsupported for one we cannot evaluate as oned does.

    oned's grammar: comparisons `ATTR = 5`, `ATTR != "x*"` (shell wildcards), `ATTR > 1.5`, `ATTR < 2`,
    `ATTR @> 3` (any value of a multi-valued attribute), joined by `&` and `|`, negated by `!`, grouped by
    parentheses; `&`, `|` and `!` have one precedence, left to right. An empty expression holds. A host
    without the attribute fails every comparison, `!=` included (use `!(ATTR = x)` to accept it).
    """
    tokens = _tokens(text)
    if not tokens:
        return lambda host: True
    parser = _Parser(tokens)
    test = parser.expression()
    if parser.pos != len(tokens):
        raise Unsupported(f"unexpected {tokens[parser.pos][1]!r}")
    return test


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0  # of `!` and parentheses: bounded, so a hostile expression cannot exhaust the stack

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token[0] == "end":
            raise Unsupported("ends too early")
        self.pos += 1
        return token

    def expression(self) -> Predicate:
        left = self.unary()
        while self.peek() in (("op", "&"), ("op", "|")):
            _, op = self.take()
            right = self.unary()
            left = _and(left, right) if op == "&" else _or(left, right)
        return left

    def unary(self) -> Predicate:
        kind, value = self.take()
        if (kind, value) in (("op", "!"), ("op", "(")):
            self.depth += 1
            if self.depth > MOST_NESTING:
                raise Unsupported(f"nesting deeper than {MOST_NESTING}")
            inner = self.unary() if value == "!" else self.expression()
            if value == "(" and self.take() != ("op", ")"):
                raise Unsupported("unbalanced parentheses")
            self.depth -= 1
            return (lambda host: not inner(host)) if value == "!" else inner
        if kind not in ("word", "quoted"):
            raise Unsupported(f"unexpected {value!r}")
        return self.comparison(value)

    def comparison(self, name: str) -> Predicate:
        if not name or "/" in name or name == "CURRENT_VMS":
            raise Unsupported(f"attribute {name!r}")  # xpaths and oned's pseudo-attribute of running VMs
        op = self.take()[1]
        if op in ("!", "@"):
            op += self.take()[1]
        if op not in ("=", "!=", ">", "<", "@>"):
            raise Unsupported(f"operator {op!r}")
        kind, value = self.take()
        if kind in ("int", "float"):
            number = float(value)
            return _numeric(name, op, number, int if kind == "int" else float)
        if kind not in ("word", "quoted") or op in (">", "<"):
            raise Unsupported(f"{op} {value!r}")
        return _text(name, op, value if kind == "word" or value else None)


def _and(a: Predicate, b: Predicate) -> Predicate:
    return lambda host: a(host) and b(host)


def _or(a: Predicate, b: Predicate) -> Predicate:
    return lambda host: a(host) or b(host)


_LEADING = {int: re.compile(r"\s*[-+]?[0-9]+"), float: re.compile(r"\s*[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)")}
MOST_DIGITS = 18  # a longer integer overflows C++'s extraction (the value is skipped), and int() refuses 4,300


def _numbers(values: Iterable[str], kind: type) -> list[float]:
    """The values as C++'s stream extraction reads them (a leading number; values without one, or an integer
    too long for it, are skipped)."""
    out = []
    for value in values:
        found = _LEADING[kind].match(value)
        if found and (kind is float or len(found.group().strip().lstrip("+-")) <= MOST_DIGITS):
            out.append(float(int(found.group())) if kind is int else float(found.group()))
    return out


def _numeric(name: str, op: str, wanted: float, kind: type) -> Predicate:
    def test(host: Host) -> bool:
        values = _numbers(host.attribute(name), kind)
        if op == "@>":
            return wanted in values
        if not values:
            return False
        first = values[0]
        return {"=": first == wanted, "!=": first != wanted, ">": first > wanted, "<": first < wanted}[op]
    return test


def _text(name: str, op: str, pattern: str | None) -> Predicate:
    def test(host: Host) -> bool:
        values = host.attribute(name)
        if pattern is None or not values:
            return False
        if op == "@>":
            return any(fnmatch.fnmatchcase(v, pattern) for v in values)
        matched = fnmatch.fnmatchcase(values[0], pattern)
        return matched if op == "=" else not matched
    return test


# The system datastore part we can honour: deploy with ds -1 takes the host's cluster's default system DS.
_CLUSTER_DS = re.compile(r'"CLUSTERS/ID"\s*@>\s*-?[0-9]+|[()|&\s]')


def candidates(hosts: Iterable[Host], needs: VmNeeds) -> list[Host]:
    """The hosts a VM may be deployed to: taking VMs (MONITORED) and meeting its requirements (oned's
    automatic ones from its networks' and images' clusters, and the template's SCHED_REQUIREMENTS).
    Unsupported when it asks for what only oned's scheduler does (VM groups, networks it picks, NUMA
    pinning, a chosen system datastore)."""
    if needs.vm_group:
        raise Unsupported("VMGROUP affinity")
    if needs.auto_nics:
        raise Unsupported('a NIC with NETWORK_MODE = "auto"')
    if needs.pinned:
        raise Unsupported("TOPOLOGY with a PIN_POLICY")
    if needs.sched_ds_requirements:
        raise Unsupported("SCHED_DS_REQUIREMENTS")
    if _CLUSTER_DS.sub("", needs.ds_requirements):
        raise Unsupported(f"AUTOMATIC_DS_REQUIREMENTS {needs.ds_requirements!r}")
    tests = [requirement(needs.requirements), requirement(needs.sched_requirements)]
    return [host for host in hosts if host.placeable and all(test(host) for test in tests)]


# ---- the host choice -----------------------------------------------------------------------------------


def requests_of(needs: VmNeeds) -> tuple[PciRequest, ...]:
    """What each of the VM's PCI entries asks of a host device."""
    return tuple(pci_request(p) for p in needs.pci)


class Rooms:
    """The room of the hosts as this run read it once, taken VM by VM as resume places them."""

    def __init__(self, hosts: Iterable[Host]) -> None:
        self.hosts = {h.id: h for h in hosts}
        self._cpu = {h.id: h.cpu_free for h in self.hosts.values()}
        self._memory = {h.id: h.memory_free_kb for h in self.hosts.values()}
        self._free = {h.id: [d for d in h.devices if d.free] for h in self.hosts.values()}
        self._matching: dict[tuple[int, tuple[PciRequest, ...]], list[PciDevice]] = {}

    def matching(self, host: int, requests: tuple[PciRequest, ...]) -> list[PciDevice]:
        """The host's free devices that serve any of these requests (kept per host and requests)."""
        key = (host, requests)
        found = self._matching.get(key)
        if found is None:
            found = self._matching[key] = [d for d in self._free.get(host, ()) if any(r.matches(d) for r in requests)]
        return found

    def fits(self, host: int, needs: VmNeeds) -> list[PciDevice] | None:
        """The devices the VM would get here, or None: CPU, memory or a device is missing (oned's enforce)."""
        cpu, memory = self._cpu.get(host), self._memory.get(host)
        if host not in self.hosts or (cpu is not None and cpu < needs.cpu) or (
                memory is not None and memory < needs.memory_kb):
            return None
        requests = requests_of(needs)
        return fit(self.matching(host, requests), requests) if requests else []

    def take(self, host: int, needs: VmNeeds, devices: Sequence[PciDevice]) -> None:
        """Reserve the VM's share of the host."""
        cpu, memory = self._cpu.get(host), self._memory.get(host)
        if cpu is not None:
            self._cpu[host] = cpu - needs.cpu
        if memory is not None:
            self._memory[host] = memory - needs.memory_kb
        for (key_host, _), found in self._matching.items():
            if key_host == host:
                found[:] = [d for d in found if d not in devices]
        self._free[host] = [d for d in self._free.get(host, ()) if d not in devices]

    def drop(self, host: int) -> None:
        """oned refused a VM there: this run's view of the host was wrong; nothing more goes there."""
        self.hosts.pop(host, None)

    def room(self, host: int, needs: VmNeeds) -> int:
        """How many more VMs of these needs fit on the host (its devices, CPU and memory)."""
        requests = requests_of(needs)
        counts = [len(self.matching(host, requests)) // len(requests)] if requests else []
        cpu, memory = self._cpu.get(host), self._memory.get(host)
        if cpu is not None and needs.cpu > 0:
            counts.append(cpu // needs.cpu)
        if memory is not None and needs.memory_kb > 0:
            counts.append(memory // needs.memory_kb)
        return max(0, min(counts, default=1 << 20))

    def cpu_left(self, host: int) -> int:
        """CPU units left (a large number when the host does not say)."""
        cpu = self._cpu.get(host)
        return 1 << 40 if cpu is None else cpu


def choose(rooms: Rooms, candidates: Sequence[Host], needs: VmNeeds, near: Mapping[int, int] | None = None,
           want: int = 1) -> tuple[Host, list[PciDevice]] | None:
    """The host for one VM among the candidates, with the devices it gets there, or None when none has room.

    Pack, a job together: `near` (host id -> VMs of the same job there) first, most of the job first; then a
    host in one of those hosts' clusters; then the host that takes most of the `want` VMs of the job still
    to place (all of them if it can); then the one left fullest (fewest VMs of this kind could still go
    there, then least CPU left); then the lowest id. Nothing is reserved: the caller takes it from the rooms."""
    near = near or {}
    clusters = {rooms.hosts[h].cluster_id for h in near if h in rooms.hosts}
    best: tuple[tuple[int, bool, int, int, int, int], Host, list[PciDevice]] | None = None
    for host in candidates:
        devices = rooms.fits(host.id, needs)
        if devices is None:
            continue
        room = rooms.room(host.id, needs)
        takes = min(room, want)
        key = (-near.get(host.id, 0), host.cluster_id not in clusters, -takes, room - takes,
               rooms.cpu_left(host.id) - needs.cpu, host.id)
        if best is None or key < best[0]:
            best = (key, host, devices)
    return None if best is None else (best[1], best[2])


# ---- jobs first ---------------------------------------------------------------------------------------


def jobs_first(items: Sequence[T], jobs: Mapping[str, Sequence[int]], node: Callable[[T], str]) -> list[T]:
    """The items (one per node) with the nodes of the resume file's earliest jobs first, those resumed for no
    job last; otherwise in their order."""
    rank = {job: index for index, job in enumerate(nodes_by_job(jobs))}
    last = len(rank)
    return sorted(items, key=lambda item: min((rank.get(j, last) for j in jobs.get(node(item), ())), default=last))


# ---- the right to deploy ------------------------------------------------------------------------------

LEVELS = ("ADMIN", "MANAGE", "USE")  # oned's order: the first set naming the operation decides


def operations(text: str) -> set[str]:
    """An oned.conf VM_*_OPERATIONS value as a set of operation names."""
    return {part.strip().lower() for part in text.split(",") if part.strip()}


def deploy_level(user: Mapping[str, str], group: Mapping[str, str], system: Mapping[str, str],
                 operation: str = "deploy") -> str:
    """The level (ADMIN, MANAGE, USE) one.vm.deploy (or another VM `operation`, e.g. recover) asks of the VM:
    the user's template first, then the primary group's, then oned.conf (RequestAttributes::set_auth_op), each
    a map level -> operations text (VM_ADMIN_OPERATIONS...). oned.conf as shipped: ADMIN for both."""
    for source in (user, group, system):
        for level in LEVELS:
            if operation in operations(source.get(level, "")):
                return level
    return "ADMIN"
