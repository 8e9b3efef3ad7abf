"""The retrying OpenNebula client: every call of the programs goes through OneCloud.call (tenacity)."""

from __future__ import annotations

import logging
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

from .config import OneConfig
from .errors import CloudError, TransientCloudError, Unanswered, UnreadableAnswer, VmNotFound
from .grants import Rights, config_levels, group_levels, user_from_xml
from .hosts import Host, VmNeeds, host_gpus, hosts_from_xml, vm_needs_from_xml
from .model import Vm, refuse_doctype, vms_from_xml
from .onerpc import NO_EXISTS, OneRpc, ssl_context
from .owned import IMAGE, NETWORK, Kind, Owned, owned_from_xml

log = logging.getLogger(__name__)
T = TypeVar("T")


def _parsed(method: str, parse: Callable[[str], T], text: object) -> T:
    """An oned document parsed; a malformed one (truncated, a field that is not a number) is a failure of its
    call (UnreadableAnswer, not retried), never a crash of the program."""
    try:
        refuse_doctype(str(text))
        return parse(str(text))
    except (ET.ParseError, ValueError) as exc:
        raise UnreadableAnswer(f"[one.{method}] unreadable document: {str(exc)[:120]}") from None


def retryable(exc: BaseException) -> bool:
    """A failure worth another try: transient, and not an answer that came whole but cannot be parsed."""
    return isinstance(exc, TransientCloudError) and not isinstance(exc, UnreadableAnswer)


@dataclass
class CallStats:
    """Counts kept for the run summary."""

    calls: int = 0
    retries: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, calls: int = 0, retries: int = 0) -> None:
        with self.lock:
            self.calls += calls
            self.retries += retries


def stale_update(ready: bool, sched_message: bool) -> str:
    """The merge that clears a stopped VM's USER_TEMPLATE of its last boot: READY = "NO" (this boot must
    report its own READY=YES) and SCHED_MESSAGE = "" (a guest may write SCHED_MESSAGE through OneGate,
    onegate-server restricts only SCHED_REQUIREMENTS, SERVICE_ID and ROLE_NAME, and resume reads a PENDING
    VM's message as oned's scheduler saying no host can take it: a planted one handed the node back at
    pending_timeout with a Reason the guest wrote)."""
    return "\n".join([*(['READY = "NO"'] if ready else []), *(['SCHED_MESSAGE = ""'] if sched_message else [])])


class OneCloud:
    """OpenNebula through onerpc: one connection per thread, every call timed out and retried."""

    def __init__(self, config: OneConfig, sleep: Callable[[float], None] = time.sleep,
                 retry_seconds: float | None = None) -> None:
        self.config = config
        self.sleep = sleep
        self.retry_seconds = config.retry_seconds if retry_seconds is None else retry_seconds
        self.stats = CallStats()
        self.last_vms: list[Vm] | None = None  # the latest pool query's answer (the metrics' gauges)
        # when every call has failed since (monotonic), shared by the run's calls: once OpenNebula has not
        # answered for retry_seconds, a call tries once and fails, so a run with oned gone ends within about
        # retry_seconds rather than retry_seconds per call (142 calls once took 316 s to hand 4 nodes back)
        self.failing_since: float | None = None
        self._local = threading.local()
        self._tls = ssl_context(config.https_verify, config.ca_file) if config.endpoint.startswith("https") else None

    def _rpc(self) -> OneRpc:
        rpc: OneRpc | None = getattr(self._local, "rpc", None)
        if rpc is None:
            one = self.config
            rpc = self._local.rpc = OneRpc(one.endpoint, one.session, one.timeout, self._tls,
                                           int(one.max_answer_mb * (1 << 20)))
        return rpc

    def call(self, what: str, fn: Callable[[OneRpc], T], retry: bool = True,
             deadline: float | None = None) -> T:
        """Run one API call, retrying transient failures with exponential backoff and jitter."""
        started = time.monotonic()
        budget = self.retry_seconds
        if deadline is not None:
            budget = max(0.0, min(budget, deadline - started))
        if self.failing_since is not None:  # the outage's window is the run's, not each call's
            budget = max(0.0, min(budget, self.failing_since + self.retry_seconds - started))
        # The first attempt runs outside tenacity (its machinery costs ~45 us a call, and 1,000-node
        # runs make 1,000 calls that nearly all succeed at once); a transient failure is replayed
        # into the same schedule, so delays, budget, counts and log lines are as if tenacity ran it.
        try:
            return self._attempt(fn)
        except TransientCloudError as exc:
            if not retryable(exc):
                raise
            if self.failing_since is None:
                self.failing_since = started
            if not retry:
                raise
            self._give_up_when_unanswered(exc)
            failed = [exc]
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            stop=tenacity.stop_after_delay(max(0.0, budget - (time.monotonic() - started))),
            # retry_backoff, doubling up to 5 s, plus up to 2.5 x retry_backoff of jitter (spreads
            # the retries of many parallel calls that failed together)
            wait=tenacity.wait_exponential(multiplier=self.config.retry_backoff, max=5.0)
            + tenacity.wait_random(0, 2.5 * self.config.retry_backoff),
            sleep=self.sleep,
            reraise=True,
            before_sleep=self._before_sleep(what),
        )
        try:
            for attempt in retrying:
                with attempt:
                    if failed:
                        raise failed.pop()  # attempt 1, made above
                    return self._attempt(fn)
        except TransientCloudError as exc:
            self._give_up_when_unanswered(exc)
            raise
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    def _give_up_when_unanswered(self, exc: TransientCloudError) -> None:
        """Unanswered once nothing has answered for the run's whole retry window."""
        since = self.failing_since
        if since is not None and retryable(exc) and time.monotonic() >= since + self.retry_seconds:
            raise Unanswered(f"{exc} (no answer for {self.retry_seconds:g}s)") from None

    def _attempt(self, fn: Callable[[OneRpc], T]) -> T:
        """One try of a call; any answer, an error of oned's included, ends the run's window of failures."""
        self.stats.add(calls=1)
        try:
            value = fn(self._rpc())
        except TransientCloudError:
            raise
        except CloudError:
            self.failing_since = None
            raise
        self.failing_since = None  # OpenNebula answers again: the next failure starts a window of its own
        return value

    def _before_sleep(self, what: str) -> Callable[[tenacity.RetryCallState], None]:
        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.stats.add(retries=1)
            exc = state.outcome.exception() if state.outcome else None
            log.warning("retrying %s after attempt %d: %s", what, state.attempt_number, exc)

        return before_sleep

    # -- queries --

    def cluster_vms(self, cluster: str, first_id: int = -1) -> list[Vm]:
        """One pool query: our user's live VMs (not DONE), full bodies; identity is the caller's to check.

        Filter flag -3 (the caller's own VMs) keeps the answer small on a busy cloud.  oned's
        KEY=VALUE filter argument is not used: it is a MySQL full-text search that fails on SQLite
        front ends.  Every VM of the user is returned, so VMs named like our nodes that fail identity
        can be reported; a document that does not parse is a transient error, retried like any other.
        first_id >= 0: only the VMs whose id is first_id or above (oned's id range, open at the top), for a
        caller that needs only the VMs it has in flight (ids only grow); the metrics' gauges keep the VMs
        below it as last seen.
        """
        vms: list[Vm] = self.call("vmpool.infoextended",
                                  lambda s: _parsed("vmpool.infoextended", vms_from_xml,
                                                    s.call("vmpool.infoextended", -3, first_id, -1, -1)))
        if first_id < 0 or self.last_vms is None:
            self.last_vms = vms
        else:
            self.last_vms = [vm for vm in self.last_vms if vm.id < first_id] + vms
        return vms

    def vm(self, vm_id: int) -> Vm:
        """One VM's state now (one.vm.info); VmNotFound when oned has no such VM."""
        vms: list[Vm] = self.call(f"vm.info {vm_id}",
                                  lambda s: _parsed("vm.info", vms_from_xml, s.call("vm.info", vm_id, False)))
        if not vms:
            raise UnreadableAnswer(f"[one.vm.info] unreadable document: no VM {vm_id} in it")
        return vms[0]

    def host_gpus(self) -> tuple[int, int]:
        """(GPUs, free GPUs) on every host (one one.hostpool.info)."""
        return self.call("hostpool.info", lambda s: _parsed("hostpool.info", host_gpus, s.call("hostpool.info")))

    def hosts(self) -> list[Host]:
        """One host pool query: every host the user may see, with its state and PCI devices (VMID -1: free)."""
        return self.call("hostpool.info", lambda s: _parsed("hostpool.info", hosts_from_xml, s.call("hostpool.info")))

    def rights(self) -> Rights:
        """The user's groups and the VM operation levels set for it: its template, its primary group's, oned.conf's
        (one.user.info -1, one.group.info, one.system.config: each open to the user itself)."""
        uid, name, gid, groups, user = self.call("user.info", lambda s: _parsed(
            "user.info", user_from_xml, s.call("user.info", -1, False)))
        group = self.call(f"group.info {gid}", lambda s: _parsed(
            "group.info", group_levels, s.call("group.info", gid, False)))
        system = self.call("system.config", lambda s: _parsed("system.config", config_levels, s.call("system.config")))
        return Rights(uid, name, gid, groups, user, group, system)

    def host(self, host_id: int) -> Host:
        """One host now (one.host.info): far less than the host pool's document when only its state matters."""
        hosts: list[Host] = self.call(f"host.info {host_id}", lambda s: _parsed(
            "host.info", hosts_from_xml, s.call("host.info", host_id, False)))
        if not hosts:
            raise UnreadableAnswer(f"[one.host.info] unreadable document: no host {host_id} in it")
        return hosts[0]

    def template_id(self, ref: str | int) -> int:
        """A template's numeric id, from its id or its name (one templatepool query)."""
        if isinstance(ref, int) or ref.isdigit():
            return int(ref)
        pool = self.call("templatepool.info", lambda s: s.document("templatepool.info", -2, -1, -1))
        matches = [int(t.ID) for t in (pool.VMTEMPLATE or []) if t.NAME == ref]
        if not matches:
            raise VmNotFound(f"no VM template named {ref!r} is visible to user {self.config.user}", NO_EXISTS)
        if len(matches) > 1:
            raise CloudError(f"several VM templates are named {ref!r} (ids {matches}); use the numeric id")
        return matches[0]

    def networks(self) -> list[Owned]:
        """Every virtual network the user may USE, with its owner (one.vnpool.info, filter -2: oned lists what the
        user owns, its groups' and others' shared networks and what ACLs grant it, and nothing else)."""
        return self._owned("vnpool.info", NETWORK)

    def images(self) -> list[Owned]:
        """Every image the user may USE, with its owner (one.imagepool.info, filter -2, as networks())."""
        return self._owned("imagepool.info", IMAGE)

    def _owned(self, method: str, kind: Kind) -> list[Owned]:
        return self.call(method, lambda s: _parsed(method, lambda text: owned_from_xml(text, kind),
                                                   s.call(method, -2, -1, -1)))

    def template(self, template_id: int) -> dict[str, Any]:
        """A template's TEMPLATE section as a dict."""
        obj = self.call(f"template.info {template_id}",
                        lambda s: s.document("template.info", template_id, False, False))
        body = obj.TEMPLATE
        return dict(body) if isinstance(body, dict) else {}

    # -- actions --

    def instantiate(self, template_id: int, name: str, extra: str, retry: bool = True, hold: bool = False) -> int:
        """Create a VM from a template with an extra template (on HOLD: for deploy); returns the new VM id."""
        vm_id = self.call(f"template.instantiate {name}",
                          lambda s: s.call("template.instantiate", template_id, name, hold, extra, False),
                          retry=retry)
        if type(vm_id) is not int or vm_id < 0:  # never retried: the VM may exist (reconcile finds it by name)
            raise CloudError(f"[one.template.instantiate] answered no VM id ({type(vm_id).__name__})")
        return vm_id

    def action(self, action: str, vm_id: int) -> None:
        """one.vm.action; an action refused for the VM's state raises ActionRefused (never retried)."""
        self.call(f"vm.action {action} {vm_id}", lambda s: s.call("vm.action", action, vm_id))

    def deploy(self, vm_id: int, host_id: int) -> None:
        """one.vm.deploy with enforce (oned refuses a host without room for the VM: CPU, memory, PCI), on the
        host's cluster's default system datastore. A retried call whose first attempt took effect is refused
        for the VM's state (ActionRefused): the caller looks at the VM."""
        self.call(f"vm.deploy {vm_id} {host_id}", lambda s: s.call("vm.deploy", vm_id, host_id, True, -1))

    def vm_needs(self, vm_id: int) -> VmNeeds:
        """What a VM asks of a host (one.vm.info): CPU, memory, PCI, requirements."""
        return self.call(f"vm.info {vm_id}",
                         lambda s: _parsed("vm.info", vm_needs_from_xml, s.call("vm.info", vm_id, False)))

    def clear_stale(self, vm_id: int, ready: bool, sched_message: bool) -> None:
        """Merge into a stopped VM's USER_TEMPLATE (one.vm.update, type 1) what its last boot must not pass
        on (stale_update): oned keeps it through poweroff, undeploy and a killed hypervisor process."""
        self.call(f"vm.update {vm_id}", lambda s: s.call("vm.update", vm_id, stale_update(ready, sched_message), 1))

    def recover_delete(self, vm_id: int) -> None:
        """one.vm.recover with op 3 (delete): drops a VM in any state and frees its host resources."""
        self.call(f"vm.recover delete {vm_id}", lambda s: s.call("vm.recover", vm_id, 3))

    def version(self) -> str:
        """oned's version."""
        return str(self.call("system.version", lambda s: s.call("system.version")))

    def onegate_endpoint(self) -> str:
        """oned.conf's ONEGATE_ENDPOINT (one.system.config, open to every user), "" when it is not set."""
        text = self.call("system.config", lambda s: s.call("system.config"))
        # pyone's binding of OPENNEBULA_CONFIGURATION has no ONEGATE_ENDPOINT: read the element itself.
        return _parsed("system.config", lambda xml: (ET.fromstring(xml).findtext("ONEGATE_ENDPOINT") or "").strip(),
                       text)
