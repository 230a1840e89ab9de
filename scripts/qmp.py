#!/usr/bin/env python3
"""Runs one QMP command against vsd (or QEMU) with QEMU's own Python client.

usage: qmp.py SOCKET COMMAND [ARGUMENTS-JSON] [--event NAME]

Prints the reply as one JSON line: {"return": ...} (exit status 0) or
{"error": {...}} (exit status 1, so that a script stops on it; the error's
text also goes to standard error); 2 if the client itself failed. With
--event, a command that succeeded then waits up to 10 s for the event NAME
and prints it as a second line (exit status 3 if it did not come).
Needs the `qemu.qmp` package (scripts/setup.sh installs it).
"""
import argparse
import json
import sys

from qemu.qmp.legacy import QEMUMonitorProtocol


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("command")
    parser.add_argument("arguments", nargs="?", default="{}")
    parser.add_argument("--event")
    args = parser.parse_args()
    qmp = QEMUMonitorProtocol(args.socket)
    try:
        qmp.connect()
        reply = qmp.cmd_raw(args.command, json.loads(args.arguments))
        reply.pop("id", None)
        print(json.dumps(reply), flush=True)
        if "error" in reply:
            print(f"qmp.py: {args.command}: {reply['error'].get('desc')}", file=sys.stderr)
            return 1
        if args.event:
            event = qmp.pull_event(wait=10.0)
            while event is not None and event.get("event") != args.event:
                event = qmp.pull_event(wait=10.0)
            print(json.dumps(event))
            if event is None:
                print(f"qmp.py: no {args.event} event within 10 s", file=sys.stderr)
                return 3
    except Exception as e:  # pylint: disable=broad-except
        print(f"qmp.py: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            qmp.close()
        except Exception:  # pylint: disable=broad-except
            # After `quit` the daemon may be gone before the client has
            # closed its side: the reply was already printed.
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
