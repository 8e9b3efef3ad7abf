"""Entry points: the console scripts, and `slurm-nebula-power COMMAND` dispatching to the commands."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Mapping, Sequence

from .. import __version__
from ..errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, first_line
from .power import resume_fail_main, resume_main, suspend_main
from .process import process_hygiene


# Each command is imported when it runs: `slurm-nebula-power --help` and `--version` load none of them.
def _simulator(argv: list[str]) -> int:
    from opennebula_sim.cli import main  # only this command and demo load the simulator

    return main(argv)


def _demo(argv: list[str]) -> int:
    from . import demo  # it loads the simulator

    return demo.main(argv)


def _status(argv: list[str]) -> int:
    from . import status

    return status.main(argv)


def _check(argv: list[str]) -> int:
    from . import check

    return check.main(argv)


def _reconcile(argv: list[str]) -> int:
    from . import reconcile

    return reconcile.main(argv)


def _slurm_conf(argv: list[str]) -> int:
    from . import slurm_conf

    return slurm_conf.main(argv)


def _template(argv: list[str]) -> int:
    from . import template

    return template.main(argv)


def _usage(argv: list[str]) -> int:
    from . import usage

    return usage.main(argv)


def _examples(argv: list[str]) -> int:
    from . import examples

    return examples.main(argv)


def _unprotect(argv: list[str]) -> int:
    from . import unprotect

    return unprotect.main(argv)


def _image(argv: list[str]) -> int:
    from . import image

    return image.main(argv)


def _prolog(argv: list[str]) -> int:
    return prolog_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "simulator": (_simulator, "run the OpenNebula simulator (XML-RPC over HTTP)"),
    "demo": (_demo, "resume and suspend gpu[01-04] on the embedded simulator, no Slurm"),
    "status": (_status, "per node: Slurm state, VM, IP, host, age and what is wrong"),
    "check": (_check, "find configuration, credential, template and slurm.conf problems"),
    "reconcile": (_reconcile, "repair drift: orphan VMs, vanished VMs, stuck boots, hosts in maintenance"),
    "unprotect": (_unprotect, "take node sets out of protected mode (after boot failures in a row)"),
    "slurm-conf": (_slurm_conf, "print slurm.conf lines derived from the templates"),
    "template": (_template, "print a node set's VM template for onetemplate create"),
    "usage": (_usage, "GPU-hours and VM-hours by job, node set, host or day, from the usage records"),
    "example-config": (_examples, "print (or --out DIR: write) the example configuration, units and dashboards"),
    "image": (_image, "image build: a worker image (qcow2) from Debian packages, and its oneimage command"),
    "prolog-wait": (_prolog, "PrologSlurmctld: wait until the job's cloud nodes are up (as slurm-nebula-prolog)"),
}


# The commands that read no configuration: `--config` before them is refused (the simulator's own --config,
# after its name, is its sim.toml).
WITHOUT_CONFIG = frozenset({"simulator", "demo", "image"})


def power_main(argv: Sequence[str] | None = None) -> int:
    """The operator command: dispatch to a subcommand; `--config PATH` may come before it or after it."""
    args = list(sys.argv[1:] if argv is None else argv)
    width = max(len(name) for name in COMMANDS)
    usage = "usage: slurm-nebula-power [--version] [--config PATH] COMMAND [ARGS...]\n\ncommands:\n" + "".join(
        f"  {name:<{width}}  {text}\n" for name, (_, text) in COMMANDS.items()) + \
        "\nRun 'slurm-nebula-power COMMAND --help' for a command's options."
    config: list[str] = []
    while args and args[0].startswith("-"):
        option, given, value = args[0].partition("=")
        if option in ("-h", "--help"):
            print(usage)
            return EXIT_OK
        if option == "--version":
            print(f"slurm-nebula-power {__version__}")
            return EXIT_OK
        if option != "--config":
            return _usage_error(f"unknown option {args[0]!r} before the command; the options there are "
                                "--config PATH, --version and --help")
        if not given and len(args) < 2:
            return _usage_error("--config needs a PATH: slurm-nebula-power --config PATH COMMAND ...")
        path, args = (value, args[1:]) if given else (args[1], args[2:])
        if config:
            return _usage_error(f"--config given twice ({config[1]} and {path}): give it once")
        config = ["--config", path]
    if not args:
        print(usage)
        return EXIT_USAGE
    if args[0] not in COMMANDS:
        return _usage_error(f"unknown command {args[0]!r}; one of: {', '.join(COMMANDS)}")
    if config and args[0] in WITHOUT_CONFIG:
        return _usage_error(f"{args[0]} reads no configuration: remove --config {config[1]}")
    try:
        return COMMANDS[args[0]][0]([*config, *args[1:]])  # the command refuses a second --config
    except Exception as exc:  # a bug: its traceback for the report, then the one line and exit 4, never 1
        traceback.print_exc()  # (1 means "problems found" to check, status and usage)
        print(f"slurm-nebula-power {args[0]}: error: internal error: {first_line(exc, 200)} (a bug: please "
              "report it with the traceback above)", file=sys.stderr)
        return EXIT_INTERNAL


def _usage_error(message: str) -> int:
    print(f"slurm-nebula-power: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def prolog_main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """PrologSlurmctld: return once the job's cloud nodes are up, so it starts without Slurm's 30 s wait."""
    from . import prolog  # its own modules only (no pyone: it starts in about 0.1 s)

    return prolog.main(argv, environ)


def _entry(main: Callable[[], int]) -> Callable[[], None]:
    def entry() -> None:
        process_hygiene()
        sys.exit(main())

    return entry


resume_entry = _entry(resume_main)
suspend_entry = _entry(suspend_main)
resume_fail_entry = _entry(resume_fail_main)
prolog_entry = _entry(prolog_main)
power_entry = _entry(power_main)
