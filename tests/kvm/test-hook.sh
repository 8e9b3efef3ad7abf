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
# Where the boot's time goes, on the console (the test prints it): each stage's start and length, measured
# by systemd, once one-context's last stage is done (systemd-analyze blame waits for the whole boot).
cat >/usr/local/sbin/snp-kvm-boot-times <<'EOT'
#!/bin/sh
for unit in one-context-local one-context-online one-context networking systemd-networkd-wait-online chrony ssh; do
    systemctl show -p InactiveExitTimestampMonotonic -p ActiveEnterTimestampMonotonic "$unit.service" |
        awk -F= -v u="$unit" '{ t[$1] = $2 }
            END { if (t["ActiveEnterTimestampMonotonic"] > 0)
                printf "snp-kvm-blame: %s %.0f s (from %.0f s)\n", u,
                    (t["ActiveEnterTimestampMonotonic"] - t["InactiveExitTimestampMonotonic"]) / 1e6,
                    t["InactiveExitTimestampMonotonic"] / 1e6 }'
done
echo "snp-kvm-blame: uptime $(cut -d' ' -f1 /proc/uptime) s"
EOT
chmod 755 /usr/local/sbin/snp-kvm-boot-times
cat >/etc/systemd/system/snp-kvm-boot-times.service <<'EOT'
[Unit]
Description=the boot test: where the boot's time went, on the console
After=one-context.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/snp-kvm-boot-times
StandardOutput=journal+console

[Install]
WantedBy=one-context.service
EOT
systemctl enable snp-kvm-boot-times.service
