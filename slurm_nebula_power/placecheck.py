"""`check`'s look at placement: whether the OpenNebula user may deploy (what a node set's `placement =
"direct"` needs), and what to grant when it may not, without making it an administrator."""

from __future__ import annotations

from .config import Config
from .errors import CloudError, first_line
from .findings import Report
from .grants import Rights
from .operation import Cloud
from .placement import deploy_level, operations

GRANT = 'VM_MANAGE_OPERATIONS = "deploy"'


def _source(rights: Rights) -> str:
    """Which template decides deploy's level: the user's, its group's, or oned.conf (as oned reads them)."""
    for name, levels in (("its user template", rights.user), (f"the template of its group {rights.gid}",
                                                              rights.group), ("oned.conf", rights.system)):
        if any("deploy" in operations(text) for text in levels.values()):
            return name
    return "oned's default"


def grant_fix(rights: Rights) -> str:
    """What oneadmin runs so that the user may deploy its own VMs (a MANAGE operation for it alone)."""
    name = rights.name or "<user>"
    manage = rights.user.get("MANAGE", "").strip()
    line = GRANT if not manage else f'VM_MANAGE_OPERATIONS = "{manage}, deploy"'
    admin = "deploy" in operations(rights.user.get("ADMIN", ""))
    return ((f"remove deploy from user {name}'s VM_ADMIN_OPERATIONS and " if admin else "") +
            f"as oneadmin put {line} in user {name}'s template: write that line to a file and run "
            f"`oneuser update {name} FILE --append` (or `onegroup update <its group> FILE --append` for every "
            "user of the group); deploy then asks MANAGE of the user's own VMs, which their owner has, and "
            "nothing else changes (docs/installation.md, \"Direct placement\")")


def check_placement(report: Report, config: Config, cloud: Cloud) -> None:
    """Whether the user may deploy its VMs: an administrator (group oneadmin) may; anyone else once deploy is
    a MANAGE or USE operation for it (its user template, then its primary group's, then oned.conf's
    VM_*_OPERATIONS; stock: ADMIN). Without it a node set with placement = "direct" is placed by oned's
    scheduler at every resume, after one refused deploy."""
    direct = [ns.nodes_expr for ns in config.nodesets if ns.placement == "direct"]
    subject = f"OpenNebula user {config.opennebula.user} deploy right"
    using = f"node sets {', '.join(direct)} use placement = \"direct\"" if direct else \
        "no node set uses placement = \"direct\""
    try:
        rights = cloud.rights()
        hosts = cloud.hosts() if direct else None
    except CloudError as exc:
        if direct:
            report.warn(subject, f"cannot tell ({first_line(exc)}); {using}", "run check again when OpenNebula answers")
        return
    level = deploy_level(rights.user, rights.group, rights.system)
    if rights.administrator:
        report.ok(subject, f"may deploy: the user is in group oneadmin; {using}")
    elif level != "ADMIN":
        report.ok(subject, f"may deploy its VMs: deploy is a {level} operation for it ({_source(rights)}); {using}")
    elif direct:
        report.warn(subject, f"may not deploy: deploy is an ADMIN operation for it ({_source(rights)}), and {using}: "
                    "resume hands their VMs to oned's scheduler after one refused deploy", grant_fix(rights))
    else:
        report.ok(subject, f"may not deploy (an ADMIN operation for it, {_source(rights)}); {using}, which needs "
                  f"no more; for direct placement: {grant_fix(rights)}")
    _check_recover(report, config, rights)
    if direct and not hosts:
        report.warn(f"node sets {', '.join(direct)} placement", "the user sees no host: direct placement chooses "
                    "from the host pool, so oned's scheduler places their VMs",
                    f'let user {config.opennebula.user} see the hosts: oneacl create "#<uid> HOST/* USE"')


def _check_recover(report: Report, config: Config, rights: Rights) -> None:
    """recover --delete is how a VM stuck in a transient state (PROLOG, EPILOG, a hung deploy) is removed when
    terminate is refused for its state; oned.conf ships it as an ADMIN operation, which a user lacks on its own
    VMs: such a VM is then left for an administrator (logged), its GPU held."""
    subject = f"OpenNebula user {config.opennebula.user} recover right"
    level = deploy_level(rights.user, rights.group, rights.system, operation="recover")
    if rights.administrator or level != "ADMIN":
        report.ok(subject, "may recover --delete its VMs stuck in a transient state")
        return
    name = rights.name or "<user>"
    manage = rights.user.get("MANAGE", "").strip()
    line = 'VM_MANAGE_OPERATIONS = "recover"' if not manage else f'VM_MANAGE_OPERATIONS = "{manage}, recover"'
    report.warn(subject, "may not recover its VMs (an ADMIN operation for it): a VM stuck in a transient state "
                "that terminate cannot remove is left for an administrator, its GPU held",
                f"as oneadmin put {line} in user {name}'s template (`oneuser update {name} FILE --append`; "
                "docs/installation.md, \"The OpenNebula side\")")
