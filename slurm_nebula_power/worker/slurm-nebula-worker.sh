#!/bin/sh
# slurm-nebula-worker: boot an OpenNebula VM straight into its Slurm node (slurm-nebula-power).
#
# Runs as root at every boot of the VM. `slurm-nebula-power template` puts it in the VM template as
# CONTEXT START_SCRIPT_BASE64, which the context packages run at each boot; it can also be installed in
# the image and run by a unit or by hand:
#
#     slurm-nebula-worker.sh [CONTEXT-FILE]
#
# It installs the cluster's munge key (mode 0400, owned by munge), starts munged, starts slurmd as
# the node the VM was made for (`slurmd -N $SLURM_NODENAME --conf-server $SLURM_CONTROLLER`: configless,
# the image needs no slurm.conf, and slurmd fetches gres.conf with it; 23.11+ also gets `--instance-id $VMID
# --instance-type opennebula`; where nvidia-smi is installed it runs first, so the GPU device files that
# gres.conf names exist), then reports READY=YES through OneGate, with retries. A CONTEXT variable that is
# missing or wrong makes it refuse, visibly (console, stderr and the log), and READY is never reported:
# with the node set's wait_for = "ready", resume then hands the node back to Slurm.
#
# It is the only one to report READY: the template sets REPORT_READY = "NO", so one-context's net-99 stays
# out (6.8.x reports READY=YES even after a refusal; 6.10+ runs READY_SCRIPT_PATH, which cannot execute
# where /run is mounted noexec, as initramfs-tools does on Debian and Ubuntu).
#
# Reruns are safe: one-context runs its scripts again on a context change (onevm updateconf), a disk
# resize or a swap attach. munged is restarted only when the key changed or munged is not running, slurmd
# only when it is not running or its node, controller or options changed: never under running jobs.
#
# CONTEXT variables: from CONTEXT-FILE (shell KEY='value' lines) when given, else the environment (the
# context packages export them to START_SCRIPT), else the context packages' one_env file. one-context
# never exports the OneGate token: it is taken from TOKENTXT or ONEGATE_TOKEN when set, else from one_env
# (root only, written by loc-16-gen-env), else from token.txt on the context CD ($MOUNT_DIR/token.txt).
#   SLURM_NODENAME     the Slurm node name of this VM                        required
#   SLURM_CONTROLLER   slurmctld as host[:port], comma-separated for backups required
#                      (or ONEAPP_SLURM_CONTROLLER_IP, as OpenNebula's SlurmWorker appliance names it)
#   MUNGE_KEY_BASE64   the cluster's munge key, base64                       required
#                      (or ONEAPP_MUNGE_KEY_BASE64)
#   SLURMD_OPTIONS     more slurmd options, split on blanks                  optional
#   ONEGATE_ENDPOINT, VMID, TOKENTXT (or ONEGATE_TOKEN): OneGate; CONTEXT TOKEN="YES" provides them
#
# Exit status: 0 slurmd running (READY reported when OneGate answered), 2 CONTEXT incomplete or invalid,
# 3 munge failed, 4 slurmd failed.
#
# Defaults are a real VM's; the environment overrides them (tests do):
#   WORKER_LOG=/var/log/slurm-nebula-worker.log   WORKER_CONSOLE=/dev/console
#   WORKER_RUN_DIR=/run/slurm-nebula-worker       (what this boot's slurmd was started with)
#   WORKER_ONE_ENV=/var/run/one-context/one_env   WORKER_INIT=auto (systemd when booted with it) | direct
#   WORKER_TOKEN_FILE=${MOUNT_DIR:-/mnt}/token.txt                WORKER_SLURMD_PID=/run/slurmd.pid
#   WORKER_READY_ATTEMPTS=3  WORKER_READY_WAIT=5 (seconds between attempts to report READY)
#   WORKER_MUNGE_KEY=/etc/munge/munge.key         WORKER_MUNGE_USER=munge   WORKER_MUNGE_RUN=/run/munge
#   WORKER_MUNGED=/usr/sbin/munged  WORKER_SLURMD=/usr/sbin/slurmd  WORKER_RUNUSER=runuser
#   WORKER_SYSTEMCTL=systemctl      WORKER_SYSTEMD_RUN=systemd-run  WORKER_CURL=curl  WORKER_ONEGATE=onegate
#   WORKER_NVIDIA_SMI=nvidia-smi    WORKER_DEV_DIR=/dev
#   MUNGED_OPTIONS (direct mode only)
#
# The munge key is a secret: it is never written anywhere but the key file, and never logged.

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}
export PATH
umask 022

log=${WORKER_LOG:-/var/log/slurm-nebula-worker.log}
console=${WORKER_CONSOLE:-/dev/console}
run_dir=${WORKER_RUN_DIR:-/run/slurm-nebula-worker}
one_env=${WORKER_ONE_ENV:-/var/run/one-context/one_env}
token_file=${WORKER_TOKEN_FILE:-${MOUNT_DIR:-/mnt}/token.txt}
slurmd_pid=${WORKER_SLURMD_PID:-/run/slurmd.pid}
ready_attempts=${WORKER_READY_ATTEMPTS:-3}
ready_wait=${WORKER_READY_WAIT:-5}
init=${WORKER_INIT:-auto}
munge_key=${WORKER_MUNGE_KEY:-/etc/munge/munge.key}
munge_user=${WORKER_MUNGE_USER:-munge}
munge_run=${WORKER_MUNGE_RUN:-/run/munge}
munged=${WORKER_MUNGED:-/usr/sbin/munged}
slurmd=${WORKER_SLURMD:-/usr/sbin/slurmd}
runuser=${WORKER_RUNUSER:-runuser}
systemctl=${WORKER_SYSTEMCTL:-systemctl}
systemd_run=${WORKER_SYSTEMD_RUN:-systemd-run}
curl=${WORKER_CURL:-curl}
onegate=${WORKER_ONEGATE:-onegate}
nvidia_smi=${WORKER_NVIDIA_SMI:-nvidia-smi}
dev_dir=${WORKER_DEV_DIR:-/dev}
slurmd_unit=slurm-nebula-slurmd

say() {
    _line="$(date '+%Y-%m-%d %H:%M:%S' 2>/dev/null) slurm-nebula-worker[$$]: $*"
    printf '%s\n' "$_line" >>"$log" 2>/dev/null
    printf '%s\n' "$_line" >&2
}

to_console() {
    if [ -w "$console" ]; then
        printf 'slurm-nebula-worker: %s\n' "$*" >"$console" 2>/dev/null || :
    fi
}

refuse() {
    _code=$1
    shift
    say "REFUSED: $*"
    to_console "REFUSED: $* (log: $log)"
    exit "$_code"
}

mkdir -p "$(dirname "$log")" 2>/dev/null
rm -f "$run_dir/ready" 2>/dev/null  # an older bootstrap's READY_SCRIPT_PATH check: net-99 must not run it
say "starting (pid $$)"

# ---- CONTEXT --------------------------------------------------------------------------------------
if [ $# -gt 1 ]; then
    refuse 2 "usage: $0 [CONTEXT-FILE]"
fi
if [ $# -eq 1 ]; then
    if [ ! -r "$1" ]; then
        refuse 2 "cannot read the CONTEXT file $1"
    fi
    # shellcheck disable=SC1090
    if ! (. "$1") >/dev/null 2>&1; then
        refuse 2 "the CONTEXT file $1 is not shell KEY='value' lines"
    fi
    # shellcheck disable=SC1090
    . "$1"
    say "CONTEXT from $1"
elif [ -z "${SLURM_NODENAME:-}" ] && [ -r "$one_env" ]; then
    # shellcheck disable=SC1090
    . "$one_env"
    say "CONTEXT from $one_env"
else
    say "CONTEXT from the environment"
fi

node=${SLURM_NODENAME:-}
controller=${SLURM_CONTROLLER:-${ONEAPP_SLURM_CONTROLLER_IP:-}}
key_b64=${MUNGE_KEY_BASE64:-${ONEAPP_MUNGE_KEY_BASE64:-}}
token=${TOKENTXT:-${ONEGATE_TOKEN:-}}
# one-context exports the CONTEXT variables but not the token: loc-16-gen-env puts it in one_env (root only),
# read here in a subshell so nothing else of it leaks; else it is token.txt on the context CD, which
# one-contextd mounts at $MOUNT_DIR while its scripts run. $(cat FILE) shows no secret to ps.
if [ -z "$token" ] && [ -r "$one_env" ]; then
    # shellcheck disable=SC1090
    token=$(. "$one_env" >/dev/null 2>&1; printf '%s' "${TOKENTXT:-}")
    [ -z "$token" ] || say "OneGate token from $one_env"
fi
if [ -z "$token" ] && [ -r "$token_file" ]; then
    token=$(cat "$token_file" 2>/dev/null)
    [ -z "$token" ] || say "OneGate token from $token_file"
fi
# The daemons started below must not inherit the secrets.
unset MUNGE_KEY_BASE64 ONEAPP_MUNGE_KEY_BASE64 TOKENTXT ONEGATE_TOKEN SLURM_CONF

missing=""
[ -n "$node" ] || missing="$missing SLURM_NODENAME"
[ -n "$controller" ] || missing="$missing SLURM_CONTROLLER(or ONEAPP_SLURM_CONTROLLER_IP)"
[ -n "$key_b64" ] || missing="$missing MUNGE_KEY_BASE64(or ONEAPP_MUNGE_KEY_BASE64)"
if [ -n "$missing" ]; then
    refuse 2 "CONTEXT lacks${missing}; add them to the VM template (slurm-nebula-power template writes them)"
fi
case $node in
    *[!A-Za-z0-9._-]*) refuse 2 "SLURM_NODENAME '$node' is not a node name (letters, digits, . _ -)" ;;
esac
case $controller in
    *[!A-Za-z0-9.:,_-]*) refuse 2 "SLURM_CONTROLLER '$controller' is not host[:port][,host[:port]...]" ;;
esac
say "node $node, controller $controller"

# ---- munge ----------------------------------------------------------------------------------------
if ! munge_gid=$(id -g "$munge_user" 2>/dev/null); then
    refuse 3 "no user '$munge_user' in the image: install munge (it creates the user)"
fi
mkdir -p "$(dirname "$munge_key")" 2>/dev/null || refuse 3 "cannot create the directory of $munge_key"
[ -d "$munge_key" ] && refuse 3 "cannot install the munge key as $munge_key: a directory is in the way"
new_key="$munge_key.new.$$"
if ! (umask 077 && printf '%s' "$key_b64" | base64 -d >"$new_key") 2>/dev/null; then
    rm -f "$new_key"
    refuse 2 "MUNGE_KEY_BASE64 is not valid base64"
fi
key_bytes=$(wc -c <"$new_key" | tr -d ' ')
if [ "$key_bytes" -lt 32 ]; then
    rm -f "$new_key"
    refuse 2 "MUNGE_KEY_BASE64 decodes to $key_bytes bytes; a munge key has at least 32"
fi
key_changed=yes
if [ -f "$munge_key" ] && cmp -s "$new_key" "$munge_key"; then
    key_changed=no  # a rerun (one-context's udev rules, onevm updateconf): same key as munged has
fi
if ! chown "$munge_user:$munge_gid" "$new_key" || ! chmod 0400 "$new_key" || ! mv -f "$new_key" "$munge_key"; then
    rm -f "$new_key"
    refuse 3 "cannot install the munge key as $munge_key (owner $munge_user, mode 0400)"
fi
say "munge key installed: $munge_key ($key_bytes bytes, owner $munge_user, mode 0400)"

if [ "$init" = auto ]; then
    if [ -d /run/systemd/system ] && command -v "$systemctl" >/dev/null 2>&1 \
            && command -v "$systemd_run" >/dev/null 2>&1; then
        init=systemd
    else
        init=direct
    fi
fi

# munged is left alone when it runs with this key: a restart under running jobs fails their credentials.
munged_running() {
    if [ "$init" = systemd ]; then
        "$systemctl" is-active --quiet munge.service >/dev/null 2>&1
    else
        [ -r "$munge_run/munged.pid" ] && kill -0 "$(cat "$munge_run/munged.pid")" 2>/dev/null
    fi
}

if [ "$key_changed" = no ] && munged_running; then
    say "munged already runs with this key: left alone"
elif [ "$init" = systemd ]; then
    if ! "$systemctl" restart munge.service >>"$log" 2>&1; then
        refuse 3 "munged did not start: systemctl restart munge.service failed (journalctl -u munge)"
    fi
    say "munged started ($init)"
else
    if ! { mkdir -p "$munge_run" && chown "$munge_user:$munge_gid" "$munge_run" && chmod 0755 "$munge_run"; } \
            2>/dev/null; then
        refuse 3 "cannot prepare $munge_run for munged"
    fi
    if [ -r "$munge_run/munged.pid" ]; then  # run again on this boot: the key may have changed
        kill "$(cat "$munge_run/munged.pid")" 2>/dev/null && sleep 1
    fi
    # munged refuses a key not owned by the user it runs as: run it as the munge user, as its unit does.
    # shellcheck disable=SC2086
    if [ "$(id -u)" -eq 0 ] && [ "$munge_user" != root ]; then
        "$runuser" -u "$munge_user" -- "$munged" ${MUNGED_OPTIONS:-} >>"$log" 2>&1
    else
        "$munged" ${MUNGED_OPTIONS:-} >>"$log" 2>&1
    fi || refuse 3 "munged did not start: $munged exited with $? (see above in $log)"
    say "munged started ($init)"
fi

# ---- slurmd ---------------------------------------------------------------------------------------
# 23.11+: slurmd tells slurmctld the VM's id when it registers. 23.11 to 25.11 replace the InstanceId that
# resume set (scontrol update InstanceId=) with what slurmd reports, which is nothing without these
# options; 26.05 keeps resume's (it takes slurmd's only at a registration after a reboot it did not order).
instance_opts=""
case ${VMID:-} in
    "" | *[!0-9]*) ;;
    *) if "$slurmd" --help 2>&1 | grep -q -e '--instance-id'; then
           instance_opts="--instance-id $VMID --instance-type opennebula"
       fi ;;
esac
# What slurmd runs with; a rerun with the same, while slurmd runs, leaves it alone (jobs keep running).
slurmd_args="$slurmd -N $node --conf-server $controller $instance_opts ${SLURMD_OPTIONS:-}"
slurmd_running() {
    if [ "$init" = systemd ]; then
        "$systemctl" is-active --quiet "$slurmd_unit.service" >/dev/null 2>&1
    else
        [ -r "$slurmd_pid" ] && kill -0 "$(cat "$slurmd_pid")" 2>/dev/null
    fi
}
if [ -r "$run_dir/slurmd.args" ] && [ "$(cat "$run_dir/slurmd.args")" = "$slurmd_args" ] && slurmd_running; then
    say "slurmd already runs as node $node (configless from $controller): left alone"
    slurmd_kept=yes
else
    slurmd_kept=no
    rm -f "$run_dir/slurmd.args"
fi
# gres.conf's File= lines name /dev/nvidia0...; slurmd waits about 20 s for one that is missing, then exits
# ("can't stat gres.conf file"). Loading the NVIDIA driver does not make them: its user-space tools do
# (through nvidia-modprobe), or a udev rule where the image has one. So nvidia-smi runs once before slurmd.
if [ "$slurmd_kept" = no ] && command -v "$nvidia_smi" >/dev/null 2>&1; then
    if timeout 120 "$nvidia_smi" -L >>"$log" 2>&1; then
        gpu_devices=$(cd "$dev_dir" 2>/dev/null && for d in nvidia[0-9]*; do
            [ -e "$d" ] && printf ' %s/%s' "$dev_dir" "$d"; done)
        say "GPU devices:${gpu_devices:- none}"
    else
        say "nvidia-smi -L failed (see above): no GPU driver or no GPU; slurmd will not find the devices gres.conf names"
    fi
fi
if [ "$slurmd_kept" = yes ]; then
    :
elif [ "$init" = systemd ]; then
    # A unit of its own: slurmd outlives the context packages' oneshot service (and their cgroup).
    "$systemctl" stop slurmd.service "$slurmd_unit.service" >/dev/null 2>&1
    "$systemctl" reset-failed "$slurmd_unit.service" >/dev/null 2>&1
    # shellcheck disable=SC2086
    "$systemd_run" --unit="$slurmd_unit" --description="Slurm node daemon for $node (slurm-nebula-worker)" \
        -p Type=forking -p KillMode=process -p Delegate=yes -p LimitNOFILE=131072 \
        -p LimitMEMLOCK=infinity -p LimitSTACK=infinity -p TasksMax=infinity \
        "$slurmd" -N "$node" --conf-server "$controller" $instance_opts ${SLURMD_OPTIONS:-} >>"$log" 2>&1 \
        || refuse 4 "slurmd did not start for node $node against $controller (journalctl -u $slurmd_unit)"
else
    if slurmd_running; then  # another node name, controller or options: the old slurmd makes way
        kill "$(cat "$slurmd_pid")" 2>/dev/null && sleep 1
    fi
    # shellcheck disable=SC2086
    "$slurmd" -N "$node" --conf-server "$controller" $instance_opts ${SLURMD_OPTIONS:-} >>"$log" 2>&1 \
        || refuse 4 "slurmd did not start for node $node against $controller: exited with $? (see above in $log)"
fi
if [ "$slurmd_kept" = no ]; then
    say "slurmd started as node $node (configless from $controller)"
    if mkdir -p "$run_dir" 2>/dev/null; then
        printf '%s\n' "$slurmd_args" >"$run_dir/slurmd.args"
    fi
fi

# ---- READY ----------------------------------------------------------------------------------------
# Reported here only (the template sets REPORT_READY = "NO": see the header), so it is retried here: OneGate
# may still be coming up, or the guest's route to it.
report_ready() {
    if [ -z "${ONEGATE_ENDPOINT:-}" ]; then
        say "READY not reported: no ONEGATE_ENDPOINT in CONTEXT (TOKEN = \"YES\" gives it)"
        return 1
    fi
    if [ -z "$token" ] || [ -z "${VMID:-}" ]; then
        say "READY not reported: no OneGate token or VMID (CONTEXT TOKEN = \"YES\" gives them)"
        return 1
    fi
    _have_onegate=no _have_curl=no
    command -v "$onegate" >/dev/null 2>&1 && _have_onegate=yes
    command -v "$curl" >/dev/null 2>&1 && _have_curl=yes
    if [ "$_have_onegate$_have_curl" = nono ]; then
        say "READY not reported: neither the onegate command nor curl is installed"
        return 1
    fi
    _attempt=1
    while :; do
        # The onegate command reads TOKENTXT and VMID from its environment, which only root can read.
        if [ "$_have_onegate" = yes ] && TOKENTXT=$token VMID=$VMID "$onegate" vm update --data READY=YES \
                >>"$log" 2>&1; then
            return 0
        fi
        # The headers go through stdin (curl -H @-, 7.55+): a token on curl's command line is readable by
        # every local user with ps. printf is a shell builtin, so no process shows it either.
        if [ "$_have_curl" = yes ] && printf 'X-ONEGATE-TOKEN: %s\nX-ONEGATE-VMID: %s\n' "$token" "$VMID" |
                "$curl" -sS -f -X PUT "$ONEGATE_ENDPOINT/vm" --max-time 10 --retry 3 -H @- -d "READY=YES" \
                >>"$log" 2>&1; then
            return 0
        fi
        [ "$_attempt" -lt "$ready_attempts" ] || break
        say "READY not accepted by OneGate ($ONEGATE_ENDPOINT), attempt $_attempt of $ready_attempts"
        _attempt=$((_attempt + 1))
        sleep "$ready_wait"
    done
    return 1
}

if report_ready; then
    say "READY=YES reported to OneGate ($ONEGATE_ENDPOINT)"
else
    say "READY=YES not reported (see above); resume waits for it until boot_timeout"
fi
to_console "node $node is up (slurmd, controller $controller)"
exit 0
