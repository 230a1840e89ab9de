#!/usr/bin/env python3
"""What TLS costs an NBD export: vsd serves one raw image on /dev/shm over a
unix socket, in the clear and with tls-creds (verify-peer=on), pinned to CPU
0; fio's libnbd engine (ioengine=nbd, an nbds+unix URI with
tls-certificates for TLS) drives it from CPU 1 with 4k random reads at
iodepth 16. qemu-storage-daemon is measured the same two ways, for scale.
With --base VSD, a second vsd binary (say, the commit before TLS) is
measured in the clear beside this one: the plain path should not move.
Servers are interleaved within each repetition (the order reversed every
other one); reported are the medians of IOPS and of the server's CPU time
per I/O. Certificates are made with openssl in the work directory. fio's
engine may not name local files in its URI, so the client's certificates
go where libnbd looks by default for a user other than root
($HOME/.pki/libnbd): servers and fio run as nobody, HOME set for fio.

usage: scripts/bench.py run nbd-tls [--reps 5] [--seconds 5] [--base PATH] [--work /dev/shm/vsd-bench-nbd-tls]
"""
import json
import os
import statistics
import subprocess
import time

import benchlib
from benchlib import QSD, TICK_US, VSD, cpu_ticks

IMAGE_BYTES = 1 << 30
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
FIO = ["--rw=randread", "--bs=4k", "--iodepth=16", "--numjobs=1"]


def openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(work):
    """A CA, a server and a client certificate, in QEMU's and libnbd's
    directory layouts; returns (server dir, client dir)."""
    pki = os.path.join(work, "pki")
    server, client = os.path.join(work, "server-pki"), os.path.join(work, "home/.pki/libnbd")
    if os.path.exists(os.path.join(client, "client-key.pem")):
        return server, client
    for d in (pki, server, client):
        os.makedirs(d, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl(pki, "req", "-x509", *ec, "-days", "30", "-keyout", "ca-key.pem", "-out", "ca-cert.pem",
            "-subj", "/CN=bench-ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for who, usage, to in (("server", "serverAuth", server), ("client", "clientAuth", client)):
        openssl(pki, "req", *ec, "-keyout", f"{who}-key.pem", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        with open(os.path.join(pki, f"{who}.ext"), "w") as f:
            f.write("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    f"extendedKeyUsage={usage}\nsubjectAltName=DNS:localhost\n")
        openssl(pki, "x509", "-req", "-in", f"{who}.csr", "-CA", "ca-cert.pem", "-CAkey", "ca-key.pem",
                "-CAcreateserial", "-days", "30", "-extfile", f"{who}.ext", "-out", f"{who}-cert.pem")
        for name in ("ca-cert.pem", f"{who}-cert.pem", f"{who}-key.pem"):
            with open(os.path.join(pki, name), "rb") as src, open(os.path.join(to, name), "wb") as dst:
                dst.write(src.read())
    return server, client


def servers(image, sock, server_pki, base):
    """Each server's command line and whether clients use TLS."""
    def args(tls):
        creds = ["--object", f"tls-creds-x509,id=tls0,dir={server_pki},endpoint=server"] if tls else []
        return [*creds,
                "--blockdev", f"driver=file,node-name=f0,filename={image},aio=io_uring",
                "--blockdev", "driver=raw,node-name=disk,file=f0",
                "--nbd-server", f"addr.type=unix,addr.path={sock}" + (",tls-creds=tls0" if tls else ""),
                "--export", "type=nbd,id=e0,node-name=disk,name=disk,writable=on"]
    table = {
        "vsd plain": ([VSD, *args(False)], False),
        "vsd tls": ([VSD, *args(True)], True),
        "qsd plain": ([QSD, *args(False)], False),
        "qsd tls": ([QSD, *args(True)], True),
    }
    if base:
        table["vsd-base plain"] = ([base, *args(False)], False)
    return table


def run(command, tls, sock, client_pki, seconds):
    if os.path.exists(sock):
        os.unlink(sock)
    server = subprocess.Popen([*benchlib.pin(benchlib.DAEMON_CPU), *AS_NOBODY, *command], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    uri = f"nbd{'s' if tls else ''}+unix:///disk?socket={sock}"
    home = os.path.dirname(os.path.dirname(client_pki))
    try:
        deadline = time.time() + 20
        while not os.path.exists(sock):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{command[0]} did not start")
            time.sleep(0.02)
        time.sleep(0.2)
        before = cpu_ticks(server.pid)
        report = benchlib.fio(["--name=nbd", "--ioengine=nbd", f"--uri={uri}", *FIO, "--time_based",
                               f"--runtime={seconds}"], env={**os.environ, "HOME": home}, wrapper=AS_NOBODY)
        ticks = cpu_ticks(server.pid) - before
    finally:
        server.terminate()
        server.wait()
    job = report["jobs"][0]["read"]
    return {"iops": job["iops"], "cpu_us_per_io": ticks * TICK_US / max(job["total_ios"], 1)}


def main():
    parser = benchlib.parser(__doc__, reps=5, seconds=5, baseline=False, out=False)
    parser.add_argument("--base", help="another vsd binary, measured in the clear")
    parser.add_argument("--work", default="/dev/shm/vsd-bench-nbd-tls")
    args = benchlib.parse(parser)
    os.makedirs(args.work, exist_ok=True)
    image, sock = os.path.join(args.work, "disk.img"), os.path.join(args.work, "nbd.sock")
    if not os.path.exists(image):
        benchlib.random_file(image, IMAGE_BYTES >> 20)
    server_pki, client_pki = make_pki(args.work)
    # Everything the servers and fio (as nobody) read, write or create.
    subprocess.run(["chown", "-R", "nobody:nogroup", args.work], check=True)
    commands = servers(image, sock, server_pki, args.base)
    results = {name: [] for name in commands}
    for rep in range(args.reps):
        order = list(commands) if rep % 2 == 0 else list(reversed(commands))
        for name in order:
            command, tls = commands[name]
            res = run(command, tls, sock, client_pki, args.seconds)
            results[name].append(res)
            print(f"rep {rep + 1} {name}: {json.dumps(res)}", flush=True)
    print("| server | IOPS (median) | server CPU µs per I/O (median) | IOPS / plain | CPU / plain |")
    print("|---|---|---|---|---|")
    med = {name: (statistics.median(r["iops"] for r in rows), statistics.median(r["cpu_us_per_io"] for r in rows))
           for name, rows in results.items()}
    for name, (iops, cpu) in med.items():
        plain_iops, plain_cpu = med[name.split()[0].replace("vsd-base", "vsd") + " plain"]
        print(f"| {name} | {iops:.0f} | {cpu:.2f} | {iops / plain_iops:.2f} | {cpu / plain_cpu:.2f} |")


if __name__ == "__main__":
    main()
