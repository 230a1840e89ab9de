#!/usr/bin/env bash
# Runs every cargo-fuzz (libFuzzer) target in fuzz/ for a bounded time,
# starting from the seed images in fuzz/seeds/ (made by qemu-img), and
# leaves crashes in fuzz/artifacts/. Turn each one into a regression test.
#
# usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 60)
#
# cargo-fuzz builds with sanitizer flags that only nightly compilers accept;
# this project's machines have one stable toolchain, so RUSTC_BOOTSTRAP=1
# lets it accept them.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
export RUSTC_BOOTSTRAP=1
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    cp -n "seeds/$target"/* "corpus/$target/" 2>/dev/null || true
    cargo fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=1024 -print_final_stats=1
done
