#!/usr/bin/python3
"""A minimal remote shell between simulated hosts (tests/support/multihost.sh), for Open MPI's launcher, which
needs an rsh/ssh to start its daemon (orted) on the other host; the simulated hosts have no sshd.

  ns_rsh.py --serve ADDR PORT     on the remote host: accept one connection, run the command it sends with
                                  sh -c, relay its output, exit with its status (and kill it if the caller goes)
  ns_rsh.py [opts] HOST CMD...    as mpirun's --mca plm_rsh_agent: run CMD on HOST (its server on port
                                  NS_RSH_PORT, default 29700), relay the output, exit with the remote status
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def serve(addr, port):
    server = socket.create_server((addr, port))
    server.settimeout(120)
    conn, _ = server.accept()
    server.close()
    reader = conn.makefile("rb")
    command = json.loads(reader.readline())
    child = subprocess.Popen(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)

    def watch():  # the caller closed the connection: end the remote command
        reader.read()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    for line in child.stdout:
        conn.sendall(b"O" + line)
    status = child.wait()
    conn.sendall(b"S%d\n" % status)
    conn.close()
    return 0


def call(host, command, port):
    deadline = time.monotonic() + 30
    while True:  # the server may not listen yet: retry, bounded
        try:
            conn = socket.create_connection((host, port), timeout=600)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.sendall(json.dumps(command).encode() + b"\n")
    status = 255
    for line in conn.makefile("rb"):
        if line.startswith(b"O"):
            sys.stdout.buffer.write(line[1:])
            sys.stdout.flush()
        elif line.startswith(b"S"):
            status = int(line[1:])
    return status


def main():
    args = sys.argv[1:]
    if args and args[0] == "--serve":
        return serve(args[1], int(args[2]))
    while args and args[0].startswith("-"):  # ssh options Open MPI may pass (-x and the like)
        args = args[1:]
    return call(args[0], " ".join(args[1:]), int(os.environ.get("NS_RSH_PORT", "29700")))


if __name__ == "__main__":
    sys.exit(main())
