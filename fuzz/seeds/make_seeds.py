#!/usr/bin/env python3
"""Writes the seeds of the virtio_blk_request and qmp_input fuzz targets.

usage: fuzz/seeds/make_seeds.py   (rewrites fuzz/seeds/{virtio_blk_request,qmp_input}/)

virtio_blk_request inputs are a 48-byte header (see the target's docs)
followed by the first bytes of guest memory; these lay a 16-entry split
ring out as a driver would and queue well-formed requests on it.
"""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# virtio-blk request types and ring flags.
T_IN, T_OUT, T_FLUSH, T_GET_ID, T_DISCARD, T_WRITE_ZEROES = 0, 1, 4, 8, 11, 13
NEXT, WRITE, INDIRECT = 1, 2, 4

DESC, AVAIL, USED = 0x100, 0x300, 0x380  # ring addresses, room for 32 entries
TOP = 2**64 - 1 - 0x10000  # base of the top-of-address-space region (layout 4)


class Guest:
    """Guest memory as a byte image, with a ring in it."""

    def __init__(self):
        self.mem = bytearray(0xA00)
        self.next_desc = 0
        self.heads = []

    def put(self, at, data):
        end = at + len(data)
        if end > len(self.mem):
            self.mem.extend(bytes(end - len(self.mem)))
        self.mem[at:end] = data

    def desc(self, index, addr, length, flags, nxt=0, table=DESC):
        self.put(table + 16 * index, struct.pack("<QIHH", addr, length, flags, nxt))

    def chain(self, parts):
        """Queues a chain of (addr, len, flags) in the descriptor table."""
        head = self.next_desc
        for i, (addr, length, flags) in enumerate(parts):
            last = i == len(parts) - 1
            index = self.next_desc
            self.next_desc += 1
            self.desc(index, addr, length, flags | (0 if last else NEXT), 0 if last else index + 1)
        self.heads.append(head)

    def header(self, at, kind, sector):
        self.put(at, struct.pack("<IIQ", kind, 0, sector))

    def image(self, flags=0b11, layout=0, capacity=1 << 20, block_shift=0, size_shift=4):
        self.put(AVAIL, struct.pack("<HH", 0, len(self.heads)))
        for i, head in enumerate(self.heads):
            self.put(AVAIL + 4 + 2 * i, struct.pack("<H", head))
        header = struct.pack(
            "<BBHQIIQQQI",
            flags | block_shift << 2 | layout << 4,
            size_shift,  # queue size 1 << size_shift
            0,  # next available index
            capacity,
            65536,
            65536,
            DESC,
            AVAIL,
            USED,
            0,
        )
        assert len(header) == 48
        return header + bytes(self.mem)


def request(guest, n, kind, sector, data=None, data_flags=WRITE, segment=None):
    """A request numbered n: header at 0x500 + 32n, status at 0x800 + n."""
    hdr = 0x500 + 32 * n
    guest.header(hdr, kind, sector)
    parts = [(hdr, 16, 0)]
    if segment is not None:
        seg = 0x700 + 16 * n
        guest.put(seg, struct.pack("<QII", *segment))
        parts.append((seg, 16, 0))
    if data is not None:
        parts.append((data[0], data[1], data_flags))
    parts.append((0x800 + n, 1, WRITE))
    guest.chain(parts)


def virtio_seeds():
    seeds = {}

    def one(name, kind, sector, **kw):
        g = Guest()
        request(g, 0, kind, sector, **kw)
        seeds[name] = g.image()

    one("read", T_IN, 8, data=(0x1000, 4096))
    one("write", T_OUT, 16, data=(0x1000, 4096), data_flags=0)
    one("flush", T_FLUSH, 0)
    one("discard", T_DISCARD, 0, segment=(8, 8, 0))
    one("write-zeroes", T_WRITE_ZEROES, 0, segment=(8, 8, 1))
    one("get-id", T_GET_ID, 0, data=(0x1000, 20))

    g = Guest()
    request(g, 0, T_IN, 0, data=(0x1000, 512))
    request(g, 1, T_OUT, 1, data=(0x2000, 512), data_flags=0)
    request(g, 2, T_FLUSH, 0)
    request(g, 3, T_DISCARD, 2, segment=(2, 2, 0))
    request(g, 4, T_WRITE_ZEROES, 4, segment=(4, 4, 0))
    request(g, 5, T_GET_ID, 0, data=(0x3000, 20))
    seeds["mixed"] = g.image(size_shift=5)

    # A read through an indirect table of three descriptors at 0x900.
    g = Guest()
    g.header(0x500, T_IN, 0)
    g.desc(0, 0x500, 16, NEXT, 1, table=0x900)
    g.desc(1, 0x1000, 4096, WRITE | NEXT, 2, table=0x900)
    g.desc(2, 0x800, 1, WRITE, 0, table=0x900)
    g.desc(0, 0x900, 48, INDIRECT)
    g.heads.append(0)
    seeds["indirect"] = g.image()

    # A chain that loops back on itself: never a status byte.
    g = Guest()
    g.header(0x500, T_IN, 0)
    g.desc(0, 0x500, 16, NEXT, 1)
    g.desc(1, 0x1000, 512, WRITE | NEXT, 0)
    g.heads.append(0)
    seeds["loop"] = g.image()

    # A 4 KiB-block, read-only export, asked to write: IOERR.
    g = Guest()
    request(g, 0, T_OUT, 8, data=(0x1000, 4096), data_flags=0)
    request(g, 1, T_IN, 8, data=(0x2000, 4096))
    seeds["read-only-4k"] = g.image(flags=0b10, block_shift=3)

    # Data straddling two regions (the second right after the first).
    g = Guest()
    request(g, 0, T_IN, 0, data=(0xF000, 0x2000))
    seeds["straddle"] = g.image(layout=1)

    # 100 data buffers in an indirect table, each straddling the boundary
    # between two regions: 200 host buffers, more than a request may map.
    g = Guest()
    g.header(0x500, T_IN, 0)
    entries = [(0x500, 16, 0)] + [(0xFF00, 0x200, WRITE)] * 100 + [(0x800, 1, WRITE)]
    for i, (addr, length, flags) in enumerate(entries):
        last = i == len(entries) - 1
        g.desc(i, addr, length, flags | (0 if last else NEXT), 0 if last else i + 1, table=0x2000)
    g.desc(0, 0x2000, 16 * len(entries), INDIRECT)
    g.heads.append(0)
    seeds["many-iovecs"] = g.image(layout=1)

    # A request at the top of the address space (same bytes as at 0).
    g = Guest()
    g.header(0x500, T_OUT, 0)
    g.chain([(TOP + 0x500, 16, 0), (TOP + 0x1000, 4096, 0), (TOP + 0x800, 1, WRITE)])
    seeds["top"] = g.image(layout=4)
    return seeds


def qmp_seeds():
    raw = b"\x00" + bytes(9)  # raw mode, real limit, fixed chunking seed
    small = b"\x00\x02" + bytes(8)  # raw mode, 64-byte limit
    session = (
        b'{"execute": "qmp_capabilities"}\n'
        b'{"execute": "query-version", "id": 1}\n'
        b'{"execute": "echo", "arguments": {"a": [1, {"b": "}"}]}, "id": "x"}\n'
        b'{"execute": "fail"}{"execute": "nothing"}\r\n'
        b'{"execute": "no-such-command", "id": [null]}\n'
    )
    return {
        "session": raw + session,
        "not-negotiated": raw + b'{"execute": "echo"}\n{"execute": "qmp_capabilities", "arguments": {"enable": ["oob"]}}\n',
        "garbage": raw + b'garbage {"a":1}\n{"execute": "qmp_capabilities"}\n"s" [1] {"execute": 1}\n',
        "resync": raw + b'{"execute": "qmp_capabilities", "id": "unterminated\n{"execute": [1, \x04\n\xff\n{"execute": "qmp_capabilities"}\n',
        "pretty": raw + b'{\n  "execute": "qmp_capabilities",\n  "arguments": {\n    "enable": []\n  }\n}\n',
        "too-long": small + b'{"execute": "qmp_capabilities", "arguments": {"enable": [], "x": "' + b"y" * 80 + b'"}}\n{"execute": "qmp_capabilities"}\n',
        "deep": raw + b"[" * 300 + b"]" * 300 + b'\n{"execute": "qmp_capabilities"}\n'
        + b'{"execute": "echo", "arguments": {"a": ' + b"[" * 120 + b"]" * 120 + b"}}\n",
        "enable-type": raw + b'{"execute": "qmp_capabilities", "arguments": {"enable": "oob"}}\n',
        "commands-1": b"\x01" + bytes(range(0, 256, 3)),
        "commands-2": b"\x01" + b"\x07" * 8 + b"qmp_capabilities echo nothing fail \x00\x10\x20\x30" * 3,
    }


def write(target, seeds):
    out = os.path.join(HERE, target)
    os.makedirs(out, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(out, name + ".bin"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    write("virtio_blk_request", virtio_seeds())
    write("qmp_input", qmp_seeds())
