#!/usr/bin/env bash
# Installs what the tests need (QEMU, qemu-storage-daemon, fio, a guest
# kernel) and runs the whole suite: formatting, lints, unit tests, and the
# integration tests against libblkio, qemu-io, qemu-storage-daemon and a
# real Linux guest under QEMU.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
