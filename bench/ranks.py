"""Starting a job's ranks as torchrun does (its env:// variables), or N jobs of one process side by side, for the
bench drivers, and reading their results.

torchrun itself is not used: Debian's (PyTorch 1.13 under Python 3.11) fails before starting a worker."""
import json
import os
import socket
import subprocess
import time


def free_port():
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_env_ranks(cmd, n, timeout):
    """Starts n processes with torchrun's env:// variables (what ddp-launch does); returns rank 0's stdout. When a
    rank fails, the others are stopped and the failing rank's stderr is raised."""
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.time() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            why = failed[0].stderr.read()[-2000:] if failed else "timed out after %d s" % timeout
            raise RuntimeError("%s failed: %s" % (" ".join(cmd), why))
        time.sleep(0.05)
    if any(p.returncode != 0 for p in procs):
        bad = next(p for p in procs if p.returncode != 0)
        raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), bad.returncode, bad.stderr.read()[-2000:]))
    return procs[0].stdout.read()


def slowest_alone(cmd, n, timeout, env_of):
    """Runs n copies of `cmd` at once, each a job of its own (no communication: what sharing the cores costs), copy i
    with the environment env_of(i); returns {"world": n, "median_ms": the largest median_ms of their JSON lines}.
    A copy that fails raises its stderr."""
    procs = [subprocess.Popen(cmd, env=env_of(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError("%s failed (rc %d): %s" % (" ".join(cmd), p.returncode, err[-2000:]))
    return {"world": n, "median_ms": max(last_json(out)["median_ms"] for out, _ in outs)}


def last_json(text):
    """The last line of `text` that is a JSON object (a line may carry a launcher's "[rank 0] " prefix)."""
    for line in reversed(text.splitlines()):
        at = line.find("{")
        if at >= 0 and line.rstrip().endswith("}"):
            return json.loads(line[at:])
    raise RuntimeError("no JSON result in output:\n" + text)
