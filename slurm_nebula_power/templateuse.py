"""`check`'s proof that each node set's template works for the configured OpenNebula user, not only that it
parses: every NIC's network, PCI NIC's network and DISK's image resolves for that user exactly as oned resolves
it at instantiate (owned.resolve), and with `check --instantiate` oned itself instantiates it on hold as that
user (the VM removed at once). Also the fix for a template the user cannot see, shared with `slurm-conf`."""

from __future__ import annotations

from . import __version__
from .config import Config, NodeSet
from .errors import ActionRefused, CloudAuthError, CloudError, QuotaExceeded, TransientCloudError, first_line
from .findings import Report
from .grants import Rights
from .operation import Cloud
from .owned import Unresolved, references, resolve
from .template import UsablePools

# The probe VM's name: a space makes it no Slurm node name (hostlists refuse it), so no program of ours ever
# takes it for a node's VM; its extra template carries no node identity either, only this marker.
PROBE_NAME = "slurm-nebula-power check {index}"
PROBE_EXTRA = f'SLURM_NEBULA_POWER_CHECK = "instantiate probe of check {__version__}, removed at once"'


def missing_template_fix(config: Config, nodeset: NodeSet) -> str:
    """What to do when the user cannot see a node set's template: make it the user's (or name one it sees)."""
    one = config.opennebula
    return (f"the template must be one user {one.user} may use: if it does not exist, create it as that user: "
            f"ONE_AUTH={one.auth_file} onetemplate create FILE (FILE from `slurm-nebula-power template`); if it "
            f"exists but is another user's (made as oneadmin), as oneadmin: onetemplate chown <id> {one.user}; or "
            "set the node set's template to a name or id the user sees")


def check_template_use(report: Report, config: Config, cloud: Cloud, *, instantiate: bool = False) -> None:
    """Each node set's template as stored in oned: its networks and images resolve for the user as oned resolves
    them when resume instantiates it; `instantiate`: oned instantiates it on hold as the user, removed at once."""
    user_name = config.opennebula.user
    try:
        user = cloud.rights()
    except CloudError as exc:
        report.warn(f"OpenNebula user {user_name}", f"unreadable (one.user.info: {first_line(exc)}): the templates' "
                    "networks and images not checked", "run check again when OpenNebula answers")
        return
    pools = UsablePools(cloud)
    for index, nodeset in enumerate(config.nodesets):
        try:
            template_id = cloud.template_id(nodeset.template)
            body = cloud.template(template_id)
        except CloudError:
            continue  # check_templates has said why
        subject = f"node set {nodeset.nodes_expr} template {nodeset.template!r}"
        _references(report, subject, body, pools, user)
        if instantiate:  # oned's own verdict, whatever the lines above say: it is the judge
            _probe(report, subject, cloud, template_id, index, user_name)


def _references(report: Report, subject: str, body: dict[str, object], pools: UsablePools, user: Rights) -> bool:
    """Report each reference that does not resolve, or one line for all that do; whether all did."""
    found: list[str] = []
    good = True
    for label, kind, vector in references(body):
        try:
            hit = resolve(kind, vector, pools.of(kind), user)
        except CloudError as exc:
            report.warn(f"{subject} {label}", f"not checked: the {kind.noun}s the user may use are unreadable "
                        f"({first_line(exc)})", "run check again when OpenNebula answers")
            good = False
            continue
        if isinstance(hit, Unresolved):
            report.problem(f"{subject} {label}", hit.text, f"{hit.fix} (onetemplate update, or make the template "
                           "again with `slurm-nebula-power template`, which names them by id)")
            good = False
        elif hit is not None:
            found.append(f"{label} {hit.described(kind)}")
    if good:
        what = "; ".join(found) if found else "it names no network or image"
        report.ok(f"{subject} networks and images", f"resolve for user {user.name} as oned resolves them at "
                  f"instantiate: {what}")
    return good


def _probe(report: Report, subject: str, cloud: Cloud, template_id: int, index: int, user: str) -> None:
    """Instantiate on hold as the user, then remove the VM at once: oned's own verdict on the template."""
    subject = f"{subject} instantiate"
    try:
        vm_id = cloud.instantiate(template_id, PROBE_NAME.format(index=index), PROBE_EXTRA, retry=False, hold=True)
    except QuotaExceeded as exc:
        report.warn(subject, f"not proved: oned refused it for a quota of user {user} ({exc.quota})",
                    "run check --instantiate again when the user is below its quota")
        return
    except TransientCloudError as exc:  # oned may have made the VM before the answer was lost
        report.warn(subject, f"not proved: no answer from oned ({first_line(exc, 200)})",
                    f"run check --instantiate again; if onevm list shows a VM named "
                    f"'{PROBE_NAME.format(index=index)}', terminate it")
        return
    except CloudError as exc:
        report.problem(subject, f"oned refuses to instantiate it as user {user}: {first_line(exc, 300)}",
                       "fix what oned names (the lines above say how for a network or image), then run "
                       "check --instantiate again")
        return
    try:
        _remove(cloud, vm_id)
    except CloudError as exc:
        report.warn(subject, f"oned instantiated it on hold as user {user} (VM {vm_id}), but removing that VM "
                    f"failed: {first_line(exc)}", f"remove it: onevm terminate {vm_id}")
        return
    report.ok(subject, f"oned instantiated it on hold as user {user} (VM {vm_id}, named "
              f"{PROBE_NAME.format(index=index)!r}) and check removed it at once")


def _remove(cloud: Cloud, vm_id: int) -> None:
    """Terminate a VM on hold: oned drops it at once (DispatchManager::terminate), and terminate is a MANAGE
    operation the owner has, where recover is ADMIN by default; recover --delete only if terminate is refused."""
    try:
        cloud.action("terminate", vm_id)
    except (ActionRefused, CloudAuthError):
        cloud.recover_delete(vm_id)
