#!/usr/bin/env bash
# Installs what vsd's demo, tests and benchmarks need on a fresh Debian bookworm
# machine: QEMU 10 and qemu-storage-daemon from bookworm-backports, fio,
# busybox-static and a Debian kernel for the test guest; chromium, which
# renders the lab report and the status page headless in their tests;
# Prometheus, which runs the Grafana dashboard's queries on a scrape of vsd;
# libnbd's tools and nbdkit (a
# peer server for the NBD client driver); strace, which shows the NBD
# tests the server's splice calls; openssl, which
# makes the NBD TLS tests' certificates; nginx, the web server of the http
# driver's tests; systemd-socket-activate, which hands sockets over as
# systemd does, and systemd-analyze, which verifies the example units;
# man-db, which renders the man page scripts/install.sh installs;
# chattr, which makes a file refuse writers; Ceph's monitor, OSD and
# client tools with librbd, for the RBD driver and its test
# cluster (scripts/ceph.sh), and QEMU's rbd module, the peer measured on it;
# the Python packages qemu.qmp and prometheus_client for the control tests;
# fuse3, whose fusermount3 mounts FUSE exports for a daemon not run as root.
#
# bookworm-backports is added by reusing the URIs of the machine's existing
# Debian source, so no mirror is hard-coded here.
set -euo pipefail

need_root() { if [ "$(id -u)" -ne 0 ]; then exec sudo -E "$0" "$@"; fi; }
need_root "$@"

have_all() {
    command -v qemu-system-x86_64 >/dev/null && command -v qemu-storage-daemon >/dev/null &&
        command -v fio >/dev/null && [ -x /bin/busybox ] && command -v chromium >/dev/null &&
        command -v nbdinfo >/dev/null && command -v nbdcopy >/dev/null && command -v nbdkit >/dev/null &&
        command -v openssl >/dev/null && command -v strace >/dev/null && command -v nginx >/dev/null &&
        command -v systemd-socket-activate >/dev/null && command -v chattr >/dev/null && command -v man >/dev/null &&
        command -v prometheus >/dev/null && command -v fusermount3 >/dev/null &&
        command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && command -v rbd >/dev/null &&
        ls /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so >/dev/null 2>&1 &&
        ls /boot/vmlinuz-* >/dev/null 2>&1 &&
        qemu-system-x86_64 --version | grep -qE 'version (9|[1-9][0-9])\.'
}
# QEMU's own QMP client and Prometheus' text parser, for the control tests.
have_python_modules() { python3 -c 'import qemu.qmp, prometheus_client' 2>/dev/null; }
install_python_modules() {
    have_python_modules || python3 -m pip install -q --disable-pip-version-check qemu.qmp prometheus_client
}
if have_all; then
    install_python_modules
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
backports=/etc/apt/sources.list.d/vsd-backports.sources
if [ ! -e "$backports" ]; then
    uris=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v security | head -n 1 | sed 's/^URIs:[[:space:]]*//')
    if [ -z "$uris" ]; then
        uris=$(grep -hE '^deb[[:space:]]' /etc/apt/sources.list 2>/dev/null |
            grep -v security | head -n 1 | awk '{print $2}')
    fi
    [ -n "$uris" ] || { echo "setup: no Debian source found to derive bookworm-backports from" >&2; exit 1; }
    cat >"$backports" <<SRC
Types: deb
URIs: $uris
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

apt-get update -qq
apt-get install -y -qq -t bookworm-backports qemu-system-x86 qemu-utils qemu-block-extra >/dev/null
apt-get install -y -qq fio busybox-static linux-image-amd64 xz-utils cpio socat chromium libnbd-bin nbdkit openssl \
    strace ceph-mon ceph-osd ceph-common nginx-light systemd man-db e2fsprogs fuse3 >/dev/null
# Without its recommends: the server alone, no node exporter service.
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
have_all || { echo "setup: packages installed but a tool is still missing" >&2; exit 1; }
install_python_modules
