#!/usr/bin/env bash
# Stop what start.sh DIR started: the pids in DIR/pids, their process groups, then any process left
# whose ONE_LOCATION is DIR or whose command line names a path under DIR.  TERM, bounded wait, KILL.
# Idempotent; exit 0 when nothing runs.  Env: ONED_STOP_TIMEOUT (15 s grace for oned's own shutdown).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
GRACE="${ONED_STOP_TIMEOUT:-15}"

[ $# -eq 1 ] || { echo "usage: stop.sh DIR" >&2; exit 2; }
[ -d "$1" ] || exit 0
DIR="$(cd "$1" && pwd -P)"

alive() {  # pids given that still run (zombies excluded)
    local p st
    for p in "$@"; do
        [ -r "/proc/$p/stat" ] || continue
        st="$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f1)" || continue
        [ -n "$st" ] && [ "$st" != Z ] && echo "$p"
    done
    return 0
}

# wait until none of the pids runs, at most $1 seconds; prints those still running
wait_gone() {
    local limit="$1" left
    shift
    local end=$((SECONDS + limit))
    while :; do
        left="$(alive "$@")"
        [ -z "$left" ] && return 0
        [ "$SECONDS" -ge "$end" ] && { echo "$left"; return 0; }
        sleep 0.2
    done
}

pids=()
if [ -f "$DIR/pids" ]; then
    while read -r p; do
        [[ "$p" =~ ^[0-9]+$ ]] && pids+=("$p")
    done < "$DIR/pids"
fi
# process groups of the recorded pids (start.sh makes each a session and group leader)
groups=()
for p in "${pids[@]}"; do
    g="$(ps -o pgid= -p "$p" 2>/dev/null | tr -d ' ')" || true
    [ -n "$g" ] && [ "$g" -gt 1 ] && groups+=("$g")
done
members() {  # every pid in the recorded groups, plus the instance's stray processes
    local g
    for g in "${groups[@]}"; do
        ps -e -o pid=,pgid= | awk -v g="$g" '$2 == g { print $1 }'
    done
    "$PY" "$HERE/onedctl.py" procs "$DIR" 2>/dev/null || true
}

running="$(alive "${pids[@]}")"
if [ -n "$running" ]; then
    # oned first: on TERM it stops its drivers, monitord and scheduler itself
    # shellcheck disable=SC2086
    kill -TERM $running 2>/dev/null || true
    left="$(wait_gone "$GRACE" $running)"
    if [ -n "$left" ]; then
        echo "stop.sh: still running after ${GRACE} s, killing: $(echo $left)" >&2
        # shellcheck disable=SC2086
        kill -KILL $left 2>/dev/null || true
    fi
fi
# then what is left of their groups and anything else of this instance
rest="$(members | sort -un)"
rest="$(alive $rest)"
if [ -n "$rest" ]; then
    # shellcheck disable=SC2086
    kill -TERM $rest 2>/dev/null || true
    # shellcheck disable=SC2086
    left="$(wait_gone 3 $rest)"
    # shellcheck disable=SC2086
    [ -n "$left" ] && kill -KILL $left 2>/dev/null || true
fi
# shellcheck disable=SC2046
rest="$(alive $(members | sort -un))"
if [ -n "$rest" ]; then
    sleep 0.5
    rest="$(alive $rest)"
fi
# oned's lock file (left behind after a KILL) and the pid list: the instance is stopped
rm -f "$DIR/var/lock/.lock"
[ -f "$DIR/pids" ] && : > "$DIR/pids"
if [ -n "$rest" ]; then
    echo "stop.sh: could not stop: $(echo $rest)" >&2
    exit 1
fi
exit 0
