#!/usr/bin/env bash
# Build OpenNebula (oned, drivers, CLI, OneGate) from source and install it self-contained into a cache:
#   ${ONED_CACHE:-/var/cache/slurm-nebula-power/oned}/<version>-<12 hex of the source checksum>/
# Usage: build.sh [VERSION...]   (7.0.2, 7.4.0; default both; with ONE_SOURCE set, default: its version)
# Prints one line per version: the install path.  Cached installs are reused (seconds).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
SHARED="${ONE_SHARED:-$HERE/../../../shared/opennebula}"  # opennebula-<version>.tar.gz, unless ONE_SOURCE
CACHE="${ONED_CACHE:-/var/cache/slurm-nebula-power/oned}"
JOBS="${ONED_BUILD_JOBS:-$(nproc)}"

die() { echo "build.sh: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }

DEB_PACKAGES="git scons g++ make bison flex pkg-config bc curl ca-certificates libxmlrpc-c++8-dev
  libsqlite3-dev libxml2-dev libssl-dev libcurl4-openssl-dev libzmq3-dev zlib1g-dev sqlite3
  ruby ruby-dev ruby-nokogiri ruby-xmlrpc ruby-sqlite3 ruby-sinatra ruby-ffi-rzmq ruby-sequel
  ruby-highline ruby-json ruby-curb ruby-uuidtools ruby-ox puma ruby-rack ruby-net-ldap ruby-augeas
  ruby-ipaddress ruby-treetop ruby-parse-cron"

ensure_packages() {
    local missing=() p
    for p in $DEB_PACKAGES; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install failed for: ${missing[*]}"
}

missing_source() {
    die "no OpenNebula $1 source at ${2}: set ONE_SOURCE to a checkout of OpenNebula's repository at a release" \
        "tag (e.g. release-7.4.0) or to a tarball of one"
}

# Resolve the source for VERSION: prints its path.
source_for() {
    local version="$1" src
    if [ -n "${ONE_SOURCE:-}" ]; then
        src="$ONE_SOURCE"
    else
        src="$SHARED/opennebula-$version.tar.gz"
    fi
    [ -e "$src" ] || missing_source "$version" "$src"
    if [ -d "$src" ]; then
        [ -f "$src/SConstruct" ] && [ -f "$src/install.sh" ] || missing_source "$version" "$src (not a source tree)"
        (cd "$src" && pwd)
    else
        echo "$(cd "$(dirname "$src")" && pwd)/$(basename "$src")"
    fi
}

# Version a source declares (src/im_mad/remotes/VERSION), or empty.
source_version() {
    local src="$1"
    if [ -d "$src" ]; then
        cat "$src/src/im_mad/remotes/VERSION" 2>/dev/null | tr -d '[:space:]' || true
    else
        tar -xzOf "$src" --wildcards '*/src/im_mad/remotes/VERSION' 2>/dev/null | head -1 | tr -d '[:space:]' || true
    fi
}

checksum_of() {
    local src="$1"
    if [ -f "$src" ]; then
        sha256sum "$src" | cut -c1-64
    elif git -C "$src" rev-parse HEAD >/dev/null 2>&1; then
        { git -C "$src" rev-parse HEAD; git -C "$src" status --porcelain; } | sha256sum | cut -c1-64
    else
        (cd "$src" && find . -type f -printf '%P %s %T@\n' | LC_ALL=C sort) | sha256sum | cut -c1-64
    fi
}

# Fixes applied to the installed copy (before the completion marker is written).
fix_install() {
    local dest="$1" version="$2" f
    # Gem.use_paths("$ONE_LOCATION/share/gems") hides Debian's ruby-* libraries (no gems are bundled here):
    # only call it when that directory exists.
    for f in "$dest/lib/ruby/load_opennebula_paths.rb" "$dest/share/misc/load_opennebula_paths.rb"; do
        [ -f "$f" ] || continue
        sed -i 's|^Gem.use_paths(File.realpath(GEMS_LOCATION))$|Gem.use_paths(File.realpath(GEMS_LOCATION)) if File.directory?(GEMS_LOCATION)|' "$f"
        grep -q 'if File.directory?(GEMS_LOCATION)' "$f" || die "could not patch $f"
    done
    # The dummy VMM driver reads its failure/delay switches from a fixed /tmp directory; let an instance
    # choose its own (start.sh sets ONE_DUMMY_ACTIONS_DIR), so that two instances never share it.
    f="$dest/lib/mads/one_vmm_dummy.rb"
    sed -i 's|^DUMMY_ACTIONS_DIR = "/tmp/opennebula_dummy_actions"$|DUMMY_ACTIONS_DIR = ENV["ONE_DUMMY_ACTIONS_DIR"] \|\| "/tmp/opennebula_dummy_actions"|' "$f"
    grep -q 'ONE_DUMMY_ACTIONS_DIR' "$f" || die "could not patch $f"
    echo "$version" > "$dest/.version"
}

build_one() {
    local version="$1" src sum dest tmp marker declared
    src="$(source_for "$version")"
    declared="$(source_version "$src")"
    if [ -n "$declared" ] && [ "$declared" != "$version" ]; then
        die "source $src is OpenNebula $declared, not $version"
    fi
    sum="$(checksum_of "$src")"
    dest="$CACHE/$version-${sum:0:12}"
    marker="$dest/.complete"
    if [ -f "$marker" ]; then
        echo "$dest"
        return 0
    fi
    if [ -n "${ONED_NO_BUILD:-}" ]; then  # the test session: no 8-minute build (and no apt) in there
        echo "build.sh: OpenNebula $version is not built yet: run bash tests/oned/build.sh $version" >&2
        exit 75
    fi
    mkdir -p "$CACHE"
    # One build per destination at a time (two start.sh may race); the loser waits, then reuses.
    exec 9>"$CACHE/.lock-$version-${sum:0:12}"
    flock 9
    if [ -f "$marker" ]; then
        exec 9>&-
        echo "$dest"
        return 0
    fi
    ensure_packages
    local t0=$SECONDS grpc=""
    tmp="$(mktemp -d "$CACHE/.build-$version-XXXXXX")"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    log "building OpenNebula $version from $src in $tmp (log: $tmp/build.log)"
    if [ -d "$src" ]; then
        # copy, so that the checkout stays untouched (scons writes objects into the tree)
        mkdir "$tmp/src"
        (cd "$src" && tar --exclude=.git -cf - .) | (cd "$tmp/src" && tar -xf -)
    else
        mkdir "$tmp/src"
        tar -xzf "$src" -C "$tmp/src" --strip-components=1
    fi
    # 7.2+ has a gRPC API server that needs gRPC's C++ library; 7.0 has no such option.
    grep -q "ARGUMENTS.get('grpc'" "$tmp/src/SConstruct" && grpc="grpc=no"
    if ! (cd "$tmp/src" && scons -j"$JOBS" sqlite=yes mysql=no systemd=no parsers=no fireedge=no \
            rubygems=no context=no svncterm=no $grpc) >"$tmp/build.log" 2>&1; then
        tail -n 30 "$tmp/build.log" >&2
        die "scons failed for $version (see above)"
    fi
    log "compiled in $((SECONDS - t0)) s; installing"
    local inst="$tmp/install"
    # install.sh prints ~50 harmless "cannot stat" lines (man pages, FireEdge dist, Prometheus, PuLP)
    (cd "$tmp/src" && ./install.sh -d "$inst") >"$tmp/install.log" 2>&1 || {
        tail -n 30 "$tmp/install.log" >&2
        die "install.sh failed for $version"
    }
    [ -x "$inst/bin/oned" ] || die "install of $version has no bin/oned"
    fix_install "$inst" "$version"
    # install.sh -d writes no absolute paths into files, so the tree can move; check that.
    if grep -rlI --exclude-dir=.git "$inst" "$inst" >/dev/null 2>&1; then
        log "warning: the install embeds its temporary path:"
        grep -rlI "$inst" "$inst" | head -5 >&2
    fi
    cp "$tmp/build.log" "$inst/.build.log"
    cp "$tmp/install.log" "$inst/.install.log"
    echo "source=$src sha256=$sum built=$(date -u +%FT%TZ) seconds=$((SECONDS - t0))" > "$inst/.source"
    # Mark complete inside the tree, then move it into place in one rename.
    touch "$inst/.complete"
    rm -rf "$dest"
    mv "$inst" "$dest"
    rm -rf "$tmp"
    trap - EXIT
    exec 9>&-
    log "OpenNebula $version built and installed in $((SECONDS - t0)) s"
    echo "$dest"
}

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    if [ -n "${ONE_SOURCE:-}" ]; then
        [ -e "$ONE_SOURCE" ] || missing_source "(any)" "$ONE_SOURCE"
        v="$(source_version "$ONE_SOURCE")"
        [ -n "$v" ] || die "cannot tell the version of ONE_SOURCE=$ONE_SOURCE; name it: build.sh VERSION"
        versions=("$v")
    else
        versions=(7.0.2 7.4.0)
    fi
fi
for v in "${versions[@]}"; do
    case "$v" in
        [0-9]*.[0-9]*.[0-9]*) ;;
        *) die "not a version: $v (expected e.g. 7.0.2 or 7.4.0)" ;;
    esac
    build_one "$v"
done
