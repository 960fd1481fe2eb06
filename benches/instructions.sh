#!/usr/bin/env bash
# Instructions per request of one stack of an instruction-count example
# (callgrind), exact: runs of 2,000 and 22,000 requests, each total less
# the clock's calibration, subtracted and divided by 20,000.
#
#   benches/instructions.sh conc_tollgate             # layer_instructions
#   benches/instructions.sh tollgate retry_instructions
#   BIN=path/to/layer_instructions benches/instructions.sh conc_tollgate  # A/B
#
# Why the calibration is taken out: quanta calibrates its TSC clock once
# per process against the OS clock for a stretch of wall time, so under
# valgrind it costs 12-13 M instructions that differ from one process to
# the next. Left in, that read as ±500 instructions a request between
# pairs of runs of the same build; taken out, runs of one build agree to
# the instruction.
set -euo pipefail
stack=${1:?usage: benches/instructions.sh STACK [EXAMPLE]}
example=${2:-layer_instructions}
cd "$(dirname "$0")/.."
if [[ -z "${BIN:-}" ]]; then
  cargo build --release -q -p tollgate-benches --example "$example"
  BIN=target/release/examples/$example
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
count() {
  local f=$out/callgrind.$1
  valgrind --tool=callgrind --callgrind-out-file="$f" "$BIN" "$stack" "$1" >/dev/null 2>&1
  local report
  report=$(callgrind_annotate --inclusive=yes "$f" 2>/dev/null)
  local total calibration
  total=$(grep -m1 'PROGRAM TOTALS' <<<"$report" | awk '{gsub(",","",$1); print $1}')
  calibration=$(grep -m1 'once_cell::imp::initialize_or_wait' <<<"$report" | awk '{gsub(",","",$1); print $1}' || true)
  echo $((total - ${calibration:-0}))
}
short=$(count 2000)
long=$(count 22000)
echo "$stack: $(((long - short) / 20000)) instructions per request"
