#!/usr/bin/env bash
# Run the project's real-controller tests (`pytest -m slurm`) against another Slurm release, inside a
# Debian root made by make-root.sh:
#   bash tests/releases/run-in-root.sh trixie|sid [pytest args...]     e.g.  ... trixie -x -q -n 2
#   RUN_IN_ROOT_REF=HEAD bash tests/releases/run-in-root.sh ...          (a commit instead of the work tree)
#   RUN_IN_ROOT_PATCHES="fix.patch" ...                                 (patches applied to the copy only)
# Steps: make the root if needed; copy this working tree (without .venv, .git, caches) to ROOT/src; create
# or reuse ROOT/venvs/<hash of pyproject.toml> (pip install -e '.[test]'); then, in a private mount namespace,
# mount /proc, /dev (bind, plus /dev/pts and /dev/shm) and /sys (--rbind: slurmd 24.11+ needs the cgroup
# mounts below it), chroot and run pytest; unmount in reverse order on every exit (trap), Ctrl-C included.
# The mounts live in a mount namespace of this run only, so even a SIGKILL cannot leave them on the host.
# One run per root at a time (a lock; a second run of the same suite waits); different suites run in
# parallel. Exit code: pytest's; 75 when the root cannot be made (the release is SKIPPED, reason on stderr);
# 2 usage; 70 when the venv cannot be made.
set -euo pipefail

EX_UNAVAILABLE=75
EX_SOFTWARE=70
here=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
project=$(cd "$here/../.." && pwd)
self="$here/run-in-root.sh"

say() { printf 'run-in-root: %s: %s\n' "${suite:-?}" "$*" >&2; }
now() { date +%s; }

# ---- inside the private mount namespace: mount, chroot, run, unmount ----------------------------------
inner() {
  set +e
  set -uo pipefail
  local root=$RUN_IN_ROOT_ROOT venv=$RUN_IN_ROOT_VENV
  local -a mounted=()
  local pid="" rc=0

  # shellcheck disable=SC2329  # called by the EXIT trap
  cleanup() {
    local i m left
    trap - INT TERM
    # Nothing started inside the root may outlive the run (a daemon a crashed test left, a job step):
    # only processes whose root is this root (or the host's / below it: a real oned), which (lock held) are
    # this run's.
    for sig in TERM KILL; do
      left=$(leftover_pids)
      [ -n "$left" ] || break
      say "stopping processes left in the root ($sig): $(for p in $left; do
            printf '%s(%s) ' "$p" "$(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-60)"; done)"
      # shellcheck disable=SC2086
      kill -s "$sig" $left 2>/dev/null
      sleep 2
    done
    left=$(leftover_pids)
    [ -z "$left" ] || say "WARNING: processes still in the root: $left"
    for (( i=${#mounted[@]}-1; i>=0; i-- )); do
      m=${mounted[i]}
      umount -R "$m" 2>/dev/null || { sleep 1; umount -R "$m" 2>/dev/null; } ||
        { say "umount $m busy; detaching it lazily"; umount -R -l "$m"; }
    done
    if awk -v r="$root" 'index($5, r "/") == 1 {found=1} END {exit !found}' /proc/self/mountinfo; then
      say "WARNING: mounts left under $root (in this run's namespace only)"
    fi
  }
  # shellcheck disable=SC2329  # called by cleanup
  leftover_pids() {
    local p out=""
    for p in /proc/[0-9]*; do
      [ "${p#/proc/}" = "$$" ] && continue
      case "$(readlink "$p/root" 2>/dev/null)" in "$root" | "$root/host") out+="${p#/proc/} " ;; esac
    done
    printf '%s' "${out% }"
  }
  trap cleanup EXIT
  # Ctrl-C reaches pytest too (same process group): let it stop its clusters, then clean up. A TERM sent
  # to this script alone is passed on to pytest as an interrupt.
  trap 'say "interrupted; waiting for pytest to stop its clusters"' INT
  trap 'say "terminated; interrupting pytest"; [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null' TERM

  mnt() {  # mnt TARGET mount-args...: mount and remember for the reverse-order unmount
    local target=$1; shift
    mount "$@" "$target" || { say "mount $* $target failed"; exit "$EX_SOFTWARE"; }
    mounted+=("$target")
  }
  # The root onto itself first: inside the chroot "/" is then a mount point, which `unshare --mount
  # --propagation private` needs (tests/test_worker.py's guests: "cannot change root filesystem
  # propagation: Invalid argument" otherwise).
  mnt "$root" --bind "$root"
  mnt "$root/proc" -t proc proc
  mnt "$root/sys" --rbind /sys
  mount --make-rslave "$root/sys"  # (private namespace already; belt and braces for umount -R)
  mnt "$root/dev" --bind /dev
  [ -d /dev/pts ] && mnt "$root/dev/pts" --bind /dev/pts
  [ -d /dev/shm ] && mnt "$root/dev/shm" --bind /dev/shm
  # The host's own / at /host: the real oned (tests/oned) is built for the host's Debian and cannot run on
  # the root's libraries, so the root's tests start it with `chroot /host` (tests/onedfix.py), in their own
  # network namespace as on the host; its files under the root's /tmp are $root/tmp/... there.
  mkdir -p "$root/host"
  mnt "$root/host" --rbind /
  mount --make-rslave "$root/host"
  # Host names from /etc/hosts only, for the tests (pip, before, used DNS). In the tests' network namespace
  # no DNS server is reachable, so looking up a CLOUD node's name (its NodeAddr once powered down) fails
  # with EAI_AGAIN, which Debian's slurmctld 26.05.5 retries ten times a second apart, per node, holding
  # up the controller (`scontrol` times out); with "files" alone it fails at once (EAI_NONAME), as a site
  # DNS answering NXDOMAIN would. RUN_IN_ROOT_DNS=1 keeps the root's own nsswitch.conf.
  if [ "${RUN_IN_ROOT_DNS:-0}" != 1 ] && [ -f "$root/etc/nsswitch.conf" ]; then
    nss=$(mktemp)
    sed -E 's/^(hosts:).*/\1 files/' "$root/etc/nsswitch.conf" >"$nss"
    chmod 644 "$nss"
    mnt "$root/etc/nsswitch.conf" --bind "$nss"
    rm -f "$nss"  # the mount keeps the file alive
  fi

  local -a envv=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
                 "TERM=${TERM:-dumb}" PYTHONDONTWRITEBYTECODE=1)
  local v
  for v in COLUMNS PYTEST_ADDOPTS PYTEST_XDIST_AUTO_NUM_WORKERS SLURM_NEBULA_POWER_TEST_NETNS ONE_SOURCE ONED_CACHE PROBE_OUT \
           ONED_VERSIONS; do
    [ -n "${!v:-}" ] && envv+=("$v=${!v}")
  done
  # For tests/onedfix.py: where the host's / is, where this root is in it, and OpenNebula's source there.
  envv+=(SNP_HOST_ROOT=/host "SNP_ROOT_ON_HOST=$root" "ONE_SHARED=$project/../shared/opennebula")
  local t0; t0=$(now)
  say "pytest -m slurm $* (in $root, Slurm $(cat "$root/slurm-version"))"
  # Started in the background so that `wait` (unlike a foreground command) lets the traps run at once;
  # --default-signal undoes the SIGINT-ignore bash gives background jobs, so Ctrl-C still stops pytest.
  # shellcheck disable=SC2016  # $0 and $@ are the inner shell's
  env --default-signal=INT,QUIT chroot "$root" /usr/bin/env -i "${envv[@]}" /bin/sh -c \
    'cd /src && exec "$0" -m pytest -m slurm "$@"' "$venv/bin/python" "$@" &
  pid=$!
  wait "$pid"; rc=$?
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done
  say "pytest exit $rc after $(( $(now) - t0 ))s (whole run $(( $(now) - ${RUN_IN_ROOT_T0:-t0} ))s)"
  local kept
  kept=$(find "$root/tmp" -maxdepth 1 -name 'snp-slurm-*' -type d 2>/dev/null | sort | tr '\n' ' ')
  [ -n "$kept" ] && say "cluster directories kept by failed tests (until the next run): $kept"
  exit "$rc"
}

if [ "${1:-}" = "--inner" ]; then
  suite=$2; shift 2
  inner "$@"
fi

# ---- outside: root, project copy, venv, then re-enter in a private mount namespace -------------------
suite=${1:-}
case "$suite" in
  trixie|sid) shift ;;
  *) echo "usage: $0 trixie|sid [pytest args...]" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || { say "must run as root (mount, chroot)"; exit 2; }
t_start=$(now)

errf=$(mktemp)
trap 'rm -f "$errf"' EXIT
set +e
# make-root's stdout (the path) is captured through fd 3; its stderr shows live and is kept for the reason.
root=$( { bash "$here/make-root.sh" "$suite" 2>&1 1>&3 | tee "$errf" >&2; } 3>&1 )
rc=$?  # make-root's own code (pipefail; tee succeeds)
set -e
if [ "$rc" -ne 0 ]; then
  reason=$(grep -E 'cannot make the root' "$errf" | tail -n1 | sed -E 's/^make-root: [a-z]+: cannot make the root: //')
  say "SKIPPED: ${reason:-make-root.sh exited $rc}"
  [ "$rc" -eq "$EX_UNAVAILABLE" ] && exit "$EX_UNAVAILABLE"
  exit "$rc"
fi
t_root=$(now)

# One run per root: the copy in /src, the venv and the mounts are the root's own.
exec 8>"$root/.run.lock"
if ! flock -n 8; then
  say "waiting for another run in $root"
  flock 8
fi

# A fresh copy of the working tree, taken now (an edit in flight elsewhere shows up as this run's state);
# RUN_IN_ROOT_REF=<commit> copies that commit instead (git archive: a consistent snapshot, .git untouched).
rm -rf --one-file-system "$root/src" "$root/tmp"/snp-* 2>/dev/null || true
mkdir -p "$root/src"
if [ -n "${RUN_IN_ROOT_REF:-}" ]; then
  say "copying $RUN_IN_ROOT_REF ($(git -C "$project" rev-parse --short "$RUN_IN_ROOT_REF")) of $project"
  git -C "$project" archive "$RUN_IN_ROOT_REF" | tar -C "$root/src" -xf -
else
  tar -C "$project" -cf - \
      --exclude=./.git --exclude=./.venv --exclude='./venv*' --exclude=__pycache__ --exclude=.pytest_cache \
      --exclude=.mypy_cache --exclude=.ruff_cache --exclude='*.egg-info' --exclude=./build --exclude=./dist . |
    tar -C "$root/src" -xf -
fi
# RUN_IN_ROOT_PATCHES="x.patch y.patch" (diff -u a/ b/, -p1) are applied to the copy, never to the work
# tree: a way to try a fix against another release before it lands.
for p in ${RUN_IN_ROOT_PATCHES:-}; do
  say "applying $p to the copy"
  patch -d "$root/src" -p1 --forward --batch --quiet <"$p" >&2 || { say "patch $p does not apply"; exit "$EX_SOFTWARE"; }
done
t_copy=$(now)

# The venv is keyed on pyproject.toml (dependencies, entry points): reused while that file is unchanged.
# The install is editable (/src), so each run's fresh copy is what gets imported.
key=$(sha256sum "$root/src/pyproject.toml" | cut -c1-12)
venv=/venvs/$key
if [ ! -f "$root$venv/.complete" ]; then
  say "creating venv $venv (pip install -e '.[test]')"
  rm -rf --one-file-system "$root$venv"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true  # pip needs DNS (PyPI)
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt" 2>/dev/null || true
  pipenv=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8)
  for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
    [ -n "${!v:-}" ] && pipenv+=("$v=${!v}")
  done
  if ! chroot "$root" /usr/bin/env -i "${pipenv[@]}" /bin/sh -ec "
        python3 -m venv $venv
        $venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 'setuptools>=77'
        cd /src && $venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
      " >&2; then
    rm -rf --one-file-system "$root$venv"
    say "cannot create the venv in $root (pip install failed; see above)"
    exit "$EX_SOFTWARE"
  fi
  touch "$root$venv/.complete"
  # Older venvs (another pyproject.toml) are not used again by this root.
  find "$root/venvs" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -exec rm -rf --one-file-system {} +
fi
t_venv=$(now)
say "root $(( t_root - t_start ))s, copy $(( t_copy - t_root ))s, venv $(( t_venv - t_copy ))s: $root"

# Re-enter in a private mount namespace (unshare execs: same pid, so the lock on fd 8 stays held).
export RUN_IN_ROOT_ROOT=$root RUN_IN_ROOT_VENV=$venv RUN_IN_ROOT_T0=$t_start
rm -f "$errf"
trap - EXIT
exec unshare --mount --propagation private -- bash "$self" --inner "$suite" "$@"
