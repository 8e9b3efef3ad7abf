#!/bin/sh
# The boot test's site hook (tests/kvm/image.sh passes it to `image build --hook`): the test controller's
# own paths, which a configless slurmd takes from its slurm.conf, exist in the guest too. The test's
# slurmctld keeps its munge socket, spool, pid and log files under one directory (tests/slurmharness.py),
# where a site's are Debian's defaults; the guest's munged listens on Debian's socket.
set -eu
base=/tmp/snp-kvm-slurm
cat >/etc/tmpfiles.d/snp-kvm-test.conf <<EOT
d $base 0755 root root -
d $base/munge 0755 root root -
L+ $base/munge/munge.socket - - - - /run/munge/munge.socket.2
d $base/spool 0755 root root -
d $base/run 0755 root root -
d $base/log 0755 root root -
EOT
echo "snp-kvm-test hook: $base for the test controller (Debian $IMAGE_RELEASE, kernel $IMAGE_KERNEL)"
