#!/usr/bin/env bash
# Runs cargo-fuzz (libFuzzer) targets in fuzz/ for a bounded time each,
# starting from the seeds in fuzz/seeds/<target>/ (qcow2 images made by
# qemu-img; virtio rings and QMP sessions made by fuzz/seeds/make_seeds.py),
# and leaves crashes in fuzz/artifacts/<target>/. Turn each one into a
# regression test.
#
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET [TARGET...]]
#   SECONDS_PER_TARGET  default 60
#   TARGET...           default: every target (`cargo fuzz list`)
#
# One fuzzing process at a time (no -jobs/-workers): the machines are shared.
# An input that runs longer than 10 s counts as a hang (-timeout=10).
# Each run's output goes to fuzz/logs/<target>.log; a summary line per
# target (executions, seconds, edges covered, corpus, crash or not) is
# printed at the end.
#
# cargo-fuzz builds with sanitizer flags that only nightly compilers accept;
# this project's machines have one stable toolchain, so RUSTC_BOOTSTRAP=1
# lets it accept them. Builds are cargo fuzz's default: optimized, with
# debug assertions and overflow checks, under AddressSanitizer.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
shift || true
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
export RUSTC_BOOTSTRAP=1
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list)
fi
mkdir -p logs
summary=()
status=0
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target"
    cp -n "seeds/$target"/* "corpus/$target/" 2>/dev/null || true
    log="logs/$target.log"
    result=ok
    # 2 GiB: ASan keeps freed buffers in quarantine, and the qcow2 target's
    # in-memory images grow to 64 MiB: its RSS passes 1 GiB within a minute
    # while its live heap stays under 50 MiB (no leak).
    cargo fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        2>&1 | tee "$log" || { result="CRASH (see $log, fuzz/artifacts/$target/)"; status=1; }
    secs=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n1)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n1)
    last=$(grep -E '^#[0-9]+' "$log" | tail -n1 || true)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
    corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9a-zA-Z]*\).*/\1/p' <<<"$last")
    summary+=("$target: ${execs:-?} executions in ${secs:-?} s, ${cov:-?} edges, corpus ${corp:-?}, $result")
done
printf '%s\n' "${summary[@]}"
exit "$status"
