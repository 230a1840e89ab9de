#!/usr/bin/env bash
# Builds vsd and vsd-bench (release) and prints the directory that holds
# them, wherever cargo puts its target directory (CARGO_TARGET_DIR,
# .cargo/config): export PATH="$(scripts/build.sh):$PATH".
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p vsd -p vsd-bench >&2
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
echo "$target/release"
