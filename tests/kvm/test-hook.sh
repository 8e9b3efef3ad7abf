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
# Where the boot's time goes, on the console (the test prints it): systemd-analyze once the boot is done.
cat >/etc/systemd/system/snp-kvm-boot-times.service <<'EOT'
[Unit]
Description=the boot test: systemd-analyze on the console
After=one-context.service

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'systemd-analyze blame | head -n 8 | sed "s/^/snp-kvm-blame: /"'
StandardOutput=journal+console

[Install]
WantedBy=one-context.service
EOT
systemctl enable snp-kvm-boot-times.service
