#!/usr/bin/env bash
# The demo: builds vsd, serves a fresh 1 GiB raw image over vhost-user-blk,
# drives it with vsd-bench (libblkio) and prints IOPS and latency, and, from
# vsd's own tracing over QMP, where each request's time went inside vsd.
# The daemon runs on CPU 0 and the client on CPU 1 (see BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
bin=$(scripts/build.sh)
vsd=$bin/vsd
bench=$bin/vsd-bench

dir=$(mktemp -d)
daemon=
cleanup() {
    [ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

qemu-img create -q -f raw "$dir/demo.img" 1G
taskset -c 0 "$vsd" \
    --blockdev "driver=file,node-name=file0,filename=$dir/demo.img" \
    --blockdev driver=raw,node-name=disk0,file=file0 \
    --export "type=vhost-user-blk,id=demo,node-name=disk0,addr.type=unix,addr.path=$dir/vsd.sock,writable=on,num-queues=2,serial=vsd-demo" \
    --chardev "socket,id=qmp,path=$dir/qmp.sock,server=on,wait=off" --monitor chardev=qmp \
    --pidfile "$dir/vsd.pid" --sandbox on &
daemon=$!
for _ in $(seq 100); do [ -e "$dir/vsd.pid" ] && break; sleep 0.1; done
[ -e "$dir/vsd.pid" ] || { echo "demo: vsd did not start" >&2; exit 1; }

echo "vsd $("$vsd" --version | cut -d' ' -f2) serving a 1 GiB raw image ($dir/demo.img) on an export of 2 queues, sandboxed; the client uses one"
for job in "randwrite 4k 32" "randread 4k 32" "randread 4k 1" "read 64k 8"; do
    set -- $job
    echo
    echo "== $1, bs=$2, iodepth=$3, 5 s =="
    taskset -c 1 "$bench" --socket "$dir/vsd.sock" --rw "$1" --bs "$2" --iodepth "$3" --seconds 5 \
        --breakdown "$dir/qmp.sock"
done
