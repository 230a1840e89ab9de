#!/usr/bin/env python3
"""Writes the seeds of the virtio_blk_request, qmp_input and
vhost_user_messages fuzz targets.

usage: fuzz/seeds/make_seeds.py
  (rewrites fuzz/seeds/{virtio_blk_request,qmp_input,vhost_user_messages,nbd_protocol}/)

virtio_blk_request inputs are a 48-byte header (see the target's docs)
followed by the first bytes of guest memory; these lay a 16-entry split
ring out as a driver would and queue well-formed requests on it.

vhost_user_messages inputs are in the format of vsd_export::fuzzing (see
its module docs): two set-up bytes, then operations (messages with their
descriptors, kicks, raw bytes, resizes, pauses, guest memory writes).
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


# vhost-user front-end requests.
GET_FEATURES, SET_FEATURES, SET_OWNER, RESET_OWNER, SET_MEM_TABLE = 1, 2, 3, 4, 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL, SET_VRING_ERR = 12, 13, 14
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, GET_QUEUE_NUM, SET_VRING_ENABLE = 15, 16, 17, 18
SET_BACKEND_REQ_FD, GET_CONFIG, SET_CONFIG = 21, 24, 25
GET_INFLIGHT_FD, SET_INFLIGHT_FD, GET_MAX_MEM_SLOTS, ADD_MEM_REG, REM_MEM_REG = 31, 32, 36, 37, 38

PROTOCOL = (1 << 0) | (1 << 3) | (1 << 5) | (1 << 9) | (1 << 12) | (1 << 15)
# VERSION_1, PROTOCOL_FEATURES, EVENT_IDX, INDIRECT, FLUSH, SIZE_MAX, SEG_MAX, BLK_SIZE, CONFIG_WCE
FEATURES = (1 << 32) | (1 << 30) | (1 << 29) | (1 << 28) | (1 << 9) | (1 << 1) | (1 << 2) | (1 << 6) | (1 << 11)
USER = 0x7F00_0000_0000  # where the front-end says guest memory is
MEM = 0x10000  # guest memory of these seeds: 64 KiB at 0


def vu_msg(code, body=b"", fds=(), need_reply=False, size=None):
    """A message: true size unless `size` is given, version 1 flags."""
    shape = int(need_reply) | (len(fds) << 5) | ((2 << 3) if size is not None else 0)
    out = bytes([0, code, shape])
    if size is not None:
        out += struct.pack("<I", size)
    for fd in fds:
        out += fd
    return out + struct.pack("<H", len(body)) + body


def fd_memfd(size, fill=b""):
    return bytes([0]) + struct.pack("<IH", size, len(fill)) + fill


FD_EVENT, FD_NULL, FD_SOCKET, FD_RECEIVED, FD_LAST_MEMFD = bytes([1 | 8]), bytes([2]), bytes([3]), bytes([4]), bytes([5])


def kick_all():
    return bytes([5, 0x7F])


def fill_eventfd(n):
    """The front-end fills eventfd n (in the order sent) to the brim."""
    return bytes([5, 0x80 | n])


def resize():
    return bytes([7, 0])


def pause():
    return bytes([7, 1])


def poke(offset, data):
    return bytes([7, 2]) + struct.pack("<IB", offset, len(data)) + data


def vring_state(index, num):
    return struct.pack("<II", index, num)


def negotiate():
    return (
        vu_msg(GET_FEATURES)
        + vu_msg(GET_PROTOCOL_FEATURES)
        + vu_msg(SET_PROTOCOL_FEATURES, struct.pack("<Q", PROTOCOL))
        + vu_msg(GET_QUEUE_NUM)
        + vu_msg(GET_MAX_MEM_SLOTS)
        + vu_msg(SET_OWNER)
        + vu_msg(SET_FEATURES, struct.pack("<Q", FEATURES))
    )


def ring_image():
    """Guest memory with a read and a GET_ID queued on an 8-entry ring
    (descriptors at DESC, available ring at AVAIL, used ring at USED)."""
    g = Guest()
    request(g, 0, T_IN, 0, data=(0x8000, 512))
    request(g, 1, T_GET_ID, 0, data=(0x9000, 20))
    g.put(AVAIL, struct.pack("<HH", 0, len(g.heads)))
    for i, head in enumerate(g.heads):
        g.put(AVAIL + 4 + 2 * i, struct.pack("<H", head))
    return bytes(g.mem).rstrip(b"\0")


def mem_table(size=MEM, memfd_size=MEM, fill=b""):
    body = struct.pack("<II", 1, 0) + struct.pack("<QQQQ", 0, size, USER, 0)
    return vu_msg(SET_MEM_TABLE, body, [fd_memfd(memfd_size, fill)])


def start_ring(index=0, base=USER):
    addr = struct.pack("<II", index, 0) + struct.pack("<QQQQ", base + DESC, base + USED, base + AVAIL, 0)
    return (
        vu_msg(SET_VRING_NUM, vring_state(index, 8))
        + vu_msg(SET_VRING_ADDR, addr)
        + vu_msg(SET_VRING_BASE, vring_state(index, 0))
        + vu_msg(SET_VRING_CALL, struct.pack("<Q", index), [FD_EVENT])
        + vu_msg(SET_VRING_KICK, struct.pack("<Q", index), [FD_EVENT])
        + vu_msg(SET_VRING_ENABLE, vring_state(index, 1))
    )


def add_region(gpa, size, memfd_size, offset=0, user=USER + (1 << 30), fill=b""):
    body = struct.pack("<QQQQQ", 0, gpa, size, user, offset)
    return vu_msg(ADD_MEM_REG, body, [fd_memfd(memfd_size, fill)])


def vhost_user_seeds():
    one_queue = bytes([0x00, 0x00])
    two_queues_polling = bytes([0x01 | 0x08, 0x00])
    image = ring_image()
    setup = negotiate() + mem_table(fill=image) + start_ring(0)
    seeds = {
        # A QEMU-like set-up, the guest kicks, the ring is stopped (its base
        # read back), restarted with a new kick, and the owner reset.
        "setup": one_queue
        + setup
        + kick_all()
        + pause()
        + vu_msg(GET_VRING_BASE, vring_state(0, 0), need_reply=True)
        + vu_msg(SET_VRING_BASE, vring_state(0, 0))
        + vu_msg(SET_VRING_KICK, struct.pack("<Q", 0), [FD_EVENT])
        + poke(AVAIL + 2, struct.pack("<H", 4))
        + kick_all()
        + vu_msg(SET_VRING_CALL, struct.pack("<Q", 0x100))
        + vu_msg(SET_VRING_ENABLE, vring_state(0, 0))
        + vu_msg(RESET_OWNER),
        # Config space: read it, toggle the write cache, hand over a
        # back-end channel and tell the front-end the disk grew.
        "config": two_queues_polling
        + negotiate()
        + vu_msg(GET_CONFIG, struct.pack("<III", 0, 60, 0) + bytes(60))
        + vu_msg(SET_CONFIG, struct.pack("<III", 32, 1, 0) + b"\x00", need_reply=True)
        + vu_msg(SET_BACKEND_REQ_FD, b"", [FD_SOCKET])
        + resize()
        + vu_msg(GET_CONFIG, struct.pack("<III", 0, 8, 0) + bytes(8)),
        # An inflight region from the back-end, handed back, then rings.
        "inflight": one_queue
        + negotiate()
        + vu_msg(GET_INFLIGHT_FD, struct.pack("<QQHHI", 0, 0, 1, 8, 0))
        + vu_msg(SET_INFLIGHT_FD, struct.pack("<QQHHI", 192, 0, 1, 8, 0), [FD_RECEIVED])
        + mem_table(fill=image)
        + start_ring(0)
        + kick_all()
        + vu_msg(GET_VRING_BASE, vring_state(0, 0)),
        # A second region added (the ring moves into it), then removed.
        "mem-regions": one_queue
        + negotiate()
        + mem_table(fill=image)
        + add_region(1 << 30, MEM, MEM, fill=image)
        + start_ring(0, USER + (1 << 30))
        + vu_msg(REM_MEM_REG, struct.pack("<QQQQQ", 0, 1 << 30, MEM, USER + (1 << 30), 0))
        + kick_all()
        + add_region(2 << 30, MEM, 2 * MEM, offset=MEM),
        # A region claiming 1 MiB of a 4 KiB memfd: must be refused.
        "lying-region": one_queue + negotiate() + mem_table(size=1 << 20, memfd_size=4096, fill=image) + start_ring(0),
        # The same by ADD_MEM_REG, at an offset past the file's end.
        "lying-add-region": one_queue
        + negotiate()
        + mem_table(fill=image)
        + add_region(1 << 30, MEM, MEM, offset=0x1000)
        + start_ring(0),
        # A size field claiming 16 bytes of an 8-byte body: the next
        # message's header is read as body.
        "lying-size": one_queue
        + negotiate()
        + vu_msg(SET_VRING_NUM, vring_state(0, 8), size=16)
        + vu_msg(GET_CONFIG, struct.pack("<III", 0, 8, 0) + bytes(8)),
        # Garbage: an unknown code, a partial header, a header that claims
        # the 4 KiB maximum.
        "garbage": one_queue
        + bytes([0, 0xF5]) + struct.pack("<I", 0xDEADBEEF) + bytes([0]) + struct.pack("<H", 0)
        + bytes([6, 5]) + struct.pack("<IB", GET_FEATURES, 1)
        + vu_msg(GET_QUEUE_NUM, size=4096),
    }
    # A call eventfd that blocks, filled by the front-end before the ring
    # starts: the worker's first interrupt cannot be written, and stopping
    # the ring must not wait for it forever.
    addr = struct.pack("<II", 0, 0) + struct.pack("<QQQQ", USER + DESC, USER + USED, USER + AVAIL, 0)
    seeds["blocked-call"] = (
        one_queue
        + negotiate()
        + mem_table(fill=image)
        + vu_msg(SET_VRING_NUM, vring_state(0, 8))
        + vu_msg(SET_VRING_ADDR, addr)
        + vu_msg(SET_VRING_BASE, vring_state(0, 0))
        + vu_msg(SET_VRING_CALL, struct.pack("<Q", 0), [bytes([1])])
        + vu_msg(SET_VRING_KICK, struct.pack("<Q", 0), [FD_EVENT])
        + fill_eventfd(0)
        + vu_msg(SET_VRING_ENABLE, vring_state(0, 1))
        + pause()
        + vu_msg(GET_VRING_BASE, vring_state(0, 0))
    )
    # The decoder's own valid prefixes (4: set-up; 5: with an inflight
    # region; 6: without PROTOCOL_FEATURES; 7: replies asked), then the
    # guest queues more, the rings stop and restart.
    after = (
        poke(0x10000 + 0x4002, struct.pack("<H", 7))
        + kick_all()
        + vu_msg(GET_VRING_BASE, vring_state(0, 0))
        + vu_msg(SET_VRING_BASE, vring_state(0, 2))
        + vu_msg(SET_VRING_KICK, struct.pack("<Q", 0), [FD_EVENT])
        + vu_msg(SET_VRING_NUM, vring_state(1, 64))
    )
    for prefix in (4, 5, 6, 7):
        seeds[f"prefix-{prefix}"] = bytes([prefix << 5 | 1, 0x80 | 3]) + after
    return seeds


IHAVEOPT = 0x49484156454F5054
NBD_REQUEST_MAGIC, NBD_EXTENDED_MAGIC = 0x25609513, 0x21E41C71


def nbd_option(option, data=b""):
    return struct.pack(">QII", IHAVEOPT, option, len(data)) + data


def nbd_go(name=b"disk"):
    # NBD_OPT_GO: the name, then the info requests (block size).
    return nbd_option(7, struct.pack(">I", len(name)) + name + struct.pack(">HH", 1, 3))


def nbd_request(kind, offset, length, flags=0, extended=False):
    if extended:
        return struct.pack(">IHHQQQ", NBD_EXTENDED_MAGIC, flags, kind, 1, offset, length)
    return struct.pack(">IHHQQI", NBD_REQUEST_MAGIC, flags, kind, 1, offset, length)


def nbd_seeds():
    """Handshakes a client makes (two bytes of chunking first), each followed
    by a few requests."""
    flags = struct.pack(">I", 3)  # FIXED_NEWSTYLE | NO_ZEROES
    meta = nbd_option(10, struct.pack(">I", 4) + b"disk" + struct.pack(">I", 1) + struct.pack(">I", 15) + b"base:allocation")
    requests = (nbd_request(0, 0, 4096) + nbd_request(1, 4096, 512) + b"x" * 512 + nbd_request(7, 0, 1 << 20)
                + nbd_request(3, 0, 0) + nbd_request(2, 0, 0))
    ext_requests = nbd_request(0, 0, 4096, extended=True) + nbd_request(7, 0, 1 << 20, extended=True)
    return {
        "simple-go": bytes([0, 7]) + flags + nbd_go() + requests,
        "structured-meta": bytes([1, 3]) + flags + nbd_option(8) + meta + nbd_go() + requests,
        "extended": bytes([2, 16]) + flags + nbd_option(11) + meta + nbd_go() + ext_requests,
        "list-info-abort": bytes([4, 1]) + flags + nbd_option(3) + nbd_option(6, struct.pack(">I", 0) + struct.pack(">H", 0)) + nbd_option(2),
        "export-name": bytes([6, 5]) + flags + nbd_option(1, b"disk") + requests,
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
    write("vhost_user_messages", vhost_user_seeds())
    write("nbd_protocol", nbd_seeds())
