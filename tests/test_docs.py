"""The documentation cannot rot: its links resolve, and its operator commands run against the simulator.

Links: every relative link of README.md and docs/*.md (outside code blocks) names a file or directory of
the repository, and a `#anchor` into a Markdown file names one of its headings (GitHub's slugs).

Commands: every fenced block opened with ```` ```console ```` (indented too, as in a list item), in README.md
and docs/*.md, holds commands on lines that start with `$ `; other lines are example output. Each command
line is split with shlex (`#` starts a comment) into parts at `;`, `&&`, `||` and `|`, and each part:

- whose program is `slurm-nebula-power` (any directory: `~/snp/bin/slurm-nebula-power` is the one
  installed beside this Python) runs against a simulator deployment (tests/support.py make_setup, with the
  README's node set `gpu[01-16]` so node names need no substitution, found through
  SLURM_NEBULA_POWER_CONFIG), and must exit 0 or 1: never 2 (usage), 3 (configuration) or 4 (internal);
- is first stripped of `sudo -u USER` and of `NAME=value` environment assignments before its program
  (`ONE_AUTH=/etc/slurm/one_auth onetemplate ...`);
- whose program is in SKIPPED (it needs a real Slurm, OpenNebula, systemd or root) is not run;
- with any other program fails the test: a misspelled program name is caught as well as a misspelled
  subcommand or option (exit 2).

`> FILE` and `>> FILE` take the command's output; absolute paths (`/etc/slurm/...`, `--out /root/...`) are
re-rooted under the test's temporary directory, which is also the working directory.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from opsupport import ours_vm, show
from simfixtures import AUTH
from support import make_setup, run_env

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
POWER = Path(sys.executable).parent / "slurm-nebula-power"
OURS = "slurm-nebula-power"
# Programs a documented command may name that this test does not run, and why.
SKIPPED = {
    "scontrol": "a real slurmctld", "sbatch": "a real slurmctld", "squeue": "a real slurmctld",
    "systemctl": "systemd and root", "journalctl": "systemd",
    "onetemplate": "a real OpenNebula", "onevm": "a real OpenNebula",
    "python3": "makes a virtual environment", "pip": "installs the package",
    "install": "root (chown)", "cp": "root (/etc/systemd)", "shred": "a file made before",
    "umask": "a shell builtin", "grep": "a real log",
}
SEPARATORS = {";", "&&", "||", "|"}
FAILED = {2: "usage", 3: "configuration", 4: "internal error"}
NODESETS = """\
[[nodeset]]
nodes = "gpu[01-16]"
template = "slurm-gpu-worker"
boot_timeout = 20
vcpu = 8
memory_mb = 65536
network = "slurm-net"
image = "slurm-worker"  # the simulator's image (oneadmin's, as docs/worker-image.md registers it)
controller = "slurmctld.example.org"
munge_key_file = "{key}"
"""


@dataclass(frozen=True)
class Command:
    """One `$ ` line of a console block."""

    page: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def console_commands(path: Path) -> list[Command]:
    """The `$ ` lines of a page's ```console blocks."""
    found: list[Command] = []
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not inside and stripped == "```console":
            inside = True
        elif inside and stripped.startswith("```"):
            inside = False
        elif inside and stripped.startswith("$ "):
            found.append(Command(str(path.relative_to(ROOT)), number, stripped[2:]))
    return found


COMMANDS = [command for page in PAGES for command in console_commands(page)]


def parts(text: str) -> list[list[str]]:
    """A command line's simple commands, split at ; && || |, comments dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    result: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            result.append([])
        else:
            result[-1].append(token)
    return [words for words in result if words]


def reroot(word: str, tmp: Path) -> str:
    """An absolute path moved below the test's directory (its parent made)."""
    if not word.startswith("/"):
        return word
    path = tmp / "root" / word.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    return str(path)


@pytest.fixture
def site(tmp_path, sim):
    """A deployment of the README's node set on the simulator: one VM running, the rest powered down."""
    key = tmp_path / "site" / "munge.key"
    setup = make_setup(key.parent, sim.endpoint, AUTH, nodesets=NODESETS.format(key=key))
    key.write_bytes(b"k" * 1024)
    key.chmod(0o400)
    slurm_conf = setup.root / "slurm.conf"
    slurm_conf.write_text(slurm_conf.read_text() + textwrap.dedent("""\
        GresTypes=gpu
        NodeName=gpu[01-16] State=CLOUD CPUs=8 RealMemory=62000 Gres=gpu:1 Feature=cloud
        PartitionName=gpu Nodes=gpu[01-16] State=UP
        """))
    sim.add_vm(name="gpu01", **ours_vm("gpu01"), state="RUNNING")
    setup.set_nodes(show("gpu01 State=IDLE+CLOUD NodeAddr=127.0.1.1",
                         *(f"gpu{n:02d} State=IDLE+CLOUD+POWERED_DOWN" for n in range(2, 17))))
    return setup


def run(words: list[str], site, tmp: Path) -> subprocess.CompletedProcess[str] | None:
    """Run one simple command as documented; None when its program is skipped."""
    if words[:2] == ["sudo", "-u"]:
        words = words[3:]
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value: the program's environment, as the shell takes it
    if not words:
        return None
    program = Path(words[0]).name
    if program in SKIPPED:
        return None
    assert program == OURS, f"{words[0]!r} is neither {OURS} nor in SKIPPED: a misspelling?"
    argv, out, mode = [str(POWER)], None, "w"
    rest = iter(words[1:])
    for word in rest:
        if word in (">", ">>"):
            out, mode = reroot(next(rest), tmp), "w" if word == ">" else "a"
        else:
            argv.append(reroot(word, tmp))
    done = subprocess.run(argv, env=run_env(site), cwd=tmp, capture_output=True, text=True, timeout=120,
                          check=False)
    if out is not None:
        Path(out if Path(out).is_absolute() else tmp / out).open(mode).write(done.stdout)
    return done


def test_the_operator_pages_have_console_blocks() -> None:
    pages = {command.page for command in COMMANDS}
    assert {"README.md", "docs/operations.md", "docs/troubleshooting.md"} <= pages


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_runs_against_the_simulator(command: Command, site, tmp_path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    for words in parts(command.text):
        done = run(words, site, work)
        if done is None:
            continue
        assert done.returncode not in FAILED, (
            f"{command}: `{command.text}` exited {done.returncode} ({FAILED.get(done.returncode)})\n"
            f"stderr:\n{done.stderr}")
        assert done.returncode in (0, 1), f"{command}: `{command.text}` exited {done.returncode}\n{done.stderr}"


# ---- links ----------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose(path: Path) -> list[tuple[int, str]]:
    """A page's lines outside fenced code blocks."""
    lines, inside = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings."""
    return {slug(line.lstrip("#")) for _, line in prose(path) if re.match(r"#{1,6} ", line)}


LINKS = [(page, number, target) for page in PAGES for number, line in prose(page)
         for target in LINK.findall(line) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize(("page", "number", "target"), LINKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in LINKS])
def test_a_relative_link_names_a_file_and_heading_that_exist(page: Path, number: int, target: str) -> None:
    name, _, anchor = target.partition("#")
    path = (page.parent / name).resolve() if name else page
    assert path.exists(), f"{page.relative_to(ROOT)}:{number}: {target}: no such file"
    if anchor and path.suffix == ".md":
        assert anchor in anchors(path), f"{page.relative_to(ROOT)}:{number}: {target}: no such heading"
