#!/usr/bin/env bash
# Runs every fuzz target for a bounded time, one after the other, then
# reports per target: executions, corpus size, crash artifacts.
#
#   fuzz/run.sh                 # every target, 60 s each
#   fuzz/run.sh 300             # every target, 300 s each
#   fuzz/run.sh 30 layer costs  # those targets, 30 s each
#
# Environment: FUZZ_SANITIZER (default none; "address" for ASan),
# CARGO_BUILD_JOBS (default 2). Needs the nightly toolchain and
# cargo-fuzz (`cargo install cargo-fuzz`). Not part of CI: the fuzzers
# run on demand. Corpora grow in fuzz/corpus/<target>, crashes land in
# fuzz/artifacts/<target>, logs in fuzz/logs/<target>.log; replay a crash
# with `cargo +nightly fuzz run -a -s none <target> <file>`.
set -uo pipefail
cd "$(dirname "$0")"

seconds="${1:-60}"
shift $(( $# > 0 ? 1 : 0 ))
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || (( seconds == 0 )); then
    echo "usage: $0 [seconds-per-target] [target...]" >&2
    exit 2
fi
sanitizer="${FUZZ_SANITIZER:-none}"
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
if (( $# > 0 )); then
    targets=("$@")
else
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
# Debug assertions on: arithmetic overflow panics too.
flags=(-a -s "$sanitizer")

if ! cargo +nightly fuzz build "${flags[@]}"; then
    echo "build failed" >&2
    exit 2
fi

mkdir -p logs
failed=0
report=()
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    before=$(find "artifacts/$t" -type f | wc -l)
    echo "== $t: ${seconds} s"
    cargo +nightly fuzz run "${flags[@]}" "$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        >"logs/$t.log" 2>&1
    rc=$?
    after=$(find "artifacts/$t" -type f | wc -l)
    runs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "logs/$t.log" | tail -1)
    corpus=$(find "corpus/$t" -type f | wc -l)
    status=ok
    if (( rc != 0 || after > before )); then
        status="CRASH (exit $rc; see logs/$t.log and artifacts/$t)"
        failed=1
        grep -m5 -E 'panicked|ERROR|SUMMARY' "logs/$t.log" || true
    fi
    report+=("$(printf '%-10s %-32s corpus %6s files  artifacts %3s  %s' \
        "$t" "${runs:-no runs}" "$corpus" "$after" "$status")")
done

echo
printf '%s\n' "${report[@]}"
exit "$failed"
