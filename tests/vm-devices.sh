#!/bin/sh
# vm-devices.sh GPUS ARGV...: run ARGV in a mount namespace of its own whose /dev is a VM's with GPUS NVIDIA
# GPUs: a fresh tmpfs holding the basic devices, /dev/nvidia0 .. /dev/nvidia<GPUS-1> and /dev/nvidiactl
# (character devices 195:N and 195:255, as the NVIDIA driver makes them; no driver behind them, so they can
# be named and stat()ed, not opened). Nothing outside the namespace changes; it lives as long as the
# processes started in it (slurmd daemonizes and keeps it, and its job steps run in it).
case ${1:-} in
    "" | *[!0-9]*) echo "usage: vm-devices.sh GPUS ARGV..." >&2; exit 2 ;;
esac
# shellcheck disable=SC2016  # the inner script expands its own arguments
exec unshare --mount --propagation private /bin/sh -c '
set -e
gpus=$1
shift
mount -t tmpfs -o mode=0755,size=1m vm-dev /dev
for dev in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
    name=${dev%%:*} numbers=${dev#*:}
    mknod -m 0666 "/dev/$name" c "${numbers%:*}" "${numbers#*:}"
done
ln -s /proc/self/fd /dev/fd
ln -s fd/0 /dev/stdin
ln -s fd/1 /dev/stdout
ln -s fd/2 /dev/stderr
mkdir /dev/pts /dev/shm
mount -t tmpfs -o mode=1777 vm-shm /dev/shm
i=0
while [ "$i" -lt "$gpus" ]; do
    mknod -m 0666 "/dev/nvidia$i" c 195 "$i"
    i=$((i + 1))
done
[ "$gpus" -eq 0 ] || mknod -m 0666 /dev/nvidiactl c 195 255
exec "$@"' vm-devices "$@"
