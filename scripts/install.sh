#!/usr/bin/env bash
# Installs vsd on a host: builds it (release), then installs
#   PREFIX/bin/vsd
#   PREFIX/share/man/man1/vsd.1            (from the same definition as --help)
#   PREFIX/lib/systemd/system/vsd.service, vsd@.service, vsd@.socket
#   PREFIX/share/doc/vsd/disk.conf         (an example /etc/vsd/NAME.conf)
# and a list of what it installed, PREFIX/share/vsd/installed, which
# `--uninstall` reads to remove exactly that (and the directories the
# install created, once empty).
#
#   scripts/install.sh [--uninstall]
#
# PREFIX (default /usr/local) is where vsd lives once installed; DESTDIR
# (default none) is prepended to every path written, for packaging.
# VSD_BIN names a vsd already built, to install instead of building one.
set -euo pipefail

PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
root=$(cd "$(dirname "$0")/.." && pwd)
manifest=$PREFIX/share/vsd/installed
units=(vsd.service vsd@.service vsd@.socket)

die() { echo "install.sh: $*" >&2; exit 1; }

uninstall() {
    local list=$DESTDIR$manifest
    [ -f "$list" ] || die "nothing to uninstall: no $list"
    local recorded
    recorded=$(cat "$list")
    rm -f "$list"
    while read -r kind path; do
        if [ "$kind" = file ]; then rm -f "$DESTDIR$path"; fi
    done <<<"$recorded"
    # Deepest first (a path sorts after its parent), each only if empty:
    # files of others may have come meanwhile.
    { grep '^dir ' <<<"$recorded" || true; } | cut -d' ' -f2- | sort -r | while read -r path; do
        rmdir "$DESTDIR$path" 2>/dev/null || true
    done
    echo "uninstalled vsd from $DESTDIR$PREFIX"
}

# Creates directory $1 (and its parents) under DESTDIR, noting each it made.
make_dir() {
    local dir=$1 missing=()
    while [ "$dir" != / ] && [ ! -d "$DESTDIR$dir" ]; do
        missing+=("$dir")
        dir=$(dirname "$dir")
    done
    mkdir -p "$DESTDIR$1"
    for dir in "${missing[@]}"; do echo "dir $dir" >>"$record"; done
}

# Installs file $2 at $1 with mode $3, noting it.
put() {
    make_dir "$(dirname "$1")"
    install -m "$3" "$2" "$DESTDIR$1"
    echo "file $1" >>"$record"
}

case "${1:-}" in
--uninstall)
    uninstall
    exit 0
    ;;
"") ;;
*) die "unknown argument '$1' (usage: scripts/install.sh [--uninstall])" ;;
esac

binary=${VSD_BIN:-}
if [ -z "$binary" ]; then
    binary=$("$root/scripts/build.sh")/vsd
fi
[ -x "$binary" ] || die "no vsd at '$binary'"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
record=$stage/installed
: >"$record"
"$binary" man >"$stage/vsd.1"
for unit in "${units[@]}"; do
    sed "s|/usr/local/bin/vsd|$PREFIX/bin/vsd|g" "$root/examples/systemd/$unit" >"$stage/$unit"
done

put "$PREFIX/bin/vsd" "$binary" 0755
put "$PREFIX/share/man/man1/vsd.1" "$stage/vsd.1" 0644
for unit in "${units[@]}"; do
    put "$PREFIX/lib/systemd/system/$unit" "$stage/$unit" 0644
done
put "$PREFIX/share/doc/vsd/disk.conf" "$root/examples/systemd/disk.conf" 0644
make_dir "$(dirname "$manifest")"
# Over an earlier install: what that one made stays recorded.
if [ -f "$DESTDIR$manifest" ]; then cat "$DESTDIR$manifest" >>"$record"; fi
sort -u -o "$DESTDIR$manifest" "$record"
echo "installed vsd in $DESTDIR$PREFIX; then: systemctl daemon-reload"
