#!/usr/bin/env bash
# Install everything the tests need on a fresh Debian machine (as root), then run the whole suite.
#   Debian: slurmctld, slurmd, slurm-client, munge (the real-controller tests), iproute2 (the tests'
#   private network namespace), curl (the worker bootstrap reports READY with it).
#   Python: this package with its test extra, in ./.venv.
# Extra arguments go to pytest, e.g.  bash tests/setup-and-run.sh -k resume
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(slurmctld slurmd slurm-client munge iproute2 curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "not root: cannot install ${missing[*]}; the real-Slurm tests will be skipped" >&2
  fi
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77"
.venv/bin/python -m pip install -q -e '.[test]'
# The layout's import rules, the lint and the types (README "Layout"): quick, and they fail the run.
.venv/bin/lint-imports --no-cache >/dev/null || { .venv/bin/lint-imports --no-cache; exit 1; }
.venv/bin/ruff check --quiet .
.venv/bin/mypy --no-error-summary
# A real OpenNebula (oned 7.0.2 and 7.4.0 from the source in $ONE_SOURCE, else ../shared/opennebula), built
# once per machine and cached by the source's checksum (about 9 minutes a release the first time, then 1 s).
# Without the source the real-oned tests are reported SKIPPED with the reason.
if [ -n "${ONE_SOURCE:-}" ] || ls ../shared/opennebula/opennebula-*.tar.gz >/dev/null 2>&1; then
  bash tests/oned/build.sh >/dev/null || echo "the oned build failed: the real-oned tests will be SKIPPED" >&2
else
  echo "no OpenNebula source (ONE_SOURCE unset, no ../shared/opennebula): the real-oned tests will be SKIPPED" >&2
fi
# Two workers: most of the time goes to waiting on real slurmctld/slurmd and oned, which overlaps well. The
# tests of one oned release stay on one worker (loadgroup), so each release starts once.
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "$@"
