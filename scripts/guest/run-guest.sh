#!/usr/bin/env bash
# Boots the tiny test guest (scripts/guest/build-guest.sh) under QEMU/TCG with
# one vhost-user-blk disk on SOCK and runs a job in it (scripts/guest/init).
#
# usage: run-guest.sh --socket SOCK [options]
#   --socket SOCK      vhost-user-blk back-end's unix socket (required)
#   --queues N         virtqueues requested by QEMU (default 2)
#   --smp N            guest vCPUs (default: --queues; a guest drives at most
#                      one queue per vCPU)
#   --job JOB          verify (default), info (facts only, no I/O) or resize
#                      (wait for the host to resize the disk; see init)
#   --size SIZE        bytes of the disk fio exercises, e.g. 64M (default 64M)
#   --bs SIZE          fio block size (default 4k)
#   --numjobs N        fio jobs (default: one per hardware queue in the guest)
#   --iodepth N        fio iodepth per job (default 16)
#   --ioengine NAME    libaio (default) or io_uring
#   --timeout SECS     QEMU is killed after this long (default 120)
#   --log FILE         keep the full console log (QEMU's stderr included) here
#   --outdir DIR       guest build directory (default REPO/build/guest)
#   --device-opts STR  extra ",key=value" properties for vhost-user-blk-pci
#   --append STR       extra kernel command line words
#   --verbose          stream the console to stderr while the guest runs
#
# Output: stdout carries only the guest's fact lines, each exactly
#   VSD-GUEST <key>=<value>
# with the value running to the end of the line (it may be empty or hold
# spaces). Keys, in order of appearance:
#   job, kernel, cpus                      job name, guest kernel, vCPUs
#   capacity_bytes                         disk size in bytes
#   serial                                 virtio-blk serial (empty if none)
#   queues                                 blk-mq hardware queues in use
#   write_cache, wce                       "write back"/"write through"; 1/0
#   ro                                     1 if the disk is read-only
#   logical_block_size, physical_block_size
#   discard_max_bytes, write_zeroes_max_bytes   0 when not offered
# verify job only:
#   fio_numjobs, fio_bytes_per_job, fio_ioengine
#   fio_expected_bytes                     numjobs * bytes_per_job: what each
#                                          pass must write/read in total
#   fio_write_status                       exit status of the randwrite pass
#                                          (fio verifies each job's blocks
#                                          after writing them)
#   fio_write_secs, fio_write_error        wall time; fio's error (0 = none)
#   fio_write_{read,write}_{bytes,iops}
#   fio_verify_status                      exit status of a separate sequential
#                                          read pass verifying every block
#   fio_verify_secs, fio_verify_error, fio_verify_{read,write}_{bytes,iops}
#   discard_status, discard_bytes,         with --append vsd.discard=on: the
#   discard_reads_zero                     blkdiscard of the first half of
#                                          fio's range, and 1 if it then
#                                          reads back as zeroes
#   vq_interrupts                          interrupts per request virtqueue,
#                                          comma separated in queue order
#                                          (non-zero = the queue carried I/O;
#                                          empty if the queues share a vector)
# always last:
#   done                                   (a line "VSD-GUEST done") the job ran
#                                          to its end
# A guest that cannot run its job prints "VSD-GUEST fatal=<why>" instead.
#
# Exit status:
#   0    "done" appeared and, for the verify job, both fio statuses are 0 and
#        fio_write_write_bytes, fio_write_read_bytes and fio_verify_read_bytes
#        all equal fio_expected_bytes
#   1    the guest ran but the job failed (or a fatal line appeared)
#   124  QEMU was killed at the timeout
#   2    usage or setup error
# On failure the reason and the console tail go to stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

usage() {
    sed -n '/^# usage:/,/^#   --verbose/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}" >&2
    exit 2
}
die() { echo "run-guest: $*" >&2; exit 2; }

socket='' queues=2 smp='' job=verify size=64M bs=4k numjobs='' iodepth=16
ioengine=libaio timeout_s=120 log='' outdir=$repo/build/guest device_opts=''
append='' verbose=''
while [ "$#" -gt 0 ]; do
    case "$1" in
    --socket) socket=${2-} ;;
    --queues) queues=${2-} ;;
    --smp) smp=${2-} ;;
    --job) job=${2-} ;;
    --size) size=${2-} ;;
    --bs) bs=${2-} ;;
    --numjobs) numjobs=${2-} ;;
    --iodepth) iodepth=${2-} ;;
    --ioengine) ioengine=${2-} ;;
    --timeout) timeout_s=${2-} ;;
    --log) log=${2-} ;;
    --outdir) outdir=${2-} ;;
    --device-opts) device_opts=${2-} ;;
    --append) append=${2-} ;;
    --verbose) verbose=1; shift; continue ;;
    -h | --help) usage ;;
    *) echo "run-guest: unknown option $1" >&2; usage ;;
    esac
    [ "$#" -ge 2 ] || die "$1 needs a value"
    shift 2
done
[ -n "$socket" ] || usage
[ -S "$socket" ] || die "$socket is not a unix socket (is the back-end running?)"
case "$job" in verify | info | resize) ;; *) die "--job must be verify, info or resize" ;; esac
[[ "$queues" =~ ^[1-9][0-9]*$ ]] || die "--queues must be a positive integer"
[ -n "$smp" ] || smp=$queues
[[ "$smp" =~ ^[1-9][0-9]*$ ]] || die "--smp must be a positive integer"
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive integer"
# Kernel command line words can't hold spaces; fio parses the values itself.
for v in "$size" "$bs" "$numjobs" "$iodepth" "$ioengine"; do
    [[ "$v" =~ ^[A-Za-z0-9_.-]*$ ]] || die "bad value: '$v'"
done
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 not found (run scripts/setup.sh)"

"$here/build-guest.sh" "$outdir" || die "building the guest failed"
kernel=$outdir/vmlinuz
# A PVH vmlinux skips the bzImage's in-guest decompression (see build-guest.sh).
[ -f "$outdir/vmlinux" ] && kernel=$outdir/vmlinux

if [ -z "$log" ]; then
    log=$(mktemp "${TMPDIR:-/tmp}/vsd-guest.XXXXXX.log")
    keep_log=''
else
    mkdir -p "$(dirname "$log")"
    keep_log=1
fi

# cryptomgr.notests and mitigations=off each save about a second of TCG boot;
# neither matters in a throwaway test guest.
cmdline="console=ttyS0 quiet panic=-1 cryptomgr.notests mitigations=off vsd.job=$job vsd.size=$size vsd.bs=$bs vsd.iodepth=$iodepth vsd.ioengine=$ioengine"
[ -z "$numjobs" ] || cmdline+=" vsd.numjobs=$numjobs"
[ -z "$append" ] || cmdline+=" $append"

# vhost-user needs guest RAM in a shareable memfd the back-end can map.
# -nodefaults drops the NIC, VGA and parallel port: less to probe under TCG.
qemu_args=(
    -accel tcg -nodefaults -display none -no-reboot -no-user-config
    -m 512M -smp "$smp"
    -object 'memory-backend-memfd,id=mem,size=512M,share=on'
    -machine 'q35,memory-backend=mem'
    -chardev "socket,id=vu0,path=$socket"
    -device "vhost-user-blk-pci,chardev=vu0,num-queues=$queues$device_opts"
    -kernel "$kernel" -initrd "$outdir/initramfs.cpio" -append "$cmdline"
    -serial stdio
)

qemu_pid='' tail_pid=''
cleanup() {
    # Only our own children: the timeout wrapper (which passes the signal on
    # to QEMU) and the console follower.
    [ -z "$qemu_pid" ] || kill "$qemu_pid" 2>/dev/null || true
    [ -z "$tail_pid" ] || kill "$tail_pid" 2>/dev/null || true
    [ -n "$keep_log" ] || rm -f "$log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# stdin from /dev/null: QEMU must not put a terminal into raw mode.
timeout --kill-after=5 "$timeout_s" qemu-system-x86_64 "${qemu_args[@]}" </dev/null >"$log" 2>&1 &
qemu_pid=$!
if [ -n "$verbose" ]; then
    tail -n +1 -f --pid="$qemu_pid" "$log" >&2 &
    tail_pid=$!
fi
rc=0
wait "$qemu_pid" || rc=$?
qemu_pid=''
if [ -n "$tail_pid" ]; then
    wait "$tail_pid" || true
    tail_pid=''
fi

# The serial console ends lines with \r\n.
facts=$(tr -d '\r' <"$log" | grep -a '^VSD-GUEST ' || true)
[ -z "$facts" ] || printf '%s\n' "$facts"

fact() { printf '%s\n' "$facts" | sed -n "s/^VSD-GUEST $1=//p" | tail -n 1; }
why=
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    why="timed out after ${timeout_s}s"
elif [ -n "$(fact fatal)" ]; then
    why="guest: $(fact fatal)"
elif ! printf '%s\n' "$facts" | grep -qx 'VSD-GUEST done'; then
    why="guest did not finish (QEMU exit status $rc)"
elif [ "$job" = verify ] && [ "$(fact fio_write_status)" != 0 ]; then
    why="fio write+verify pass failed (status $(fact fio_write_status))"
elif [ "$job" = verify ] && [ "$(fact fio_verify_status)" != 0 ]; then
    why="fio read-back verify pass failed (status $(fact fio_verify_status))"
elif [ "$job" = verify ]; then
    # fio can exit 0 having done less I/O than asked; hold it to the amount.
    want=$(fact fio_expected_bytes)
    for k in fio_write_write_bytes fio_write_read_bytes fio_verify_read_bytes; do
        if [ "$(fact "$k")" != "$want" ]; then
            why="$k=$(fact "$k"), expected $want"
            break
        fi
    done
fi

if [ -n "$why" ]; then
    echo "run-guest: FAILED: $why" >&2
    echo "run-guest: console tail${keep_log:+ (full log: $log)}:" >&2
    tr -d '\r' <"$log" | tail -n 40 >&2
    case "$rc" in 124 | 137) exit 124 ;; *) exit 1 ;; esac
fi
