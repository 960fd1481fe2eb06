#!/usr/bin/env bash
# End-to-end speed: the quickstart server (release build, in-memory store)
# under wrk on loopback, its unlimited GET /healthz against its limited
# GET /api/hello with 200,000 rotating API keys and, as if from a trusted
# proxy on loopback, 200,000 rotating client addresses in
# X-Forwarded-For (so the per-key and the per-address rules allow almost
# every request), on the same server. Both runs send the same rotating
# headers from the same wrk script, so wrk's own cost (it shares the
# machine) is the same on both sides. Prints both rates and their ratio.
#
#   benches/e2e.sh                 # 10 s per route, 16 connections
#   DURATION=30s CONNECTIONS=32 benches/e2e.sh
#   QUICKSTART_BIN=path/to/quickstart benches/e2e.sh   # another build (A/B)
#   PEER=1 benches/e2e.sh          # one limit each: tollgate vs tower_governor
#
# PEER=1 serves benches/examples/e2e_peer.rs instead: /healthz, /tollgate
# (one tollgate rate limit per x-api-key) and /governor (one
# tower_governor limit per x-api-key), both allowing every request with
# their headers on; it prints each limited route's ratio to /healthz.
#
# Needs wrk (Debian: apt-get install wrk). Traffic goes to 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10s}
CONNECTIONS=${CONNECTIONS:-16}
ADDR=127.0.0.1:${PORT:-3999}

command -v wrk >/dev/null || { echo "wrk is not installed (apt-get install wrk)" >&2; exit 1; }
if [ "${PEER:-0}" = 1 ]; then
    cargo build --release -q -p tollgate-benches --example e2e_peer
    SERVER_BIN=./target/release/examples/e2e_peer
    ROUTES="/tollgate /governor"
else
    if [ -z "${QUICKSTART_BIN:-}" ]; then
        cargo build --release -q -p tollgate-examples --bin quickstart
        QUICKSTART_BIN=./target/release/quickstart
    fi
    SERVER_BIN=$QUICKSTART_BIN
    ROUTES="/api/hello"
fi

TOLLGATE_ADDR=$ADDR TOLLGATE_TRUSTED_PROXIES=127.0.0.1 "$SERVER_BIN" >/dev/null &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    curl -sf "http://$ADDR/healthz" >/dev/null && break
    sleep 0.1
done

script=$(mktemp)
trap 'kill $server 2>/dev/null || true; rm -f "$script"' EXIT
cat >"$script" <<'LUA'
local n = 0
local path = os.getenv("E2E_PATH")
request = function()
  n = n + 1
  local i = n % 200000
  local ip = "10." .. math.floor(i / 65536) .. "." .. (math.floor(i / 256) % 256) .. "." .. (i % 256)
  return wrk.format("GET", path, { ["x-api-key"] = "k" .. i, ["x-forwarded-for"] = ip })
end
LUA

rate() { # prints requests/s and the non-2xx count
    local out
    out=$(wrk -t1 -c"$CONNECTIONS" -d"$DURATION" "$@")
    local rps non2xx
    rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
    non2xx=$(awk '/Non-2xx/ {print $5}' <<<"$out")
    echo "$rps ${non2xx:-0}"
}

read -r bare _ < <(E2E_PATH=/healthz rate -s "$script" "http://$ADDR")
line="e2e: /healthz ${bare} req/s"
for route in $ROUTES; do
    read -r limited limited_refused < <(E2E_PATH=$route rate -s "$script" "http://$ADDR")
    ratio=$(awk -v a="$limited" -v b="$bare" 'BEGIN { printf "%.3f", a / b }')
    line="$line; $route ${limited} req/s (${limited_refused} refused); ratio ${ratio}"
done
echo "$line"
