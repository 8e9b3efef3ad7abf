#!/usr/bin/env bash
# The boot test's worker image (tests/test_real_kvm_boot.py), made by `slurm-nebula-power image build` and
# cached by its inputs, as tests/oned/build.sh caches oned:
#   ${KVM_IMAGE_CACHE:-/var/cache/slurm-nebula-power/images}/bookworm-<12 hex>/worker.qcow2
# The inputs: the builder's modules, this script, the test hook and the one-context source. Debian 12
# (bookworm), since the test's controller is the host's Slurm 22.05; the cloud kernel (pc machine, TCG).
# Usage: image.sh          build unless cached (about 3 minutes), print the image's path
#        image.sh --path   print where the image is or would be; build nothing (exit 1 when absent)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${KVM_IMAGE_CACHE:-/var/cache/slurm-nebula-power/images}"
ONE_APPS="${ONE_APPS_DIR:-$REPO/../shared/one-apps}"
ONE_CONTEXT="$ONE_APPS/one-apps-context-linux-v7.2.1.tar.gz"
SUITE=bookworm
OPTIONS=(--suite "$SUITE" --slurm-release 22.05 --kernel cloud --size 2G --hook "$HERE/test-hook.sh")

die() { echo "image.sh: $*" >&2; exit 1; }
[ -f "$ONE_CONTEXT" ] || die "no $ONE_CONTEXT (OpenNebula's one-apps, see ../shared/one-apps/SOURCE.md)"
# The hook's content counts, not where the checkout is (a clone elsewhere reuses the image).
key="$( { printf '%s\n' "${OPTIONS[@]//"$HERE"/tests/kvm}"
         cat "$REPO"/slurm_nebula_power/image{build,disk,spec}.py "$0" \
         "$HERE/test-hook.sh" "$ONE_CONTEXT"; } | sha256sum | cut -c1-12)"
dest="$CACHE/$SUITE-$key"
if [ "${1:-}" = --path ]; then
    echo "$dest/worker.qcow2"
    [ -f "$dest/worker.qcow2" ]
    exit
fi
if [ -f "$dest/worker.qcow2" ]; then
    echo "$dest/worker.qcow2"
    exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock-$SUITE"
flock 9
if [ -f "$dest/worker.qcow2" ]; then
    echo "$dest/worker.qcow2"
    exit 0
fi
builder="$REPO/.venv/bin/slurm-nebula-power"
[ -x "$builder" ] || builder="$(command -v slurm-nebula-power)" || die "no slurm-nebula-power (pip install -e .)"
tmp="$(mktemp -d "$CACHE/.build-$SUITE-XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
chmod 755 "$tmp"
"$builder" image build --one-context "$ONE_CONTEXT" "${OPTIONS[@]}" --output "$tmp/worker.qcow2" >"$tmp/register" &
child=$!
# A TERM or an interrupt (setup-and-run.sh stopped) reaches the builder, which undoes its mounts and loop devices.
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 143' TERM INT
wait "$child" \
    || { cp "$tmp/worker.qcow2.log" "$CACHE/$SUITE-failed.log" 2>/dev/null; die "image build failed (log: $CACHE/$SUITE-failed.log)"; }
trap - TERM INT
# One image per suite in the cache: the older ones go.
find "$CACHE" -mindepth 1 -maxdepth 1 -name "$SUITE-*" -type d -exec rm -rf {} +
mv "$tmp" "$dest"
trap - EXIT
echo "$dest/worker.qcow2"
