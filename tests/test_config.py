"""Configuration: where it is found, and every error naming the file, the key and the fix (exit 3)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from support import make_setup

from slurm_nebula_power.cli.main import resume_main
from slurm_nebula_power.config import find_config, load_config
from slurm_nebula_power.errors import EXIT_CONFIG, ConfigError


@pytest.fixture
def setup(tmp_path: Path):
    return make_setup(tmp_path, "http://127.0.0.1:9/RPC2", "oneadmin:s3cret-pass")


def test_good_configuration_loads(setup) -> None:
    config = load_config(setup.config, setup.env)
    assert config.opennebula.endpoint == "http://127.0.0.1:9/RPC2"
    assert config.opennebula.session == "oneadmin:s3cret-pass"
    assert config.slurm.cluster == "testcluster"  # ClusterName read from $SLURM_CONF
    assert config.nodeset_for("gpu03").template == "slurm-gpu-worker"
    assert config.nodeset_for("cpu02").suspend_action == "poweroff"
    assert config.nodeset_for("gpu09") is None
    assert "s3cret" not in repr(config)
    assert config.log.audit_file == setup.audit and config.log.metrics_file == setup.metrics


def test_lookup_order(tmp_path: Path, setup) -> None:
    other = tmp_path / "other.toml"
    assert find_config(str(other), {"SLURM_NEBULA_POWER_CONFIG": "x"}) == other
    assert find_config(None, {"SLURM_NEBULA_POWER_CONFIG": str(other)}) == other
    assert find_config(None, {"SLURM_CONF": str(setup.root / "slurm.conf")}) == setup.config
    if not Path("/etc/slurm/nebula-power.toml").exists():
        with pytest.raises(ConfigError, match="no configuration found: pass --config PATH"):
            find_config(None, {"SLURM_CONF": str(tmp_path / "nowhere" / "slurm.conf")})


BROKEN = [
    ("unknown key", ("max_parallel = 8", "max_parallel = 8\nmax_paralel = 4"), "opennebula.max_paralel: unknown key"),
    ("wrong type", ("timeout = 5", 'timeout = "5"'), "opennebula.timeout: must be a number, not a string '5'"),
    ("bool for number", ("timeout = 5", "timeout = true"), "opennebula.timeout: must be"),
    ("non-http endpoint", ('endpoint = "http://127.0.0.1:9/RPC2"', 'endpoint = "127.0.0.1:2634"'),
     "opennebula.endpoint: must be an http:// or https://"),
    ("missing endpoint", ('endpoint = "http://127.0.0.1:9/RPC2"', ""), "opennebula.endpoint: missing"),
    ("missing template", ('template = "slurm-cpu-worker"', ""), "nodeset[1].template: missing"),
    ("bad suspend action", ('suspend_action = "poweroff"', 'suspend_action = "hibernate"'),
     "nodeset[1].suspend_action: must be one of"),
    ("overlapping node sets", ('nodes = "cpu[01-04]"', 'nodes = "gpu[08-09]"'), "node gpu08 is in both"),
    ("malformed nodes", ('nodes = "cpu[01-04]"', 'nodes = "cpu[04-01]"'), "nodeset[1].nodes"),
    ("unknown section", ("[power]", "[powr]\n[power]"), "powr: unknown section"),
    ("relative scontrol", ("[slurm]\n", '[slurm]\nscontrol = "scontrol"\n'), None),
    ("not TOML", ("[power]", "[power"), "not valid TOML"),
    ("metrics file not .prom", ("nebula-power.prom", "nebula-power.txt"),
     "log.metrics_file: must end in .prom (node_exporter's textfile collector reads *.prom)"),
    ("audit file not a string", ('audit_file = "', "audit_file = 1 #"), "log.audit_file: must be a string"),
    ("bad job policy", ('suspend_action = "poweroff"', 'suspend_action = "poweroff"\njob_policy = "some"'),
     "nodeset[1].job_policy: must be one of 'all-or-nothing', 'best-effort'"),
    ("zero pending_timeout", ('suspend_action = "poweroff"', 'suspend_action = "poweroff"\npending_timeout = 0'),
     "nodeset[1].pending_timeout: must be greater than 0"),
    ("fractional cooldown", ("poll_max = 0.5", "poll_max = 0.5\nshortage_cooldown = 1.5"),
     "power.shortage_cooldown: must be an integer"),
]


@pytest.mark.parametrize(("case", "edit", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_configuration_is_refused_with_file_and_key(setup, case, edit, message) -> None:
    text = setup.config.read_text()
    old, new = edit
    assert old in text, case
    if case == "relative scontrol":
        text = text.replace(f'scontrol = "{setup.scontrol_dir / "scontrol"}"', 'scontrol = "scontrol"')
        message = "slurm.scontrol: must be an absolute path"
    else:
        text = text.replace(old, new, 1)
    setup.config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(setup.config, setup.env)
    assert str(setup.config) in str(info.value)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_auth_file_readable_by_others_is_refused(setup, mode) -> None:
    (setup.root / "one_auth").chmod(mode)
    with pytest.raises(ConfigError, match=r"one_auth is accessible by group or others .*chmod 600"):
        load_config(setup.config, setup.env)


def test_auth_file_content_must_be_one_credentials_line(setup) -> None:
    auth = setup.root / "one_auth"
    auth.write_text("just-a-password\n")
    auth.chmod(stat.S_IRUSR)
    with pytest.raises(ConfigError, match="exactly one line user:password"):
        load_config(setup.config, setup.env)


def test_cluster_name_required_when_slurm_conf_has_none(setup) -> None:
    (setup.root / "slurm.conf").write_text("# no cluster name\n")
    setup.config.write_text(setup.config.read_text().replace("[slurm]\n", '[slurm]\nslurm_conf = "slurm.conf"\n'))
    with pytest.raises(ConfigError, match=r"slurm\.cluster: not set and no ClusterName"):
        load_config(setup.config, setup.env)


def test_unwritable_log_directory_exits_3_without_side_effect(setup, tmp_path, capsys) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    setup.config.write_text(setup.config.read_text().replace(str(setup.log), str(blocker / "x.log")))
    assert resume_main(["gpu01"], setup.env) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "log.file: cannot write" in err and err.count("\n") == 1
    # the one thing done: the node slurmctld is powering up is handed back, not left to ResumeTimeout
    assert setup.updates() == [["NodeName=gpu01", "State=POWER_DOWN_FORCE",
                                "Reason=nebula: configuration unusable: run slurm-nebula-power check"]]


def test_gpu_shortage_keys_default_and_load(setup) -> None:
    config = load_config(setup.config, setup.env)
    gpu, _ = config.nodesets
    assert (gpu.pending_timeout, gpu.job_policy, config.power.shortage_cooldown) == (60.0, None, 60)
    setup.config.write_text(setup.config.read_text().replace(
        'suspend_action = "poweroff"', 'suspend_action = "poweroff"\njob_policy = "all-or-nothing"\n'
        "pending_timeout = 90").replace("poll_max = 0.5", "poll_max = 0.5\nshortage_cooldown = 120"))
    config = load_config(setup.config, setup.env)
    assert (config.nodesets[1].job_policy, config.nodesets[1].pending_timeout) == ("all-or-nothing", 90.0)
    assert config.power.shortage_cooldown == 120


def test_the_example_names_the_image_as_image_build_does() -> None:
    # issue 32: the example said "ubuntu-22.04-slurm" while `image build` makes Debian
    import re

    from slurm_nebula_power import configdoc
    from slurm_nebula_power.cli.image import default_output
    from slurm_nebula_power.imagespec import SUITES

    [name] = re.findall(r'(?m)^# image = "([^"]+)"', configdoc.example_text())
    assert name in {default_output(suite).stem for suite in SUITES}, name
    assert (Path(__file__).resolve().parent.parent / "etc" / "nebula-power.toml").read_text() == \
        configdoc.example_text(), "etc/nebula-power.toml is the example"


PEM = "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(("make", "said"), [
    (lambda d: d / "missing.pem", "cannot read {path}: No such file or directory; give the PEM file of the CA"),
    (lambda d: _written(d / "pem" / "x", "").parent, "{path} is not a regular file; give the PEM file of the CA "
                                                      "that issued the front end's"),
    (lambda d: _written(d / "empty.pem", ""), "{path} holds no PEM certificate; give the PEM file of the CA"),
    (lambda d: _written(d / "bad.pem", PEM), "{path} holds a PEM certificate that does not parse; give"),
])
def test_a_ca_file_that_cannot_serve_is_refused_at_load_naming_the_key(setup, make, said: str, capsys) -> None:
    path = make(setup.root / "ca")
    setup.config.write_text(setup.config.read_text().replace("timeout = 5\n", f'timeout = 5\nca_file = "{path}"\n'))
    with pytest.raises(ConfigError) as raised:
        load_config(setup.config, setup.env)
    assert str(raised.value).startswith(f"{setup.config}: opennebula.ca_file: {said.format(path=path)}"), raised.value
    assert resume_main(["gpu01"], setup.env) == EXIT_CONFIG
    assert capsys.readouterr().err.count("\n") == 1


def _written(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_ca_file_with_https_verify_false_is_refused(setup, tmp_path) -> None:
    setup.config.write_text(setup.config.read_text().replace(
        "timeout = 5\n", f'timeout = 5\nhttps_verify = false\nca_file = "{tmp_path}/ca.pem"\n'))
    with pytest.raises(ConfigError) as raised:
        load_config(setup.config, setup.env)
    assert str(raised.value) == (f"{setup.config}: opennebula.ca_file: set with https_verify = false, which trusts "
                                 "any certificate: remove one of them")
