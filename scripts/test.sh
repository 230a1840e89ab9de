#!/usr/bin/env bash
# Installs what the tests need (QEMU, qemu-storage-daemon, fio, a guest
# kernel, libnbd's tools, Ceph) and runs the whole suite: formatting, lints, unit tests, and the
# integration tests against libblkio, qemu-io, qemu-storage-daemon and a
# real Linux guest under QEMU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Every program, not only the test harnesses: `vsd-lab`'s test runs the vsd
# and vsd-bench built beside it. With `--all-targets` the programs get the
# features the tests unify, so `cargo test` below builds nothing twice.
cargo build --workspace --all-targets --locked
log=$(mktemp)
# The RBD tests start the test Ceph clusters (the shared one, and one with
# cephx); stop each after them unless it was running before.
stop_ceph=:
scripts/ceph.sh running || stop_ceph="scripts/ceph.sh stop"
cephx="env VSD_CEPH_DIR=/tmp/vsd-ceph-cephx scripts/ceph.sh"
$cephx running || stop_ceph="$stop_ceph; $cephx stop"
trap 'rm -f "$log"; eval "$stop_ceph"' EXIT
status=0
# Every test binary runs, whichever fails: one run shows every failure.
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log" || status=$?
# The guest, libblkio, control, hostile-front-end and throttle tests again,
# every export on one shared I/O thread (tests/common: VSD_TEST_IOTHREAD).
VSD_TEST_IOTHREAD=1 cargo test --locked --no-fail-fast -p vsd --test libblkio --test guest --test guest_reconnect \
    --test control --test hostile --test faults --test throttle 2>&1 | tee -a "$log" || status=$?
# cargo prints one result line per test binary, the last often a doc-test
# run with nothing in it: close with the total.
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
