"""`slurm-nebula-power usage`: intervals and hours from records whose truth the test knows, the
window, the groupings, and the disagreements with OpenNebula."""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import pwd
import re
import subprocess
import sys

import pytest
from opsupport import ours, ours_vm
from simfixtures import vms_of
from support import run_env
from test_cli import program

from slurm_nebula_power.cli import usage as usage_cli
from slurm_nebula_power.cli.main import resume_main, suspend_main
from slurm_nebula_power.errors import EXIT_INTERNAL, EXIT_NODES_FAILED, EXIT_OK, EXIT_USAGE
from slurm_nebula_power.model import Vm
from slurm_nebula_power.records import Record
from slurm_nebula_power.usage import audit_files, disagreements, intervals, parse_when, read_audit, summarize

T0 = 1_764_547_200.0  # 2025-12-01T00:00:00Z
GPU_A = {"address": "0000:41:00.0", "vendor": "10de"}
GPU_B = {"address": "0000:42:00.0", "vendor": "10de"}


def rec(event: str, at: float, vm: int, node: str = "gpu01", jobs=(), host=None, gpus=()) -> Record:
    return Record(time=T0 + at, event=event, node=node, vm=vm, host=host, gpus=tuple(gpus), jobs=tuple(jobs),
                  cluster="testcluster")


# VM 1 (gpu01, job 7): runs 100 s -> 3700 s with GPU A on h1. VM 2 (gpu02, jobs 7 and 8): runs 200 s ->
# 7400 s with GPUs A and B on h2. VM 3 (gpu03): created, never ran, removed. VM 4 (gpu01): poweroff and
# resume: two stretches, 10000-11000 and 12000-12600 s.
RECORDS = [
    rec("created", 0, 1, jobs=[7]), rec("running", 100, 1, jobs=[7], host="h1", gpus=[GPU_A]),
    rec("created", 10, 2, "gpu02", jobs=[7, 8]), rec("running", 200, 2, "gpu02", [7, 8], "h2", [GPU_A, GPU_B]),
    rec("running", 900, 2, "gpu02", [7, 8], "h2", [GPU_A, GPU_B]),  # a later resume saw it running again
    rec("removed", 3700, 1, host="h1", gpus=[GPU_A]), rec("removed", 7400, 2, "gpu02", host="h2"),
    rec("created", 20, 3, "gpu03", jobs=[9]), rec("failed", 80, 3, "gpu03"), rec("removed", 81, 3, "gpu03"),
    rec("created", 9000, 4, jobs=[10]), rec("running", 10000, 4, jobs=[10], host="h1", gpus=[GPU_A]),
    rec("off", 11000, 4, host="h1"), rec("resumed", 11500, 4, jobs=[11]),
    rec("running", 12000, 4, jobs=[11], host="h1", gpus=[GPU_A]), rec("removed", 12600, 4),
]


def by(group: str, since: float | None = None, until: float = T0 + 86400):
    rows = summarize(intervals(RECORDS), group, since, until, lambda node: "gpu[01-08]")
    return {row.key: row for row in rows}


def test_a_vm_counts_from_running_to_removed_times_its_gpus() -> None:
    rows = by("vm")
    assert rows["1"].vm_seconds == 3600 and rows["1"].gpu_seconds == 3600
    assert rows["2"].vm_seconds == 7200 and rows["2"].gpu_seconds == 14400
    assert "3" not in rows  # never ran: no hours
    assert rows["4"].vm_seconds == 1000 + 600  # powered off in between


def test_a_job_s_line_names_its_vms_and_gpus_and_a_vm_counts_for_each_of_its_jobs() -> None:
    rows = by("job")
    assert rows["7"].vms == {1, 2} and rows["7"].vm_seconds == 3600 + 7200
    assert sorted(rows["7"].gpus) == ["h1 0000:41:00.0", "h2 0000:41:00.0", "h2 0000:42:00.0"]
    assert rows["8"].vms == {2} and rows["8"].gpu_seconds == 14400
    assert rows["10"].vm_seconds == 1000 and rows["11"].vm_seconds == 600  # each stretch its own jobs


def test_hosts_and_node_sets_count_each_vm_once() -> None:
    assert by("host")["h1"].vm_seconds == 3600 + 1600 and by("host")["h2"].gpu_seconds == 14400
    assert by("nodeset")["gpu[01-08]"].vm_seconds == 3600 + 7200 + 1600


def test_the_window_clips_intervals_and_days_split_at_utc_midnight() -> None:
    assert by("vm", since=T0 + 3000, until=T0 + 4000)["2"].vm_seconds == 1000
    assert by("vm", since=T0 + 3000, until=T0 + 4000)["1"].vm_seconds == 700
    running = [*RECORDS, rec("running", 86000, 5, jobs=[12], host="h1", gpus=[GPU_A])]
    rows = {r.key: r for r in summarize(intervals(running), "day", None, T0 + 90000, lambda n: "x")}
    assert rows["2025-12-02"].vm_seconds == 3600 and rows["2025-12-02"].open
    assert rows["2025-12-01"].vm_seconds == 3600 + 7200 + 1600 + 400


def test_disagreements_name_vms_live_against_the_records_and_records_without_a_vm() -> None:
    live = [Vm(id=2, name="gpu02", state=3, lcm_state=3, user_template=ours("gpu02"), context=ours("gpu02")),
            Vm(id=7, name="gpu07", state=3, lcm_state=2, user_template=ours("gpu07"), context=ours("gpu07")),
            Vm(id=6, name="gpu06", state=3, lcm_state=3, user_template=ours("gpu06"), context=ours("gpu06")),
            Vm(id=9, name="other", state=3, lcm_state=3)]  # not ours: never named
    records = [*RECORDS, rec("running", 500, 5, "gpu05", host="h1", gpus=[GPU_A]), rec("failed", 600, 7, "gpu07")]
    found = disagreements(records, live, "testcluster", T0 + 86400)
    assert len(found) == 4
    assert found[0].startswith("VM 2 (gpu02): the records say removed at 2025-12-01T02:03:20+00:00, but "
                               "OpenNebula still has it ACTIVE/RUNNING")
    assert found[1].startswith("VM 6 (gpu06) is live in OpenNebula (ACTIVE/RUNNING) but no usage record")
    assert found[2].startswith("VM 7 (gpu07): the records say it failed at 2025-12-01T00:10:00+00:00 and was "
                               "not removed, and OpenNebula has it ACTIVE/BOOT")
    assert found[3].startswith("VM 5 (gpu05): the records say running since") and "no live VM 5" in found[3]


@pytest.mark.parametrize("text", ["yesterday", "2025-13-01", "7w", ""])
def test_a_time_that_is_not_one_is_a_usage_error(text: str) -> None:
    with pytest.raises(Exception, match="is not a time"):
        parse_when(text, T0)


def test_ages_and_iso_times() -> None:
    assert parse_when("2h", T0) == T0 - 7200
    assert parse_when("2025-12-01", T0 + 99) == T0
    assert parse_when("2025-12-01T01:00+01:00", 0) == T0


# ---- the command, over the simulator ----------------------------------------------------------------


def run_usage(setup, capsys, *args: str) -> tuple[int, str]:
    code = usage_cli.main(list(args), setup.env)
    return code, capsys.readouterr().out


def test_usage_of_a_resume_and_suspend_matches_the_simulator(tmp_path, sim, setup, capsys) -> None:
    (tmp_path / "resume.json").write_text(json.dumps({"jobs": [{"job_id": 42, "nodes": "gpu[01-02]"}]}))
    assert resume_main(["gpu[01-02]"], dict(setup.env, SLURM_RESUME_FILE=str(tmp_path / "resume.json"))) == 0
    vms = {node: vms_of(sim, node)[0] for node in ("gpu01", "gpu02")}
    assert suspend_main(["gpu[01-02]"], setup.env) == EXIT_OK
    code, out = run_usage(setup, capsys, "--json")
    assert code == EXIT_OK
    report = json.loads(out)
    [job] = report["rows"]
    assert job["job"] == "42" and job["vms"] == sorted(vm.id for vm in vms.values())
    assert sorted((g["host"], g["address"]) for g in job["gpus"]) == sorted((vm.host, vm.pci[0])
                                                                           for vm in vms.values())
    assert report["disagreements"] == [] and not job["still_running"]
    assert job["gpu_seconds"] == pytest.approx(job["vm_seconds"])  # one GPU each
    code, out = run_usage(setup, capsys)
    assert code == EXIT_OK and out.splitlines()[0].split()[:4] == ["JOB", "VMS", "NODES", "GPUS"]
    assert "the records agree with OpenNebula" in out
    code, out = run_usage(setup, capsys, "--csv", "--by", "host", "--no-cloud")
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0][0] == "HOST" and sorted(r[0] for r in rows[1:]) == sorted({vm.host for vm in vms.values()})


def test_usage_says_where_opennebula_disagrees_and_exits_1(sim, setup, capsys) -> None:
    assert resume_main(["gpu01"], setup.env) == EXIT_OK
    stray = sim.add_vm("gpu02", **ours_vm("gpu02"))  # live, but no program recorded it
    code, out = run_usage(setup, capsys)
    assert code == EXIT_NODES_FAILED
    assert "disagreements with OpenNebula:" in out and f"VM {stray} (gpu02) is live in OpenNebula" in out
    assert "still running" in out  # gpu01's VM: counted until now
    code, out = run_usage(setup, capsys, "--no-cloud")
    assert code == EXIT_OK and "disagree" not in out


def test_usage_without_an_audit_file_or_with_a_bad_window_is_one_line_and_exit_2(setup, capsys) -> None:
    code = usage_cli.main(["--since", "tomorrow"], setup.env)
    assert code == EXIT_USAGE and "is not a time" in capsys.readouterr().err
    code = usage_cli.main(["--since", "1h", "--until", "2h"], setup.env)
    assert code == EXIT_USAGE and "is not before" in capsys.readouterr().err
    setup.config.write_text("\n".join(line for line in setup.config.read_text().splitlines()
                                      if not line.startswith("audit_file")))
    code = usage_cli.main([], setup.env)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "log.audit_file is not set" in err and len(err.splitlines()) == 1


def test_a_missing_record_file_or_an_unreachable_opennebula_is_one_line(setup, capsys, tmp_path) -> None:
    code = usage_cli.main(["--file", str(tmp_path / "nope.jsonl")], setup.env)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.splitlines()) == 1 and "nope.jsonl: cannot read the usage records" in err
    setup.audit.write_text("")
    text = setup.config.read_text()
    setup.config.write_text(re.sub(r'endpoint = ".*"', 'endpoint = "http://127.0.0.1:9/RPC2"', text))
    setup.config.write_text(setup.config.read_text().replace("retry_seconds = 10", "retry_seconds = 0.5"))
    code = usage_cli.main(["--json"], setup.env)
    out, err = capsys.readouterr()
    assert code == EXIT_INTERNAL and out == "" and len(err.splitlines()) == 1 and "connection failed" in err
    assert usage_cli.main(["--no-cloud"], setup.env) == EXIT_OK
    assert "no usage in this window" in capsys.readouterr().out


def test_the_rotated_record_files_are_read_oldest_first_gzip_too(tmp_path) -> None:
    path = tmp_path / "audit.jsonl"
    lines = [rec("created", 0, 1, jobs=[7]), rec("running", 100, 1, host="h1", gpus=[GPU_A]),
             rec("removed", 3700, 1)]
    (tmp_path / "audit.jsonl.2.gz").write_bytes(gzip.compress((lines[0].to_json() + "\n").encode()))
    (tmp_path / "audit.jsonl.1").write_text(lines[1].to_json() + "\n")
    path.write_text(lines[2].to_json() + "\n")
    (tmp_path / "audit.jsonl.lock").write_text("")  # not a rotated file
    files = audit_files(path)
    assert [f.name for f in files] == ["audit.jsonl.2.gz", "audit.jsonl.1", "audit.jsonl"]
    records, problems = read_audit(files)
    assert problems == [] and [i.end - i.start for i in intervals(records)] == [3600]


def test_usage_streams_a_gzip_bomb_in_bounded_memory(setup, tmp_path) -> None:
    # issue 22, item 8: usage read whole files, so an 800 KB .gz took it to 845 MB. Here a 400 MB line
    # (about 400 KB compressed), then a record: read in streams, the long line skipped.
    bomb = tmp_path / "audit.jsonl.1.gz"
    with gzip.open(bomb, "wb", compresslevel=6) as out:
        for _ in range(400):
            out.write(b"x" * (1 << 20))
        out.write(b"\n\n" + (rec("created", 0, 1, jobs=[7]).to_json() + "\n").encode())
    assert bomb.stat().st_size < 2 << 20
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
               "print(done.stdout); print(done.stderr, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", measure, program("slurm-nebula-power"), "usage", "--no-cloud",
                           "--json", "--file", str(bomb)], env=run_env(setup), capture_output=True, text=True,
                          timeout=300)
    code, peak_kib = (int(v) for v in done.stdout.split("\n", 1)[0].split())
    assert code == EXIT_OK, done.stderr
    result = json.loads(done.stdout.split("\n", 1)[1])
    assert result["unreadable_lines"] == [f"{bomb}:1: longer than 16384 bytes: not a usage record"]
    assert peak_kib < 150 * 1024, f"{peak_kib} KiB at the most"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant a file as another user")
@pytest.mark.parametrize("plant", ["another user's copy", "a FIFO", "a hard link"])
def test_a_planted_rotated_copy_is_skipped_and_named_never_billed(setup, capsys, plant: str) -> None:
    # issue 34, item 5: usage read rotated copies whatever their owner (another user's file billed 65,417
    # GPU-hours to a job) and a FIFO there made it fail
    audit = setup.audit
    audit.write_text(RECORDS[0].to_json() + "\n")
    planted = audit.with_name(audit.name + ".1")
    forged = [rec("created", 0, 666, jobs=[777]).to_json(),
              rec("running", 1, 666, jobs=[777], host="h9", gpus=[GPU_A]).to_json()]
    if plant == "a FIFO":
        os.mkfifo(planted)
    elif plant == "a hard link":
        other = audit.with_name("elsewhere")
        other.write_text("\n".join(forged) + "\n")
        os.link(other, planted)
    else:
        planted.write_text("\n".join(forged) + "\n")
        nobody = pwd.getpwnam("nobody")
        os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    code, out = run_usage(setup, capsys, "--json", "--no-cloud")
    assert code == EXIT_OK, out
    report = json.loads(out)
    assert all(row["job"] != "777" for row in report["rows"]), "a planted record was billed"
    [skipped] = [line for line in report["unreadable_lines"] if line.startswith(f"{planted}: skipped")]
    assert "not a record file of ours" in skipped
