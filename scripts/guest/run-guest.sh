#!/usr/bin/env bash
# Boots the tiny test guest (scripts/guest/build-guest.sh) under QEMU/TCG with
# one disk and runs a job in it (scripts/guest/init). The disk is either a
# vhost-user-blk back-end's socket (vsd, qemu-storage-daemon) or an image
# file that QEMU's own block layer serves on a bus vsd does not: virtio-blk,
# virtio-scsi or IDE (an ATA disk on the q35 machine's AHCI controller).
#
# usage: run-guest.sh --socket SOCK [options]
#        run-guest.sh --bus virtio-blk|virtio-scsi|ide --image FILE [options]
#   --bus BUS          vhost-user-blk (default), virtio-blk, virtio-scsi or ide
#   --socket SOCK      vhost-user-blk back-end's unix socket (required for,
#                      and only for, --bus vhost-user-blk)
#   --image FILE       disk image for the other buses (required for them)
#   --format FMT       raw (default) or qcow2: the image's format
#   --cache MODE       writeback (default), none, writethrough, directsync or
#                      unsafe: QEMU's -drive cache= modes
#   --aio MODE         threads (default), io_uring or native (native needs
#                      --cache none or directsync, as in QEMU)
#   --queues N         virtqueues requested by QEMU (default 2; ignored by ide)
#   --reconnect-ms MS  vhost-user-blk: QEMU reconnects to a back-end that went
#                      away, retrying every MS ms (chardev reconnect-ms=;
#                      default: no reconnecting)
#   --smp N            guest vCPUs (default: --queues; a guest drives at most
#                      one queue per vCPU)
#   --job JOB          verify (default), paced (verify's passes with the
#                      writes spread over --runtime seconds, while the host
#                      reshapes the disk; see init), info (facts only, no
#                      I/O), resize (wait for the host to resize the disk;
#                      see init) or bench (one timed fio run: --rw, --runtime)
#   --size SIZE        bytes of the disk fio exercises, e.g. 64M (default 64M)
#   --bs SIZE          fio block size (default 4k)
#   --numjobs N        fio jobs (default: one per hardware queue in the guest)
#   --iodepth N        fio iodepth per job (default 16)
#   --ioengine NAME    libaio (default) or io_uring
#   --rw PATTERN       bench: randread (default), randwrite, randrw (50%
#                      reads), read or write
#   --runtime SECS     bench: how long fio runs (default 10)
#   --timeout SECS     QEMU is killed after this long (default 120)
#   --log FILE         keep the full console log (QEMU's stderr included) here
#   --outdir DIR       guest build directory (default REPO/build/guest)
#   --device-opts STR  extra ",key=value" properties for the disk's -device
#                      (vhost-user-blk-pci, virtio-blk-pci, scsi-hd, ide-hd)
#   --append STR       extra kernel command line words
#   --qmp SOCK         a QMP monitor listening on SOCK, for a test that drives
#                      QEMU itself (a live migration): the guest may move to
#                      another QEMU and its facts be split between consoles,
#                      so the job is not judged here; the exit status is QEMU's
#   --incoming URI     start as a live migration's destination (-incoming URI),
#                      paused until QMP 'cont'; needs --qmp
#   --verbose          stream the console to stderr while the guest runs
#
# How each bus is wired (the q35 machine; NODES is -blockdev driver=file
# (filename, aio) under a driver=raw|qcow2 node, both with the cache mode's
# cache.direct and cache.no-flush; the device's write-cache=on|off is the
# mode's guest-visible write cache):
#   vhost-user-blk  -chardev socket,path=SOCK + vhost-user-blk-pci,num-queues
#   virtio-blk      NODES + virtio-blk-pci,num-queues                   (vda)
#   virtio-scsi     NODES + virtio-scsi-pci,num_queues + scsi-hd        (sda)
#   ide             NODES + ide-hd on ide.0, port 0 of the q35 AHCI     (sda)
#
# Output: stdout carries only the guest's fact lines, each exactly
#   VSD-GUEST <key>=<value>
# with the value running to the end of the line (it may be empty or hold
# spaces). Keys, in order of appearance:
#   job, kernel, cpus                      job name, guest kernel, vCPUs
#   disk                                   the guest's disk: vda or sda
#   disk_drivers                           drivers bound along its device
#                                          path, innermost first, e.g.
#                                          virtio_blk,virtio-pci or
#                                          sd,virtio_scsi,virtio-pci or sd,ahci
#   capacity_bytes                         disk size in bytes
#   serial                                 virtio-blk serial (empty if none,
#                                          and for sda)
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
#   disk_md5                               paced job only: the MD5 of the
#                                          whole disk at the end
#   discard_status, discard_bytes,         with --append vsd.discard=on: the
#   discard_reads_zero                     blkdiscard of the first half of
#                                          fio's range, and 1 if it then
#                                          reads back as zeroes
#   mkfs_status                            with --append vsd.mkfs=on: the exit
#                                          status of mke2fs -b 1024 on the disk
#   vq_interrupts                          interrupts per request virtqueue,
#                                          comma separated in queue order
#                                          (non-zero = the queue carried I/O;
#                                          empty if the queues share a vector)
# bench job only (fio's figures for the whole run, all jobs together; for
# randrw reads and writes are merged into one set of statistics by fio's
# unified_rw_reporting=mixed, so IOPS and bandwidth are their sums and the
# latencies are those of every completion, read or write: exact percentiles
# of the combined distribution, not a blend of per-direction ones):
#   bench_numjobs                          fio jobs run
#   bench_status                           fio's exit status
#   bench_error                            fio's error (0 = none; "noterse" or
#                                          "terse-layout" if its result line
#                                          was missing or not understood)
#   bench_iops, bench_bw_kib               I/Os per second; KiB per second
#   bench_runtime_ms                       how long fio measured
#   bench_lat_mean_us, bench_lat_p50_us,   completion latency (submission to
#   bench_lat_p99_us, bench_lat_max_us     completion) in microseconds; the
#                                          percentiles are whole numbers
# always last:
#   done                                   (a line "VSD-GUEST done") the job ran
#                                          to its end
# A guest that cannot run its job prints "VSD-GUEST fatal=<why>" instead.
#
# Exit status:
#   0    "done" appeared and, for the verify job, both fio statuses are 0 and
#        fio_write_write_bytes, fio_write_read_bytes and fio_verify_read_bytes
#        all equal fio_expected_bytes; for the bench job, bench_status and
#        bench_error are 0
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

bus=vhost-user-blk socket='' image='' format=raw cache=writeback aio=threads
queues=2 smp='' job=verify size=64M bs=4k numjobs='' iodepth=16
ioengine=libaio rw=randread runtime=10 timeout_s=120 log=''
outdir=$repo/build/guest device_opts='' append='' verbose='' reconnect_ms=''
qmp='' incoming=''
while [ "$#" -gt 0 ]; do
    case "$1" in
    --bus) bus=${2-} ;;
    --socket) socket=${2-} ;;
    --image) image=${2-} ;;
    --format) format=${2-} ;;
    --cache) cache=${2-} ;;
    --aio) aio=${2-} ;;
    --queues) queues=${2-} ;;
    --reconnect-ms) reconnect_ms=${2-} ;;
    --smp) smp=${2-} ;;
    --job) job=${2-} ;;
    --size) size=${2-} ;;
    --bs) bs=${2-} ;;
    --numjobs) numjobs=${2-} ;;
    --iodepth) iodepth=${2-} ;;
    --ioengine) ioengine=${2-} ;;
    --rw) rw=${2-} ;;
    --runtime) runtime=${2-} ;;
    --timeout) timeout_s=${2-} ;;
    --log) log=${2-} ;;
    --outdir) outdir=${2-} ;;
    --device-opts) device_opts=${2-} ;;
    --append) append=${2-} ;;
    --qmp) qmp=${2-} ;;
    --incoming) incoming=${2-} ;;
    --verbose) verbose=1; shift; continue ;;
    -h | --help) usage ;;
    *) echo "run-guest: unknown option $1" >&2; usage ;;
    esac
    [ "$#" -ge 2 ] || die "$1 needs a value"
    shift 2
done
case "$bus" in
vhost-user-blk)
    [ -n "$socket" ] || usage
    [ -S "$socket" ] || die "$socket is not a unix socket (is the back-end running?)"
    [ -z "$image" ] || die "--image is for the other buses; vhost-user-blk takes --socket"
    ;;
virtio-blk | virtio-scsi | ide)
    [ -z "$socket" ] || die "--socket is for --bus vhost-user-blk; $bus takes --image"
    [ -n "$image" ] || die "--bus $bus needs --image FILE"
    [ -f "$image" ] || die "$image is not a file"
    ;;
*) die "--bus must be vhost-user-blk, virtio-blk, virtio-scsi or ide" ;;
esac
case "$format" in raw | qcow2) ;; *) die "--format must be raw or qcow2" ;; esac
# QEMU's cache modes as its -drive expands them (qemu(1), -drive cache=):
# the host page cache bypassed (cache.direct), flushes ignored
# (cache.no-flush), and the write cache the guest sees (write-cache).
case "$cache" in
writeback) direct=off no_flush=off write_cache=on ;;
none) direct=on no_flush=off write_cache=on ;;
writethrough) direct=off no_flush=off write_cache=off ;;
directsync) direct=on no_flush=off write_cache=off ;;
unsafe) direct=off no_flush=on write_cache=on ;;
*) die "--cache must be writeback, none, writethrough, directsync or unsafe" ;;
esac
case "$aio" in threads | io_uring | native) ;; *) die "--aio must be threads, io_uring or native" ;; esac
# QEMU refuses aio=native on a file opened without O_DIRECT; say so up front.
[ "$aio" != native ] || [ "$direct" = on ] || die "--aio native needs --cache none or directsync"
case "$job" in verify | paced | info | resize | bench) ;; *) die "--job must be verify, paced, info, resize or bench" ;; esac
case "$rw" in
randread | randwrite | randrw | read | write) ;;
*) die "--rw must be randread, randwrite, randrw, read or write" ;;
esac
[[ "$runtime" =~ ^[1-9][0-9]*$ ]] || die "--runtime must be a positive integer"
[[ "$queues" =~ ^[1-9][0-9]*$ ]] || die "--queues must be a positive integer"
[[ "$reconnect_ms" =~ ^([1-9][0-9]*)?$ ]] || die "--reconnect-ms must be a positive integer"
[ -n "$smp" ] || smp=$queues
[[ "$smp" =~ ^[1-9][0-9]*$ ]] || die "--smp must be a positive integer"
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive integer"
[ -z "$incoming" ] || [ -n "$qmp" ] || die "--incoming needs --qmp (the test resumes the guest with 'cont')"
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

# The name the guest's driver gives the disk: virtio_blk's vda, else sd's sda.
case "$bus" in
vhost-user-blk | virtio-blk) disk=vda ;;
*) disk=sda ;;
esac

# cryptomgr.notests and mitigations=off each save about a second of TCG boot;
# neither matters in a throwaway test guest.
cmdline="console=ttyS0 quiet panic=-1 cryptomgr.notests mitigations=off vsd.job=$job vsd.disk=$disk vsd.size=$size vsd.bs=$bs vsd.iodepth=$iodepth vsd.ioengine=$ioengine vsd.rw=$rw vsd.runtime=$runtime"
[ -z "$numjobs" ] || cmdline+=" vsd.numjobs=$numjobs"
[ -z "$append" ] || cmdline+=" $append"

# A comma inside a QEMU option value is written as two.
qemu_str() { printf '%s' "${1//,/,,}"; }

# vhost-user needs guest RAM in a shareable memfd the back-end can map; the
# other buses get the same memory so that runs compare like with like.
# -nodefaults drops the NIC, VGA and parallel port: less to probe under TCG.
qemu_args=(
    -accel tcg -nodefaults -display none -no-reboot -no-user-config
    -m 512M -smp "$smp"
    -object 'memory-backend-memfd,id=mem,size=512M,share=on'
    -machine 'q35,memory-backend=mem'
    -kernel "$kernel" -initrd "$outdir/initramfs.cpio" -append "$cmdline"
    -serial stdio
)
[ -z "$qmp" ] || qemu_args+=(-qmp "unix:$(qemu_str "$qmp"),server=on,wait=off")
# Paused after the migration too (-S), so that the images change hands first.
[ -z "$incoming" ] || qemu_args+=(-incoming "$incoming" -S)
if [ "$bus" = vhost-user-blk ]; then
    qemu_args+=(
        -chardev "socket,id=vu0,path=$(qemu_str "$socket")${reconnect_ms:+,reconnect-ms=$reconnect_ms}"
        -device "vhost-user-blk-pci,chardev=vu0,num-queues=$queues$device_opts"
    )
else
    # Both nodes carry the cache flags, as -drive gives them to its node and
    # the children it opens; the file node is the one that opens with
    # O_DIRECT and calls fdatasync.
    node_cache="cache.direct=$direct,cache.no-flush=$no_flush"
    qemu_args+=(
        -blockdev "driver=file,node-name=file0,filename=$(qemu_str "$image"),aio=$aio,$node_cache"
        -blockdev "driver=$format,node-name=disk0,file=file0,$node_cache"
    )
    disk_dev="drive=disk0,write-cache=$write_cache$device_opts"
    case "$bus" in
    virtio-blk) qemu_args+=(-device "virtio-blk-pci,num-queues=$queues,$disk_dev") ;;
    virtio-scsi)
        qemu_args+=(
            -device "virtio-scsi-pci,id=scsi0,num_queues=$queues"
            -device "scsi-hd,bus=scsi0.0,$disk_dev"
        )
        ;;
    # q35 has the ICH9 AHCI controller built in; ide.0 is its first port.
    ide) qemu_args+=(-device "ide-hd,bus=ide.0,$disk_dev") ;;
    esac
fi

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
# Jobs judged by their fio write+verify and read-back passes.
verifying=
case "$job" in verify | paced) verifying=1 ;; esac
why=
if [ -n "$qmp" ]; then
    # Driven from outside: the caller judges the job from every console.
    [ "$rc" -eq 0 ] || why="QEMU exited with status $rc"
elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    why="timed out after ${timeout_s}s"
elif [ -n "$(fact fatal)" ]; then
    why="guest: $(fact fatal)"
elif ! printf '%s\n' "$facts" | grep -qx 'VSD-GUEST done'; then
    why="guest did not finish (QEMU exit status $rc)"
elif [ -n "$verifying" ] && [ "$(fact fio_write_status)" != 0 ]; then
    why="fio write+verify pass failed (status $(fact fio_write_status))"
elif [ -n "$verifying" ] && [ "$(fact fio_verify_status)" != 0 ]; then
    why="fio read-back verify pass failed (status $(fact fio_verify_status))"
elif [ "$job" = bench ] && [ "$(fact bench_status)" != 0 ]; then
    why="fio bench run failed (status $(fact bench_status))"
elif [ "$job" = bench ] && [ "$(fact bench_error)" != 0 ]; then
    why="fio bench run reported error '$(fact bench_error)'"
elif [ -n "$verifying" ]; then
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
