"""sim.toml loading and the OpenNebula template syntax the simulator parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from opennebula_sim import SimConfig, load_sim_config
from opennebula_sim.config import ConfigError
from opennebula_sim.templates import (
    TemplateSyntaxError,
    merge,
    parse_template,
    split_vm_template,
)


def _load(tmp_path: Path, text: str) -> SimConfig:
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return load_sim_config(path)


def test_defaults_are_four_hosts_of_four_gpus_and_two_templates() -> None:
    cfg = SimConfig()
    assert [h.name for h in cfg.hosts] == ["gpu-host-01", "gpu-host-02", "gpu-host-03", "gpu-host-04"]
    assert [sum(p.klass == "0302" and p.vendor == "10de" for p in h.pci) for h in cfg.hosts] == [4, 4, 4, 4]
    assert [sum(p.klass == "0200" for p in h.pci) for h in cfg.hosts] == [1, 1, 1, 1]
    assert [(t.id, t.name) for t in cfg.templates] == [(0, "slurm-gpu-worker"), (1, "slurm-cpu-worker")]
    gpu = parse_template(cfg.templates[0].body)
    assert gpu["PCI"] == [{"VENDOR": "10de", "CLASS": "0302"}]
    assert {"CPU", "VCPU", "MEMORY", "NIC", "CONTEXT"} <= set(gpu)
    assert "PCI" not in parse_template(cfg.templates[1].body)
    assert cfg.network.cidr == "127.0.1.0/24"
    assert (cfg.durations.prolog, cfg.durations.boot) == (1.0, 1.0)


def test_full_sim_toml(tmp_path: Path) -> None:
    cfg = _load(tmp_path, '''
seed = 9
version = "6.8.0"
tick_seconds = 0.02
on_running = ["/bin/echo", "up"]
[durations]
prolog = 0
boot = 0.5
[faults]
latency_ms = 20
transient_kinds = ["drop"]
transient_rate = 0.1
[network]
cidr = "127.10.0.0/16"
name = "ib-net"
[[host]]
name = "a100-1"
gpus = 8
[[host]]
name = "custom"
cpu = 800
memory_mb = 2048
[[host.pci]]
short_address = "c1:00.0"
vendor = "10de"
device = "20b5"
class = "0302"
[[template]]
id = 7
name = "tiny"
body = """CPU = 1
MEMORY = 512"""
''')
    assert (cfg.seed, cfg.version, cfg.tick_seconds) == (9, "6.8.0", 0.02)
    assert cfg.on_running == ("/bin/echo", "up")
    assert (cfg.durations.prolog, cfg.durations.boot, cfg.durations.epilog) == (0, 0.5, 1.0)
    faults = cfg.faults
    assert (faults.latency_ms, faults.transient_kinds, faults.transient_rate) == (20, ("drop",), 0.1)
    assert (cfg.network.cidr, cfg.network.name) == ("127.10.0.0/16", "ib-net")
    assert [h.name for h in cfg.hosts] == ["a100-1", "custom"]
    assert len(cfg.hosts[0].pci) == 9
    custom = cfg.hosts[1]
    assert (custom.cpu, custom.memory_kb, custom.pci[0].device) == (800, 2048 * 1024, "20b5")
    assert [(t.id, t.name) for t in cfg.templates] == [(7, "tiny")]


@pytest.mark.parametrize(("text", "message"), [
    ("sed = 1", "unknown key sed"),
    ("[faults]\nlatency = 1", "unknown key faults.latency"),
    ("[durations]\nboot = -1", "durations.boot must be >= 0"),
    ("[faults]\nboot_failure_rate = 1.5", "faults.boot_failure_rate must be between 0 and 1"),
    ("[faults]\ntransient_kinds = ['timeout']", "transient_kinds must be a non-empty subset"),
    ("[network]\ncidr = 'banana'", "network.cidr 'banana' is not an IPv4 network"),
    ("[hosts]\ncount = 1\n[[host]]\nname = 'x'", "not both"),
    ("[[host]]\ncpu = 4", "host[0] needs a name"),
    ("[[host]]\nname = 'x'\ngpu = 2", "unknown key host[0].gpu"),
    ("[[host]]\nname = 'x'\n[[host.pci]]\nvendor = '10de'", "host[0].pci[0] needs a short_address"),
    ("[[template]]\nid = 1\nname = 'x'", "template[0] needs body"),
    ("[[template]]\nid = 1\nname = 'x'\nbody = 'CPU = ['", "template 'x': Parse error"),
    ("on_running = 'echo hi'", "on_running must be a non-empty list of strings"),
    ("seed = ", "not valid TOML"),
])
def test_bad_sim_toml_names_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, text)
    assert message in str(caught.value)
    assert str(tmp_path / "sim.toml") in str(caught.value)


def test_missing_sim_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read simulator configuration"):
        load_sim_config(tmp_path / "nope.toml")


def test_template_string_form() -> None:
    text = '''# a comment
name = "x"   CPU=0.5
NIC = [ NETWORK = "net", MODEL = virtio ]
NIC = [
  NETWORK_ID = 0 ,
  IP = "10.0.0.7" ]
CONTEXT = [ START_SCRIPT = "echo \\"hi\\" # not a comment", EMPTY = "" ]
BARE =
'''
    assert parse_template(text) == {
        "NAME": ["x"], "CPU": ["0.5"],
        "NIC": [{"NETWORK": "net", "MODEL": "virtio"}, {"NETWORK_ID": "0", "IP": "10.0.0.7"}],
        "CONTEXT": [{"START_SCRIPT": 'echo "hi" # not a comment', "EMPTY": ""}],
        "BARE": [""],
    }


def test_template_xml_form() -> None:
    xml = "<TEMPLATE><A><![CDATA[x ]]]]><![CDATA[> y]]></A><V><K>1</K><L/></V><V><K>2</K></V></TEMPLATE>"
    assert parse_template(xml) == {"A": ["x ]]> y"], "V": [{"K": "1", "L": ""}, {"K": "2"}]}
    assert parse_template("") == {}


@pytest.mark.parametrize("text", [
    'A = "open', "A B", "= 1", "V = [ A = 1 B = 2 ]", "<TEMPLATE><A></TEMPLATE>",
])
def test_template_syntax_errors(text: str) -> None:
    with pytest.raises(TemplateSyntaxError):
        parse_template(text)


def test_merge_replaces_attributes_wholesale_as_oned_does() -> None:
    base = parse_template('CPU = 1\nCONTEXT = [ A = 1, B = 2 ]\nNIC = [ NETWORK = a ]\nNIC = [ NETWORK = b ]')
    extra = parse_template('CONTEXT = [ C = 3 ]\nNIC = [ NETWORK = c ]\nX = y')
    expected = {"CPU": ["1"], "CONTEXT": [{"C": "3"}], "NIC": [{"NETWORK": "c"}], "X": ["y"]}
    assert merge(base, extra) == expected
    assert "CONTEXT" not in merge(base, parse_template("CONTEXT = [ ]"))


def test_split_puts_vm_attributes_in_template_and_the_rest_in_user_template() -> None:
    text = 'CPU = 1\nPCI = [ VENDOR = 10de ]\nSLURM_NODE = n\nLABELS = a'
    vm, user = split_vm_template(parse_template(text))
    assert set(vm) == {"CPU", "PCI"} and set(user) == {"SLURM_NODE", "LABELS"}
