#!/usr/bin/env python3
"""What live migration's dirty logging costs vsd: a Linux guest under QEMU
(TCG, one vCPU, pinned to CPU 1) runs fio 4k random reads at iodepth 32 on
a vhost-user-blk disk that vsd (pinned to CPU 0) serves from a raw image on
/dev/shm; in the "on" runs, QEMU is migrating the guest the whole time
(into `exec:cat > /dev/null` at 1 MiB/s, so the pre-copy never ends), with
VHOST_F_LOG_ALL on, and vsd marks every page it writes in the dirty log.
Runs alternate off/on. Reported per run: the guest's IOPS (bounded by TCG,
which also tracks the guest's own writes while migrating) and vsd's CPU
time per request (its ticks over its requests, boot included).

usage: scripts/bench.py run dirty-log [--runs 3] [--runtime 10] [--work /dev/shm/vsd-dirty-log]
"""
import json
import os
import statistics
import subprocess
import time

import benchlib
from benchlib import ROOT, TICK_US, VSD, cpu_ticks, wait_started
from qemu.qmp import ConnectError
from qemu.qmp.legacy import QEMUMonitorProtocol

IMAGE_BYTES = 1 << 30


def connect(path, timeout=60):
    deadline = time.time() + timeout
    while True:
        try:
            qmp = QEMUMonitorProtocol(path)
            qmp.connect()
            return qmp
        except (OSError, ConnectError):
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def requests(qmp):
    stats = qmp.cmd_raw("query-blockstats", {})["return"][0]["stats"]
    return stats["rd_operations"] + stats["wr_operations"]


def one_run(work, logging, runtime):
    sock, vsd_qmp, qemu_qmp = (os.path.join(work, n) for n in ("vsd.sock", "vsd-qmp.sock", "qemu.qmp"))
    pidfile = os.path.join(work, "vsd.pid")
    for path in (sock, vsd_qmp, qemu_qmp, pidfile):
        if os.path.exists(path):
            os.unlink(path)
    daemon = subprocess.Popen([
        *benchlib.pin(benchlib.DAEMON_CPU), VSD,
        "--blockdev", f"driver=file,node-name=f0,filename={work}/disk.img,aio=io_uring",
        "--blockdev", "driver=raw,node-name=disk0,file=f0",
        "--export", f"type=vhost-user-blk,id=e0,node-name=disk0,addr.type=unix,addr.path={sock},writable=on",
        "--chardev", f"socket,id=m,path={vsd_qmp},server=on,wait=off", "--monitor", "chardev=m",
        "--pidfile", pidfile])
    try:
        wait_started(daemon, pidfile, "vsd")
        control = connect(vsd_qmp)
        ticks, done = cpu_ticks(daemon.pid), requests(control)
        guest = subprocess.Popen(
            [*benchlib.pin(benchlib.CLIENT_CPU), os.path.join(ROOT, "scripts/guest/run-guest.sh"), "--socket", sock,
             "--queues", "1", "--job", "bench", "--rw", "randread", "--bs", "4k", "--iodepth", "32",
             "--runtime", str(runtime), "--size", "512M", "--qmp", qemu_qmp, "--timeout", "600"],
            stdout=subprocess.PIPE, text=True)
        if logging:
            qemu = connect(qemu_qmp)
            qemu.cmd_raw("migrate-set-parameters", {"max-bandwidth": 1 << 20})
            qemu.cmd_raw("migrate", {"uri": "exec:cat > /dev/null"})
            status = qemu.cmd_raw("query-migrate", {})["return"]["status"]
            if status not in ("setup", "active"):
                raise RuntimeError(f"the migration is {status}, so logging is not on")
            qemu.close()
        out, _ = guest.communicate()
        facts = dict(line[len("VSD-GUEST "):].split("=", 1) for line in out.splitlines() if "=" in line)
        ticks, done = cpu_ticks(daemon.pid) - ticks, requests(control) - done
        control.close()
    finally:
        daemon.terminate()
        daemon.wait()
    return {"iops": float(facts["bench_iops"]), "cpu_us_per_io": ticks * TICK_US / max(done, 1), "requests": done}


def main():
    parser = benchlib.parser(__doc__, baseline=False, out=False)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--runtime", type=int, default=10)
    parser.add_argument("--work", default="/dev/shm/vsd-dirty-log")
    args = benchlib.parse(parser)
    os.makedirs(args.work, exist_ok=True)
    with open(os.path.join(args.work, "disk.img"), "wb") as f:
        f.truncate(IMAGE_BYTES)
    results = {"off": [], "on": []}
    for i in range(args.runs):
        for variant in ("off", "on"):
            res = one_run(args.work, variant == "on", args.runtime)
            results[variant].append(res)
            print(f"run {i + 1} logging {variant}: {json.dumps(res)}", flush=True)
    for variant, runs in results.items():
        iops = statistics.median(r["iops"] for r in runs)
        cpu = statistics.median(r["cpu_us_per_io"] for r in runs)
        print(f"logging {variant}: median IOPS {iops:.0f}, median vsd CPU per request {cpu:.2f} us")
    off, on = (statistics.median(r["cpu_us_per_io"] for r in results[v]) for v in ("off", "on"))
    print(f"logging on / off: CPU per request {on / off:.2f}x")


if __name__ == "__main__":
    main()
