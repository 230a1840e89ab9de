#!/usr/bin/env python3
"""What a flood of idle NBD connections costs, and whether a real client
gets through it: vsd (and qemu-storage-daemon, for scale) serves a 64 MiB
file on a unix socket with max-connections at its default (100); 1,000
clients connect and stop after the greeting, then keep reconnecting as the
server drops them, for --seconds (--no-reconnect: they connect once).
Reported per daemon: RSS before, at its peak and after; threads at their
peak; the connections the flood made, and the daemon's CPU seconds during
it (and per connection); how long `qemu-img info` took, run once a second
during it (the worst and the median).

usage: scripts/bench.py run nbd-flood [--seconds 10] [--clients 1000] [--no-reconnect] [--target-dir T] [--work /dev/shm/vsd-bench-nbd-flood]
"""
import argparse
import os
import socket
import statistics
import subprocess
import threading
import time

import benchlib
from benchlib import QSD, TICK_US, cpu_ticks


def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        line = next(l for l in f if l.startswith(key + ":"))
    return int(line.split()[1])


def flood(sock, clients, until, reconnect, made):
    """Keeps `clients` idle connections open until `until`, reopening those
    the server closes if `reconnect`; counts them in `made`."""
    conns = []
    while time.time() < until and (reconnect or not conns):
        for i in range(clients):
            if i < len(conns) and not closed(conns[i]):
                continue
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(sock)
            except OSError:
                continue
            made[0] += 1
            s.setblocking(False)
            if i < len(conns):
                conns[i].close()
                conns[i] = s
            else:
                conns.append(s)
        time.sleep(0.05)
    while time.time() < until:
        time.sleep(0.05)
    for s in conns:
        s.close()


def closed(s):
    try:
        while True:
            if not s.recv(4096):
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def measure(name, program, args, work, seconds, clients, reconnect):
    sock = os.path.join(work, f"{name}.sock")
    daemon = subprocess.Popen([program, *args(sock)], stderr=subprocess.DEVNULL)
    while not os.path.exists(sock):
        time.sleep(0.01)
    time.sleep(0.5)
    pid = daemon.pid
    rss_before, ticks_before = status(pid, "VmRSS"), cpu_ticks(pid)
    until = time.time() + seconds
    made = [0]
    flooder = threading.Thread(target=flood, args=(sock, clients, until, reconnect, made))
    flooder.start()
    rss_peak = threads_peak = 0
    waits = []
    uri = f"nbd+unix:///disk?socket={sock}"
    while time.time() < until:
        started = time.time()
        probe = subprocess.run(["timeout", "60", "qemu-img", "info", uri], capture_output=True)
        waits.append(time.time() - started if probe.returncode == 0 else float("inf"))
        rss_peak, threads_peak = max(rss_peak, status(pid, "VmRSS")), max(threads_peak, status(pid, "Threads"))
        time.sleep(max(0, 1 - (time.time() - started)))
    flooder.join()
    cpu = (cpu_ticks(pid) - ticks_before) * TICK_US / 1e6
    time.sleep(1)
    rss_after = status(pid, "VmRSS")
    daemon.terminate()
    daemon.wait()
    return [name, rss_before // 1024, rss_peak // 1024, rss_after // 1024, threads_peak, made[0], f"{cpu:.2f}",
            f"{cpu * 1e6 / max(made[0], 1):.0f}", f"{max(waits):.2f}", f"{statistics.median(waits):.2f}"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--no-reconnect", action="store_true")
    parser.add_argument("--target-dir")
    parser.add_argument("--work", default="/dev/shm/vsd-bench-nbd-flood")
    opts = parser.parse_args()
    benchlib.use_build(opts.target_dir)
    os.makedirs(opts.work, exist_ok=True)
    image = os.path.join(opts.work, "disk.img")
    with open(image, "wb") as f:
        f.truncate(64 << 20)

    def args(sock):
        return ["--blockdev", f"driver=file,node-name=f0,filename={image}",
                "--nbd-server", f"addr.type=unix,addr.path={sock}",
                "--export", "type=nbd,id=e0,node-name=f0,name=disk"]

    rows = [measure(name, program, args, opts.work, opts.seconds, opts.clients, not opts.no_reconnect)
            for name, program in (("vsd", benchlib.VSD), ("qsd", QSD))]
    head = ["server", "RSS before MiB", "RSS peak MiB", "RSS after MiB", "threads peak", "connections", "CPU s",
            "CPU µs/conn", "qemu-img worst s", "qemu-img median s"]
    how = "connecting once" if opts.no_reconnect else "reconnecting when dropped"
    print(f"{opts.clients} idle clients, {how}, for {opts.seconds:g} s")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
