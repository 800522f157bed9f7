#!/usr/bin/python3
"""The link's own rate: a plain TCP transfer between simulated hosts 0 and 1 (run on each host by
tests/support/multihost.sh, which sets MH_HOST and MH_HOSTS). Each host listens on 10.200.0.<MH_HOST+1>:PORT; in
"one" mode host 1 sends BYTES to host 0, in "both" mode every host sends BYTES to the other at once. Each receiver
prints one JSON line: bytes received, seconds from its first to its last byte, bytes per second.

usage: link_rate.py one|both [--bytes 268435456] [--port 29600]
"""

import argparse
import json
import os
import socket
import threading
import time

CHUNK = 1 << 20


def receive(server, results):
    conn, _ = server.accept()
    with conn:
        got, start = 0, None
        while True:
            data = conn.recv(CHUNK)
            if not data:
                break
            if start is None:
                start = time.monotonic()
            got += len(data)
        results.append((got, time.monotonic() - start))


def send(address, port, total):
    payload = b"\x5a" * CHUNK
    deadline = time.monotonic() + 20
    while True:  # the peer's listener may not be up yet: retry, bounded
        try:
            s = socket.create_connection((address, port), timeout=20)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with s:
        sent = 0
        while sent < total:
            s.sendall(payload[: min(CHUNK, total - sent)])
            sent += min(CHUNK, total - sent)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the receiver closes once it has read everything


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["one", "both"])
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--port", type=int, default=29600)
    args = ap.parse_args()
    host = int(os.environ["MH_HOST"])
    me, peer = f"10.200.0.{host + 1}", f"10.200.0.{2 - host}"
    receives = args.mode == "both" or host == 0
    sends = args.mode == "both" or host == 1
    results = []
    server = None
    if receives:
        server = socket.create_server((me, args.port))
        server.settimeout(60)
        listener = threading.Thread(target=receive, args=(server, results))
        listener.start()
    if sends:
        send(peer, args.port, args.bytes)
    if receives:
        listener.join()
        server.close()
        got, seconds = results[0]
        print(json.dumps({"mode": args.mode, "host": host, "bytes": got, "seconds": seconds,
                          "rate": got / seconds}), flush=True)


if __name__ == "__main__":
    main()
