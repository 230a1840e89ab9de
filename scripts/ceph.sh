#!/usr/bin/env bash
# A one-host Ceph cluster for vsd's RBD tests, demo and benchmarks: one
# monitor and one OSD on 127.0.0.1, the OSD keeping its objects in memory
# (memstore) or, with --bluestore, in a sparse file, where they survive the
# OSD's restart; one replica, no manager.
#
#   scripts/ceph.sh start [--cephx] [--bluestore]   # prints the ceph.conf path
#   scripts/ceph.sh stop
#   scripts/ceph.sh status
#   scripts/ceph.sh running          # exit status 0 if it runs
#
# The cluster lives in $VSD_CEPH_DIR (default /tmp/vsd-ceph) and listens on
# $VSD_CEPH_PORT (msgr2; default 3300). With --cephx it requires cephx and
# writes the admin key to $VSD_CEPH_DIR/admin.key; without, auth is none.
# A pool named 'rbd' is ready for images.
#
# memstore keeps every written page in RAM, and its size is a hard limit: a
# full OSD blocks every write without an error. 8 GiB costs nothing until
# written.
set -euo pipefail

dir=${VSD_CEPH_DIR:-/tmp/vsd-ceph}
port=${VSD_CEPH_PORT:-3300}
conf=$dir/ceph.conf

die() { echo "ceph.sh: $*" >&2; exit 1; }
# Every cluster command with a bound: a broken cluster makes them wait forever.
ceph_cmd() { timeout 30 ceph -c "$conf" "$@"; }

write_conf() {
    local auth=$1 fsid=$2 store
    if [ "$3" = bluestore ]; then
        # A sparse file in the OSD's directory; objects survive a restart.
        store="osd_objectstore = bluestore
bluestore_block_create = true
bluestore_block_size = 4294967296
bluestore_fsck_on_mount = false"
    else
        store="osd_objectstore = memstore
memstore_device_bytes = 8589934592
memstore_page_set = true
memstore_page_size = 4096"
    fi
    cat >"$conf" <<CONF
[global]
fsid = $fsid
mon_host = v2:127.0.0.1:$port
auth_cluster_required = $auth
auth_service_required = $auth
auth_client_required = $auth
keyring = $dir/keyring
ms_bind_ipv6 = false
ms_bind_msgr1 = false
run_dir = $dir/run
log_file = $dir/log/\$name.log
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
mon_allow_pool_delete = true
osd_crush_chooseleaf_type = 0
# No manager: without this the cluster warns MGR_DOWN.
mon_mgr_mkfs_grace = 31536000
# Proposals every 50 ms rather than 1 s: the cluster is ready in seconds.
paxos_propose_interval = 0.05
# A test cluster on a host disk of any fullness: by default the monitor
# shuts itself down below 5 % free, and every client then waits.
mon_data_avail_warn = 1
mon_data_avail_crit = 0
# Clients give up on a monitor that does not answer in 30 s, not 300.
client_mount_timeout = 30
$store

# Daemons only: clients would share (and fight over) one socket per name.
[mon]
admin_socket = $dir/run/\$name.asok
pid_file = $dir/run/\$name.pid
[osd]
keyring = $dir/osd/keyring
admin_socket = $dir/run/\$name.asok
pid_file = $dir/run/\$name.pid

[mon.a]
mon_data = $dir/mon

[osd.0]
osd_data = $dir/osd
CONF
}

alive() { [ -f "$dir/run/$1.pid" ] && kill -0 "$(cat "$dir/run/$1.pid")" 2>/dev/null; }
running() { alive mon.a && alive osd.0; }

start() {
    local auth=none store=memstore
    for flag in "$@"; do
        case $flag in
        --cephx) auth=cephx ;;
        --bluestore) store=bluestore ;;
        *) die "unknown flag $flag" ;;
        esac
    done
    if running && writable; then
        echo "$conf"
        return
    fi
    # Whatever is left of a cluster that stopped answering goes.
    stop
    command -v ceph-mon >/dev/null || die "Ceph is not installed (scripts/setup.sh --ceph installs it)"
    rm -rf "$dir"
    mkdir -p "$dir/run" "$dir/log" "$dir/mon" "$dir/osd"
    write_conf "$auth" "$(cat /proc/sys/kernel/random/uuid)" "$store"

    # Keys for the monitor and the admin (ignored when auth is none).
    ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$dir/keyring" --gen-key -n client.admin \
        --cap mon 'allow *' --cap osd 'allow *' --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
    ceph-authtool "$dir/keyring" -p -n client.admin >"$dir/admin.key"

    monmaptool --create --fsid "$(awk '/^fsid/ {print $3}' "$conf")" \
        --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
    ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring"
    ceph-mon -c "$conf" -i a 2>>"$dir/log/mon.a.stderr" 9>&-

    local id
    id=$(ceph_cmd osd create)
    [ "$id" = 0 ] || die "expected OSD id 0, got $id"
    # --no-mon-config: mkfs otherwise waits for the monitor's config forever.
    ceph-osd -c "$conf" -i 0 --mkfs --no-mon-config >/dev/null 2>&1
    if [ "$auth" = cephx ]; then
        ceph_cmd auth get-or-create osd.0 osd 'allow *' mon 'allow profile osd' -o "$dir/osd/keyring"
    fi
    ceph-osd -c "$conf" -i 0 2>>"$dir/log/osd.0.stderr" 9>&-

    ceph_cmd osd pool create rbd 8 >/dev/null 2>&1
    ceph_cmd osd pool application enable rbd rbd >/dev/null 2>&1
    wait_for_clean
    echo "$conf"
}

# Placement group states are the manager's to report, and there is none:
# the pool is ready when an object can be written and read back.
writable() {
    echo ready | timeout 5 rados -c "$conf" -p rbd put vsd-ready - 2>/dev/null &&
        timeout 5 rados -c "$conf" -p rbd rm vsd-ready 2>/dev/null
}

wait_for_clean() {
    local deadline=$((SECONDS + 60))
    while [ $SECONDS -lt $deadline ]; do
        writable && return
        sleep 0.2
    done
    die "the pool did not become writable in 60 s (logs in $dir/log)"
}

stop_daemon() {
    local pidfile=$dir/run/$1.pid
    [ -f "$pidfile" ] || return 0
    local pid
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    # The OSD first: without its monitor it would wait to report.
    stop_daemon osd.0
    stop_daemon mon.a
}

# One caller at a time: test binaries start the cluster concurrently. The
# daemons are started with descriptor 9 closed, or they would hold the lock
# for as long as they run.
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9

case "${1:-}" in
start) shift; start "$@" ;;
stop) stop ;;
status)
    # A stopped cluster answers at once rather than after ceph's 30 s timeout.
    running || die "no test cluster runs in $dir (scripts/ceph.sh start)"
    ceph_cmd -s
    ;;
running) running ;;
*) die "usage: $0 start [--cephx] | stop | status | running" ;;
esac
