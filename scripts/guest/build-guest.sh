#!/usr/bin/env bash
# Builds the tiny Linux test guest that run-guest.sh boots against a
# vhost-user-blk socket:
#
#   build-guest.sh OUTDIR
#
# Writes OUTDIR/vmlinuz (the host's newest /boot/vmlinuz-*) and
# OUTDIR/initramfs.cpio (busybox, fio plus its shared libraries, the disk
# drivers' modules and their dependencies, and scripts/guest/init as /init).
# When the kernel supports PVH boot (CONFIG_PVH=y, as Debian's does) it also
# writes OUTDIR/vmlinux, the decompressed ELF kernel, which run-guest.sh
# prefers.
#
# Both choices are about TCG speed, where every guest instruction is slow:
# - the initramfs is left uncompressed: gzip or zstd made each boot 8-11 s
#   slower, copying a raw cpio is cheap;
# - QEMU loads a PVH vmlinux straight into guest memory, while a bzImage first
#   xz-decompresses itself inside the guest (4-5 s per boot).
#
# Idempotent: a fingerprint of every input is kept in OUTDIR/inputs.txt and
# nothing is rebuilt while it matches. Concurrent callers serialise on a lock
# so parallel test runs never see a half-written initramfs.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
init_src="$here/init"
self="$here/build-guest.sh"

die() { echo "build-guest: $*" >&2; exit 1; }

# Newest kernel by version order, not by name order (…-9 vs …-10).
kernel=$(find /boot -maxdepth 1 -name 'vmlinuz-*' -print | sort -V | tail -n 1)
[ -n "$kernel" ] || die "no /boot/vmlinuz-* (run scripts/setup.sh)"
[ -r "$kernel" ] || die "$kernel is not readable"
kver=${kernel#/boot/vmlinuz-}
moddir=/lib/modules/$kver
[ -r "$moddir/modules.dep" ] || die "no $moddir/modules.dep for kernel $kver"

fio_bin=$(command -v fio) || die "fio not found (run scripts/setup.sh)"
busybox=/bin/busybox
[ -x "$busybox" ] || die "$busybox not found (run scripts/setup.sh)"
# A dynamic busybox would need its own libraries; the static one needs none.
if ldd "$busybox" >/dev/null 2>&1; then
    die "$busybox is not static (install busybox-static)"
fi

# Modules the guest needs, one set per kind of disk (vd*, sd*), each in an
# order where every dependency comes first. /init loads only the set for its
# vsd.disk, so a virtio-blk boot does not pay for the SCSI and ATA stacks
# (nor for probing the AHCI controller every q35 machine has) under TCG.
#   vd: virtio_pci drives the PCI transport, virtio_blk the disk;
#   sd: sd_mod drives SCSI disks behind virtio_scsi (virtio-scsi-pci) or
#       behind ahci (the q35 machine's ICH9 AHCI controller, where QEMU's
#       ide-hd disks sit, seen through libata).
# Whatever modules.dep lists for them (virtio_ring, scsi_mod, libata, the
# CRCs of t10-pi…) follows.
declare -A module_sets=(
    [vd]="virtio_pci virtio_blk"
    [sd]="virtio_pci virtio_scsi ahci sd_mod"
)

declare -A mod_path=() mod_deps=() mod_seen=()
while IFS= read -r line; do
    path=${line%%:*}
    name=${path##*/}
    name=${name%%.ko*}
    mod_path[$name]=$path
    mod_deps[$name]=${line#*:}
done <"$moddir/modules.dep"

# Modules are keyed by file name (virtio_blk), the name insmod is given.
mod_order=()
add_module() {
    local name=$1 dep dname
    [ -n "${mod_seen[$name]:-}" ] && return 0
    mod_seen[$name]=1
    [ -n "${mod_path[$name]:-}" ] || die "module $name not in $moddir/modules.dep"
    for dep in ${mod_deps[$name]}; do
        dname=${dep##*/}
        dname=${dname%%.ko*}
        add_module "$dname"
    done
    mod_order+=("$name")
}
declare -A set_order=() all_modules=()
for kind in "${!module_sets[@]}"; do
    mod_seen=()
    mod_order=()
    for m in ${module_sets[$kind]}; do
        # A built-in driver needs no module: modules.builtin lists those.
        if grep -qE "/$m\.ko" "$moddir/modules.builtin" 2>/dev/null; then
            continue
        fi
        add_module "$m"
    done
    set_order[$kind]="${mod_order[*]}"
    for m in "${mod_order[@]}"; do all_modules[$m]=1; done
done
# Sorted: the fingerprint below must not depend on hash order.
mapfile -t modules < <(for m in "${!all_modules[@]}"; do echo "$m"; done | LC_ALL=C sort)

# Every file whose change must trigger a rebuild; fio's libraries are
# included so a library upgrade on the host is picked up.
mapfile -t fio_libs < <(ldd "$fio_bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
config=/boot/config-$kver
inputs=("$kernel" "$busybox" "$fio_bin" "$init_src" "$self" "$moddir/modules.dep" "${fio_libs[@]}")
for m in "${modules[@]}"; do inputs+=("$moddir/${mod_path[$m]}"); done
pvh=
if [ -r "$config" ] && grep -qx 'CONFIG_PVH=y' "$config"; then
    pvh=1
    inputs+=("$config")
fi
fingerprint() {
    local f
    for f in "${inputs[@]}"; do
        stat -L -c '%n %s %Y' "$f"
    done
    sha256sum "$init_src" "$self"
}

exec 9>"$out/.lock"
flock 9

want=$(fingerprint)
if [ -f "$out/inputs.txt" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.cpio" ] &&
    { [ -z "$pvh" ] || [ -f "$out/vmlinux" ]; } &&
    [ "$(cat "$out/inputs.txt")" = "$want" ]; then
    exit 0
fi

stage=$(mktemp -d "$out/.stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT

# Prints the decompressed vmlinux inside a bzImage. The payload's place comes
# from the boot protocol header (setup_sects at 0x1f1, payload_offset at
# 0x248, payload_length at 0x24c); its last 4 bytes are the uncompressed size
# the kernel build appends, not compressed data.
extract_vmlinux() {
    local img=$1 sects off len start magic
    sects=$(od -An -tu1 -j $((0x1f1)) -N1 "$img" | tr -d ' ')
    [ "$sects" -ne 0 ] || sects=4
    off=$(od -An -tu4 -j $((0x248)) -N4 "$img" | tr -d ' ')
    len=$(od -An -tu4 -j $((0x24c)) -N4 "$img" | tr -d ' ')
    start=$(((sects + 1) * 512 + off))
    magic=$(od -An -tx1 -j "$start" -N4 "$img" | tr -d ' ')
    payload() { dd if="$img" bs=64K iflag=skip_bytes,count_bytes skip="$start" count=$((len - 4)) status=none; }
    case "$magic" in
    fd377a58) payload | xz -dc --single-stream ;;
    28b52ffd) payload | zstd -qdc ;;
    1f8b*) payload | gzip -dc ;;
    *) return 1 ;;
    esac
}

# Decompressing takes about as long as the rest of the build: overlap them.
if [ -n "$pvh" ]; then
    extract_vmlinux "$kernel" >"$stage/vmlinux" 2>"$stage/vmlinux.err" &
    extract_pid=$!
fi
root=$stage/root
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,tmp,run,etc,lib/modules}

cp "$busybox" "$root/bin/busybox"
# One symlink per applet at the path busybox itself reports (bin/sh,
# sbin/insmod…); all of those directories exist already.
while IFS= read -r applet; do
    [ -e "$root/$applet" ] || [ -L "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done < <("$busybox" --list-full)

# fio and every library at the path ldd resolved it to (the loader path too),
# so the guest's loader finds them without an ld.so.cache.
cp "$fio_bin" "$root/usr/bin/fio"
libdirs=()
for lib in "${fio_libs[@]}"; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
    libdirs+=("$(dirname "$lib")")
done
# Written for /init: LD_LIBRARY_PATH covers directories outside the loader's
# defaults (e.g. .../ceph), which the host finds through its ld.so.cache.
printf '%s\n' "${libdirs[@]}" | sort -u | paste -sd: >"$root/etc/ld-library-path"

# Modules decompressed (busybox insmod can't read .ko.xz/.ko.zst), and for
# each set the list /init loads in order, lib/modules/KIND.load-order.
for m in "${modules[@]}"; do
    src=$moddir/${mod_path[$m]}
    dst=$root/lib/modules/$m.ko
    case "$src" in
    *.ko) cp "$src" "$dst" ;;
    *.ko.xz) xz -dc "$src" >"$dst" ;;
    *.ko.zst) zstd -qdc "$src" >"$dst" ;;
    *.ko.gz) gzip -dc "$src" >"$dst" ;;
    *) die "unknown module format: $src" ;;
    esac
done
for kind in "${!set_order[@]}"; do
    # An empty set (every driver built in) leaves an empty list.
    tr ' ' '\n' <<<"${set_order[$kind]}" | sed '/^$/d' >"$root/lib/modules/$kind.load-order"
done

cp "$init_src" "$root/init"
chmod 755 "$root/init"
echo "$kver" >"$root/etc/guest-kernel"

(cd "$root" && find . -mindepth 1 -print | LC_ALL=C sort |
    cpio --quiet -o -H newc -R 0:0) >"$stage/initramfs.cpio"

cp "$kernel" "$stage/vmlinuz"
rm -f "$out/vmlinux"
if [ -n "$pvh" ]; then
    # Without a usable vmlinux run-guest.sh falls back to the bzImage.
    if wait "$extract_pid" && [ "$(head -c 4 "$stage/vmlinux" | od -An -tx1 | tr -d ' ')" = 7f454c46 ]; then
        mv -f "$stage/vmlinux" "$out/vmlinux"
    else
        echo "build-guest: could not extract vmlinux from $kernel, using the bzImage" >&2
        cat "$stage/vmlinux.err" >&2
    fi
fi
mv -f "$stage/vmlinuz" "$out/vmlinuz"
mv -f "$stage/initramfs.cpio" "$out/initramfs.cpio"
echo "$want" >"$out/inputs.txt"
