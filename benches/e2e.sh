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
#   FLOOD=1 benches/e2e.sh         # a key flood: the quickstart's RSS over time
#   FLOOD=1 SCRAPE=1 DURATION=600s IDLE=120 benches/e2e.sh
#
# FLOOD=1 sends every request of GET /api/hello with a new x-api-key and
# a new X-Forwarded-For address (never one seen before) for DURATION
# (default 600 s), then nothing for IDLE seconds (default 60), and prints
# the server's RSS every SAMPLE seconds (default 10) with the requests
# sent so far; SCRAPE=1 also fetches /metrics every second, as a
# Prometheus would. The figures are in benches/README.md.
#
# Needs wrk (Debian: apt-get install wrk). Traffic goes to 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${FLOOD:-0}" = 1 ]; then
    DURATION=${DURATION:-600s}
fi
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

if [ "${FLOOD:-0}" = 1 ]; then
    cat >"$script" <<'LUA'
local n = 0
request = function()
  n = n + 1
  local ip = math.floor(n / 16777216) % 256 .. "." .. math.floor(n / 65536) % 256 .. "." ..
    math.floor(n / 256) % 256 .. "." .. n % 256
  return wrk.format("GET", "/api/hello", { ["x-api-key"] = "flood-" .. n, ["x-forwarded-for"] = ip })
end
LUA
    rss() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$server/status"; }
    served() { # requests the server counted so far (allowed and refused)
        curl -sf "http://$ADDR/metrics" |
            awk '/^tollgate_requests_total\{.*rule="per-key"/ {s += $NF} END {printf "%.0f", s}'
    }
    SAMPLE=${SAMPLE:-10}
    IDLE=${IDLE:-60}
    scraper=
    flooder=
    # Whatever ends the run (its end, Ctrl-C), nothing it started is left.
    trap 'kill $server $scraper $flooder 2>/dev/null || true; rm -f "$script"' EXIT
    trap 'exit 130' INT TERM
    if [ "${SCRAPE:-0}" = 1 ]; then
        (while sleep 1; do curl -sf "http://$ADDR/metrics" >/dev/null || true; done) &
        scraper=$!
    fi
    echo "flood: t=0 s rss=$(rss) MB (scrape=${SCRAPE:-0})"
    wrk -t1 -c"$CONNECTIONS" -d"$DURATION" -s "$script" "http://$ADDR" >/dev/null &
    flooder=$!
    start=$(date +%s)
    while kill -0 "$flooder" 2>/dev/null; do
        sleep "$SAMPLE"
        echo "flood: t=$(( $(date +%s) - start )) s rss=$(rss) MB requests=$(served)"
    done
    wait "$flooder" || true
    stopped=$(date +%s)
    while [ $(( $(date +%s) - stopped )) -lt "$IDLE" ]; do
        sleep "$SAMPLE"
        echo "idle:  t=$(( $(date +%s) - start )) s rss=$(rss) MB"
    done
    [ -n "$scraper" ] && kill "$scraper" 2>/dev/null
    exit 0
fi
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
