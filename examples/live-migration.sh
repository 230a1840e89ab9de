#!/usr/bin/env bash
# A live migration on one host, every step of docs/manual/migration.md:
# a guest writes and verifies its disk (fio, crc32c) while it moves from a
# QEMU on vsd A to a QEMU on vsd B, the qcow2 image changing hands between
# the two daemons at the switch-over. Needs `vsd` on PATH (README: "Build")
# and what scripts/setup.sh installs; runs as root in about a minute (TCG).
set -euo pipefail
cd "$(dirname "$0")/.."
t=$(mktemp -d /tmp/vsd-migration.XXXXXX)
cleanup() {
    for pid in "$t"/*.pid; do
        if [ -e "$pid" ]; then kill "$(cat "$pid")" 2>/dev/null || true; fi
    done
    kill $(jobs -p) 2>/dev/null || true
    rm -rf "$t"
}
trap cleanup EXIT
qmp() { scripts/qmp.py "$@" >/dev/null; }

scripts/guest/build-guest.sh build/guest >/dev/null  # the host's kernel, busybox and fio
qemu-img create -q -f qcow2 "$t/disk.qcow2" 1G

# vsd A serves the image; allow-inactive lets it hand the image over.
vsd --blockdev file,node-name=f0,filename="$t/disk.qcow2" \
    --blockdev qcow2,node-name=q0,file=f0 \
    --export vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path="$t/a.sock",writable=on,allow-inactive=on \
    --chardev socket,id=m,path="$t/a-qmp.sock",server=on,wait=off --monitor m \
    --daemonize --pidfile "$t/a.pid"
# vsd B opens the same image inactive: it reads the header, writes nothing
# and caches nothing until it takes the image.
vsd --blockdev file,node-name=f0,filename="$t/disk.qcow2",active=off \
    --blockdev qcow2,node-name=q0,file=f0,active=off \
    --export vhost-user-blk,id=e0,node-name=q0,addr.type=unix,addr.path="$t/b.sock",writable=on,allow-inactive=on \
    --chardev socket,id=m,path="$t/b-qmp.sock",server=on,wait=off --monitor m \
    --daemonize --pidfile "$t/b.pid"

# One QEMU per daemon, with the same devices; B waits for the migration.
guest() { # SOCKET QMP-SOCKET CONSOLE [QEMU-ARGS...]
    exec qemu-system-x86_64 -accel tcg -m 512M -nodefaults -display none -no-reboot \
        -object memory-backend-memfd,id=mem,size=512M,share=on -machine q35,memory-backend=mem \
        -chardev socket,id=disk,path="$1" -device vhost-user-blk-pci,chardev=disk,num-queues=1 \
        -kernel build/guest/vmlinuz -initrd build/guest/initramfs.cpio \
        -append "console=ttyS0 quiet panic=-1 vsd.job=paced vsd.runtime=10 vsd.size=16M" \
        -qmp unix:"$2",server=on,wait=off -serial file:"$3" "${@:4}"
}
guest "$t/a.sock" "$t/qemu-a.sock" "$t/console-a" &
guest "$t/b.sock" "$t/qemu-b.sock" "$t/console-b" -incoming unix:"$t/migrate.sock" -S &
# wait_for SECONDS CONDITION; a guest under TCG on a busy machine is slow.
wait_for() {
    local deadline=$((SECONDS + $1))
    until eval "$2"; do
        [ "$SECONDS" -lt "$deadline" ] || { echo "timed out after $1 s: $2" >&2; exit 1; }
        sleep 0.2
    done
}
wait_for 300 "grep -qa 'VSD-GUEST capacity_bytes' '$t/console-a' 2>/dev/null"
echo "guest writing on vsd A; migrating"

# 1. The source QEMU migrates; once completed it has stopped the rings
#    (vsd A finished every request in flight and logged its writes).
qmp "$t/qemu-a.sock" migrate "{\"uri\": \"unix:$t/migrate.sock\"}"
wait_for 300 "[[ \$(scripts/qmp.py '$t/qemu-a.sock' query-migrate) == *'\"completed\"'* ]]"
# 2. vsd A lets the image go (metadata written back, nothing cached).
qmp "$t/a-qmp.sock" blockdev-set-active '{"node-name": "q0", "active": false}'
# 3. vsd B takes it (read afresh).
qmp "$t/b-qmp.sock" blockdev-set-active '{"node-name": "q0", "active": true}'
# 4. The guest runs on at the destination; the source QEMU goes.
qmp "$t/qemu-b.sock" cont
qmp "$t/qemu-a.sock" quit
echo "guest running on vsd B"

wait_for 600 "grep -qa 'VSD-GUEST done' '$t/console-b' 2>/dev/null"
grep -qa 'VSD-GUEST fio_write_status=0' "$t/console-b" && grep -qa 'VSD-GUEST fio_verify_status=0' "$t/console-b" ||
    { echo "fio's verify failed after the migration:" >&2; tr -d '\r' <"$t/console-b" | tail -20 >&2; exit 1; }
# vsd B stops cleanly (SIGTERM) and removes its pidfile.
kill "$(cat "$t/b.pid")"
wait_for 30 "[ ! -e '$t/b.pid' ]"
qemu-img check -q "$t/disk.qcow2"
echo "migrated: fio verified every block on vsd B, qemu-img check clean"
