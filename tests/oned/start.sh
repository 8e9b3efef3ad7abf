#!/usr/bin/env bash
# Start a real OpenNebula front end (oned + scheduler + monitord + dummy drivers + OneGate) under DIR,
# on 127.0.0.1 only, set it up for slurm-nebula-power's tests and print on stdout:
#   ENDPOINT=http://127.0.0.1:<port>/RPC2
#   AUTH=slurm:<password>          (the unprivileged user the tests act as, made as docs/installation.md says)
#   ADMIN_AUTH=oneadmin:<password> (for what only an administrator does: hosts, users, quotas)
#   ONEGATE=http://127.0.0.1:<port>
# (also in DIR/env; DIR/cli.env sets ONE_LOCATION, ONE_AUTH, ONE_XMLRPC, PATH for OpenNebula's CLI).
# Everything keeps running; stop it with stop.sh DIR.  Pids started: DIR/pids.
# Env: ONE_VERSION (7.4.0), ONED_HOSTS (4), ONED_GPUS (1 per host), ONED_START_TIMEOUT (90 s per wait),
#      ONED_SCHED_RETRY_TIME (5), ONED_DS_INTERVAL (10, MONITORING_INTERVAL_DATASTORE), ONED_NET_IP (10.66.0.1), ONED_NET_SIZE (4000), ONED_CACHE (see build.sh),
#      ONED_STATE_VM_PERIOD, ONED_MONITOR_VM_PERIOD (monitord's PROBES_PERIOD, stock 5 and 30 s: one Ruby
#      probe per host each period, stretch them for tens of hosts), ONED_EXEC_VM_PERIOD (7.4's EXEC_VM, stock
#      5 s, here 3600: results of `onevm exec` through a guest agent, which dummy VMs do not have),
#      ONED_VM_MAD (dummy; qemu keeps oned's stock qemu VM_MAD and IM_MAD too: tests/kvm), ONED_ONEGATE_ADDR
#      (127.0.0.1: the ONEGATE_ENDPOINT oned gives VMs; another address makes OneGate listen on all of the
#      namespace's addresses), ONED_SLURM_USER (1: make the unprivileged user the tests act as, which owns the
#      templates; 0: no such user, the templates oneadmin's and an image slurm-worker for the steps of
#      docs/installation.md, AUTH is then oneadmin's).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VERSION="${ONE_VERSION:-7.4.0}"
HOSTS="${ONED_HOSTS:-4}"
GPUS="${ONED_GPUS:-1}"
TIMEOUT="${ONED_START_TIMEOUT:-90}"
SCHED_RETRY="${ONED_SCHED_RETRY_TIME:-5}"
DS_INTERVAL="${ONED_DS_INTERVAL:-10}"
NET_IP="${ONED_NET_IP:-10.66.0.1}"
NET_SIZE="${ONED_NET_SIZE:-4000}"
PY="${PYTHON:-python3}"

die() { echo "start.sh: $*" >&2; exit 1; }
T0="$EPOCHREALTIME"
log() { echo "start.sh: [$(awk "BEGIN { printf \"%5.1f\", $EPOCHREALTIME - $T0 }") s] $*" >&2; }

[ $# -eq 1 ] || die "usage: start.sh DIR"
case "$HOSTS$GPUS" in *[!0-9]*) die "ONED_HOSTS and ONED_GPUS must be numbers" ;; esac
[ "$GPUS" -le 200 ] || die "ONED_GPUS at most 200"

INSTALL="$(bash "$HERE/build.sh" "$VERSION" | tail -n 1)"
[ -f "$INSTALL/.complete" ] || die "build.sh gave no complete install for $VERSION"
log "install: $INSTALL"

mkdir -p "$1"
DIR="$(cd "$1" && pwd -P)"
case "$DIR" in *[\|\ \&\\]*) die "DIR must not contain '|', '&', '\\' or spaces: $DIR" ;; esac

# ---- a fresh instance directory --------------------------------------------------------------------
if [ -s "$DIR/pids" ]; then
    while read -r pid; do
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            die "an instance still runs in $DIR (pid $pid): run stop.sh $DIR first"
        fi
    done < "$DIR/pids"
fi
if [ -n "$(ls -A "$DIR")" ]; then
    [ -f "$DIR/.oned-instance" ] || die "$DIR is not empty and holds no earlier instance; give an empty directory"
    find "$DIR" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
fi

# Layout: read-only parts of the install are symlinks into the cache; etc/ and var/ (configs, database,
# logs, remotes) are this instance's own copies.
for d in bin sbin lib share include; do
    [ -e "$INSTALL/$d" ] && ln -s "$INSTALL/$d" "$DIR/$d"
done
cp -a "$INSTALL/etc" "$DIR/etc"
cp -a "$INSTALL/var" "$DIR/var"
echo "$INSTALL" > "$DIR/.oned-instance"
: > "$DIR/pids"
mkdir -p "$DIR/var/one_db" "$DIR/var/run" "$DIR/var/lock" "$DIR/var/tmp/one" "$DIR/dummy_actions" "$DIR/home"

# ---- fixed paths outside ONE_LOCATION, made per instance -------------------------------------------
# /var/tmp/one_db (monitord client's config, pid and metrics; scripts_common.sh reads the monitord
# address from there) and /tmp/one-monitord-<host id>.pid would be shared by all instances.
R="$DIR/var/remotes"
grep -rlI -e /var/tmp/one_db -e /tmp/one-monitord- "$R" | xargs -r sed -i \
    -e "s|/var/tmp/one_db|$DIR/var/one_db|g" -e "s|/tmp/one-monitord-|$DIR/var/run/one-monitord-|g"
# The shepherd kills every "…/monitord-client.rb <hv> <host id> <host name>" but its own: match only
# this instance's client (host ids and names repeat across instances).
SHEPHERD="$R/im/dummy-probes.d/host/beacon/monitord-client-shepherd_local.sh"
sed -i "s|grep \"/monitord-client.rb |grep \"$R/im/dummy.d/monitord-client.rb |" "$SHEPHERD"
grep -q "$R/im/dummy.d/monitord-client.rb" "$SHEPHERD" || die "could not patch $SHEPHERD"
# START_MONITOR answers only after the control script's `sleep 10` (it checks that the client still runs):
# hosts turn MONITORED 10 s after creation.  2 s is enough for that check here and saves 8 s per start.
CONTROL="$R/im/dummy.d/monitord-client_control.sh"
sed -i 's|^    sleep 10$|    sleep 2|' "$CONTROL"
grep -q '^    sleep 2$' "$CONTROL" || die "could not patch $CONTROL"
# No internet: the default marketplaces' drivers (OpenNebula Public, Linux Containers, ...) become stubs
# that fail at once, so nothing is sent out before setup disables those marketplaces.
for d in "$R"/market/*/; do
    case "$(basename "$d")" in http|s3) continue ;; esac
    for f in "$d"*; do
        [ -f "$f" ] || continue
        printf '#!/bin/sh\necho "marketplace driver disabled in this test front end (no internet)" >&2\nexit 1\n' > "$f"
        chmod 755 "$f"
    done
done
# The dummy host probe reports ONED_GPUS GPUs (stock: one, 02:00.0).
"$PY" "$HERE/onedctl.py" probe "$R/im/dummy-probes.d/host/system/system.rb" "$GPUS"
# A VM status probe reporting the states a test forces (DIR/forced_vm_states): host failure, killed qemu.
mkdir -p "$R/im/dummy-probes.d/vm/status"
"$PY" "$HERE/onedctl.py" forced-probe "$R/im/dummy-probes.d/vm/status" "$DIR/forced_vm_states"

# ---- ports and configuration -----------------------------------------------------------------------
read -r ONED_PORT MON_PORT HM_PUB HM_REP GATE_PORT GRPC_PORT <<<"$("$PY" "$HERE/onedctl.py" ports 6 | tr '\n' ' ')"
"$PY" "$HERE/onedctl.py" configure "$DIR" oned_port="$ONED_PORT" monitord_port="$MON_PORT" \
    hm_pub_port="$HM_PUB" hm_rep_port="$HM_REP" onegate_port="$GATE_PORT" grpc_port="$GRPC_PORT" sched_retry_time="$SCHED_RETRY" ds_interval="$DS_INTERVAL" \
    state_vm="${ONED_STATE_VM_PERIOD:-}" monitor_vm="${ONED_MONITOR_VM_PERIOD:-}" exec_vm="${ONED_EXEC_VM_PERIOD:-3600}" \
    vm_mad="${ONED_VM_MAD:-dummy}" onegate_addr="${ONED_ONEGATE_ADDR:-127.0.0.1}"
PASSWORD="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
AUTH="oneadmin:$PASSWORD"
( umask 077; echo "$AUTH" > "$DIR/one_auth" )
ENDPOINT="http://127.0.0.1:$ONED_PORT/RPC2"
ONEGATE="http://127.0.0.1:$GATE_PORT"
cat > "$DIR/cli.env" <<EOF
export ONE_LOCATION=$DIR
export ONE_AUTH=$DIR/one_auth
export ONE_XMLRPC=$ENDPOINT
export ONEGATE_ENDPOINT=$ONEGATE
export RUBYLIB=$DIR/lib/ruby
export PATH=$DIR/bin:\$PATH
EOF
cat > "$DIR/ports" <<EOF
oned=$ONED_PORT
monitord=$MON_PORT
hook_publisher=$HM_PUB
hook_replier=$HM_REP
onegate=$GATE_PORT
grpc=$GRPC_PORT
EOF

run_env=(env ONE_LOCATION="$DIR" ONE_AUTH="$DIR/one_auth" ONE_XMLRPC="$ENDPOINT" RUBYLIB="$DIR/lib/ruby"
         ONE_DUMMY_ACTIONS_DIR="$DIR/dummy_actions" HOME="$DIR/home" PATH="$DIR/bin:$PATH" LANG=C.UTF-8)

fail() {
    echo "start.sh: $*" >&2
    if [ -f "$DIR/var/oned.log" ]; then
        echo "---- tail of $DIR/var/oned.log" >&2
        tail -n 25 "$DIR/var/oned.log" >&2
    fi
    [ -s "$DIR/var/oned.stdout" ] && { echo "---- $DIR/var/oned.stdout" >&2; tail -n 10 "$DIR/var/oned.stdout" >&2; }
    if [ "${ONED_KEEP_ON_FAILURE:-0}" != 1 ]; then
        bash "$HERE/stop.sh" "$DIR" >&2 || true
    fi
    exit 1
}

# ---- start -----------------------------------------------------------------------------------------
# One oned starts at a time on this machine, up to "ready" (the host's run and the roots' share this lock:
# their starts run on the host's / by chroot). Each start spawns a dozen Ruby drivers that must answer
# oned's INIT within 10 s (Driver.h, hard-coded); two or three starting at once on a loaded 2-core CI
# machine missed it ("Unable to start driver 'dummy': Driver initialization time out").
START_LOCK="${ONED_CACHE:-/var/cache/slurm-nebula-power/oned}/start.lock"
mkdir -p "$(dirname "$START_LOCK")"
exec 9>>"$START_LOCK"
flock -w 900 9 || die "another oned start held $START_LOCK for 900 s"
log "OpenNebula $VERSION in $DIR: oned :$ONED_PORT, monitord :$MON_PORT, hooks :$HM_PUB/:$HM_REP, OneGate :$GATE_PORT"
cd "$DIR/var"
# Ahead of the tests' load while it starts (nice -10, given back at "ready" below): the drivers it starts
# must answer within those 10 s.
setsid nice -n -10 "${run_env[@]}" "$DIR/bin/oned" -f </dev/null >"$DIR/var/oned.stdout" 2>&1 9>&- &
ONED_PID=$!
echo "$ONED_PID" >> "$DIR/pids"
"$PY" "$HERE/onedctl.py" wait-rpc "$ENDPOINT" "$AUTH" "$TIMEOUT" "$ONED_PID" >"$DIR/version" \
    || fail "oned did not come up"
log "oned $(cat "$DIR/version") answers (pid $ONED_PID)"

setsid "${run_env[@]}" ruby "$DIR/lib/onegate/onegate-server.rb" </dev/null \
    >>"$DIR/var/onegate.log" 2>>"$DIR/var/onegate.error" 9>&- &
GATE_PID=$!
echo "$GATE_PID" >> "$DIR/pids"
echo "$GATE_PID" > "$DIR/var/onegate.pid"

# oneadmin sets the cloud up; the tests act as the unprivileged user setup makes (its session on stdout).
USER_AUTH="$("$PY" "$HERE/onedctl.py" setup "$ENDPOINT" "$AUTH" "$HOSTS" "$NET_IP" "$NET_SIZE")" \
    || fail "setup over XML-RPC failed"
( umask 077; echo "$USER_AUTH" > "$DIR/slurm_auth" )
log "set up: $HOSTS hosts x $GPUS GPUs, network, templates"
"$PY" "$HERE/onedctl.py" wait-http "$ONEGATE" "$TIMEOUT" "$GATE_PID" \
    || { tail -n 20 "$DIR/var/onegate.error" >&2 || true; fail "OneGate did not come up"; }
log "OneGate answers (pid $GATE_PID)"
"$PY" "$HERE/onedctl.py" wait-ready "$ENDPOINT" "$AUTH" "$HOSTS" "$GPUS" "$TIMEOUT" || fail "the cloud did not get ready"
log "ready: every host MONITORED, datastore 0 monitored"
renice -n 0 -g "$ONED_PID" >/dev/null 2>&1 || true  # oned, its drivers and monitor: the process group setsid made
exec 9>&-  # the next start may go

printf 'ENDPOINT=%s\nAUTH=%s\nADMIN_AUTH=%s\nONEGATE=%s\n' "$ENDPOINT" "$USER_AUTH" "$AUTH" "$ONEGATE" > "$DIR/env.tmp"
mv "$DIR/env.tmp" "$DIR/env"
cat "$DIR/env"
