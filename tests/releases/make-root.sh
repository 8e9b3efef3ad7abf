#!/usr/bin/env bash
# Make (once) a Debian root holding another Slurm release, for tests/releases/run-in-root.sh.
#   bash tests/releases/make-root.sh trixie|sid      -> prints the root's path on stdout
# The root is ${SLURM_ROOTS:-/var/cache/slurm-nebula-power/roots}/<suite>-<hash>, where <hash> covers this
# script and the package list: it is reused (CI on the same machine) until either changes. It is built in
# a temporary directory beside it and renamed into place only once complete, so a half-made root is never
# picked up. Progress goes to stderr; the debootstrap log of a failed attempt is kept beside the roots.
# Exit codes: 0 root ready, 2 usage, 75 the root could not be made (one line on stderr says why; sid can be
# briefly uninstallable), which callers report as "SKIPPED: <reason>".
set -euo pipefail

EX_UNAVAILABLE=75
PACKAGES=(slurmctld slurmd slurm-client munge iproute2 python3 python3-venv curl)

say() { printf 'make-root: %s\n' "$*" >&2; }
fail() { printf 'make-root: %s: cannot make the root: %s\n' "$suite" "$*" >&2; exit "$EX_UNAVAILABLE"; }

suite=${1:-}
case "$suite" in
  trixie|sid) ;;
  *) echo "usage: $0 trixie|sid" >&2; exit 2 ;;
esac
[ "$(id -u)" -eq 0 ] || fail "not root (debootstrap and chroot need root)"

roots=${SLURM_ROOTS:-/var/cache/slurm-nebula-power/roots}
self=$(readlink -f "${BASH_SOURCE[0]}")
hash=$({ cat "$self"; printf '%s\n' "$suite" "${PACKAGES[@]}"; } | sha256sum | cut -c1-12)
root="$roots/$suite-$hash"

if [ -f "$root/slurm-version" ]; then  # written last, before the rename: a root that exists is complete
  echo "$root"
  exit 0
fi
mkdir -p "$roots" || fail "cannot create $roots"

# One builder per root at a time; a second caller waits, then finds the finished root.
exec 9>"$roots/.$suite-$hash.lock"
if ! flock -n 9; then
  say "waiting for another make-root of $suite ($root)"
  flock 9
fi
if [ -f "$root/slurm-version" ]; then
  echo "$root"
  exit 0
fi

# The Debian mirror the host itself uses (deb822 .sources files or the one-line format).
mirror=${SLURM_ROOT_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(
    { grep -hE '^[[:space:]]*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -E 's/^[[:space:]]*URIs://'
      grep -hE '^[[:space:]]*deb[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
        sed -E 's/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//' | awk '{print $1}'
    } | tr ' ' '\n' | grep -E '^https?://' | grep -E '/debian/?$' | head -n1
  ) || true
fi
[ -n "$mirror" ] || fail "no Debian mirror (a .../debian URI) in the host's apt sources; set SLURM_ROOT_MIRROR"

if ! command -v debootstrap >/dev/null; then
  say "installing debootstrap"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } >&2 ||
    fail "debootstrap is missing and could not be installed"
fi

# A build killed outright (SIGKILL, power loss) leaves its directory: the lock is ours, so it is stale.
for stale in "$roots/.build-$suite-$hash".*; do
  [ -d "$stale" ] || continue
  say "removing a half-made root of an earlier attempt: $stale"
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v t="$stale" 'index($5, t "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
  rm -rf --one-file-system "$stale"
done
tmp=$(mktemp -d "$roots/.build-$suite-$hash.XXXXXX")
chmod 755 "$tmp"  # it becomes the root's /: mktemp's 0700 would lock out munge's postinst (su munge)
log="$roots/$suite-$hash.log"  # kept only when the build fails
cleanup() {
  # debootstrap mounts proc/sys inside the target while it works, and may leave them when it fails.
  local m
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v t="$tmp" '$5 == t || index($5, t "/") == 1 {print $5}' /proc/self/mountinfo | sort -r)
  rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start=$(date +%s)
say "debootstrap $suite from $mirror into $tmp (a few minutes; log: $log)"
if ! debootstrap --variant=minbase --include="$(IFS=,; echo "${PACKAGES[*]}")" \
      "$suite" "$tmp" "$mirror" >"$log" 2>&1; then
  # The target's own log (dpkg's and the maintainer scripts' output) goes before the directory does.
  if [ -f "$tmp/debootstrap/debootstrap.log" ]; then
    { echo; echo "---- $tmp/debootstrap/debootstrap.log ----"; cat "$tmp/debootstrap/debootstrap.log"; } >>"$log"
  fi
  # The most telling line: debootstrap's E: line, else the package dpkg could not configure (and its
  # first complaint), else an apt dependency problem, else the last line.
  why=$(grep -E '^E: ' "$log" | tail -n1 || true)
  if [ -z "$why" ]; then
    pkg=$(grep -oE 'dpkg: error processing package [^ ]+' "$log" | head -n1 | awk '{print $NF}' || true)
    [ -n "$pkg" ] || pkg=$(grep -oE 'possibly the package [^ ]+ is at fault' "$log" | head -n1 | awk '{print $4}' || true)
    if [ -n "$pkg" ]; then  # the maintainer script's last words come just before dpkg's complaint
      first=$(grep -B1 -m1 -F "dpkg: error processing package $pkg" "$log" | head -n1 || true)
      case "$first" in dpkg:*|"") first="" ;; esac
      why="package $pkg failed to configure${first:+ ($first)}"
    fi
  fi
  [ -n "$why" ] || why=$(grep -iE 'unmet|depends|broken' "$log" | tail -n1 || true)
  [ -n "$why" ] || why=$(tail -n1 "$log")
  fail "debootstrap $suite failed: ${why:-no output} (full log: $log)"
fi

# pip inside the root verifies the package index against this bundle (the root's may be missing or old).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  mkdir -p "$tmp/etc/ssl/certs"
  cp /etc/ssl/certs/ca-certificates.crt "$tmp/etc/ssl/certs/ca-certificates.crt"
fi
rm -f "$tmp"/var/cache/apt/archives/*.deb
rm -rf "$tmp"/var/lib/apt/lists/*_Packages 2>/dev/null || true

version=$(chroot "$tmp" /usr/sbin/slurmctld -V 2>&1) || fail "slurmctld -V failed inside the root: $version"
{
  echo "suite=$suite"
  echo "mirror=$mirror"
  echo "hash=$hash"
  echo "packages=${PACKAGES[*]}"
  echo "made=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "seconds=$(( $(date +%s) - start ))"
  # shellcheck disable=SC2016  # dpkg-query's own ${...} fields
  chroot "$tmp" dpkg-query -W -f='pkg ${Package} ${Version}\n' slurmctld slurmd munge python3 2>/dev/null || true
} >"$tmp/root-info"
echo "$version" >"$tmp/slurm-version"
mv -T "$tmp" "$root" || fail "cannot move $tmp to $root"
rm -f "$log"
say "$suite root ready in $(( $(date +%s) - start ))s: $root ($version)"
echo "$root"
