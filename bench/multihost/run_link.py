#!/usr/bin/python3
"""Benchmarks over a rate-limited link between two simulated hosts (tests/support/multihost.sh: each host its own
network, PID, IPC, UTS and mount namespaces, a bridge between them, tc tbf on every host's outgoing traffic). Every
measurement is repeated --reps times, alternating the variants it compares; the tables show medians.

  1. the link's own rate: a plain TCP transfer (link_rate.py), one way and both ways at once;
  2. ddp all_reduce busbw from 1 to 64 MiB at 2 hosts x 2 ranks and 2 hosts x 1 rank (ddp_link_bench allreduce);
  3. bytes each host sends across the link per step under replicate, shard_grad_op, full_shard and
     hybrid<full_shard> (a shard group per host) at 2 x 2, from eth0's counter between two barriers, against theory;
  4. step time at 2 x 1 of replicate with plain and bf16 comm hooks, and with buckets overlapping the backward
     against one bucket larger than the model (its reduction starts after the whole backward);
  5. Open MPI's MPI_Allreduce (and ddp::mpi over it) at 2 x 2 across the same hosts, started by mpirun through
     ns_rsh.py (the hosts have no sshd), beside ddp.

Writes docs/bench/multihost_link.md, .csv and .json, and docs/img/multihost_link.png.

usage: bench/multihost/run_link.py BUILD_DIR [--rate 1gbit] [--reps 3]    (as root)
       bench/multihost/run_link.py --from-json docs/bench/multihost_link.json   (rewrite the tables and the plot)
"""

import argparse
import csv
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HARNESS = os.path.join(ROOT, "tests", "support", "multihost.sh")
MIB = 1 << 20


def on_hosts(command, rate, timeout=240):
    """Runs `command` on both hosts; returns each host's output lines (fails loudly on a failed host)."""
    with tempfile.TemporaryDirectory() as out:
        cmd = ["bash", HARNESS, "--hosts", "2", "--rate", rate, "--timeout", str(timeout), "--out", out, "--", command]
        status = subprocess.run(cmd, timeout=timeout + 30).returncode
        logs = []
        for h in range(2):
            with open(os.path.join(out, f"host{h}.log")) as f:
                logs.append(f.read())
        if status != 0:
            raise RuntimeError(f"multihost.sh exited with {status}:\n" + "\n".join(logs))
        return logs


def json_lines(logs):
    """The JSON objects printed on any host (after ddp-launch's "[rank R] " prefix)."""
    found = []
    for log in logs:
        for line in log.splitlines():
            at = line.find("{")
            if at >= 0 and line.rstrip().endswith("}"):
                found.append(json.loads(line[at:]))
    return found


def launch(build, nproc, args):
    return (f"DDP_TIMEOUT_MS=60000 {build}/tools/ddp-launch --nnodes 2 --node-rank $MH_HOST -n {nproc} "
            f"--master-addr $MH_MASTER --master-port 29400 --bind none -- {build}/bench/multihost/ddp_link_bench {args}")


def link_rate(args):
    rates = {"one": [], "both": []}
    for _ in range(args.reps):
        for mode in rates:
            logs = on_hosts(f"/usr/bin/python3 {HERE}/link_rate.py {mode} --bytes {128 * MIB}", args.rate, 60)
            rates[mode] += [r["rate"] for r in json_lines(logs)]
    return {m: statistics.median(v) for m, v in rates.items()}


def allreduce(args, nproc):
    times = {}
    for _ in range(args.reps):
        logs = on_hosts(launch(args.build, nproc, f"allreduce --min-bytes {MIB} --max-bytes {64 * MIB} --iters 5"),
                        args.rate)
        for r in json_lines(logs):
            times.setdefault(r["bytes"], []).append(r["seconds"])
    world = 2 * nproc
    return [{"bytes": b, "seconds": statistics.median(t),
             "busbw": b * 2 * (world - 1) / world / statistics.median(t)} for b, t in sorted(times.items())]


def policies(args):
    rows = []
    steps = 10
    for policy in ["replicate", "shard_grad_op", "full_shard", "hybrid"]:
        logs = on_hosts(launch(args.build, 2, f"policy --policy {policy} --steps {steps}"), args.rate)
        hosts = json_lines(logs)
        psi = hosts[0]["psi_bytes"]
        # Bytes a host sends across the link per step, for H = 2 hosts of K = 2 ranks (N = 4, ring by rank: one
        # ring edge per host crosses, carrying what one rank sends): all_reduce 2Ψ(N-1)/N, reduce_scatter and
        # all_gather Ψ(N-1)/N each; hybrid<full_shard>: the K ranks of a host each all-reduce their Ψ/K shard with
        # their counterpart, 2(Ψ/K)(H-1)/H each, 2Ψ(H-1)/H per host; its gathers stay inside the host.
        n = 4
        theory = {"replicate": 2 * psi * (n - 1) / n, "shard_grad_op": 2 * psi * (n - 1) / n,
                  "full_shard": 3 * psi * (n - 1) / n, "hybrid": 2 * psi * (2 - 1) / 2}[policy]
        for h in hosts:
            rows.append({"policy": h["policy"], "rank": h["rank"], "psi_bytes": psi, "steps": h["steps"],
                         "link_bytes_per_step": h["link_tx_bytes"] / h["steps"], "theory_bytes": theory,
                         "rank_payload_per_step": h["rank_payload_bytes"] / h["steps"]})
    return rows


def steps(args):
    configs = [("plain", 0, args.overlap_batch), ("plain", 1, args.overlap_batch),
               ("plain", 0, args.hook_batch), ("bf16", 0, args.hook_batch)]
    found = {}
    for _ in range(args.reps):
        for hook, after, batch in configs:
            logs = on_hosts(launch(args.build, 1, f"step --hook {hook} --after-backward {after} --batch {batch} "
                                                  f"--steps 7"), args.rate)
            for r in json_lines(logs):
                found.setdefault((hook, after, batch), []).append(r)
    rows = []
    for (hook, after, batch), rs in found.items():
        rows.append({"hook": hook, "after_backward": bool(after), "batch": batch, "buckets": rs[0]["buckets"],
                     "psi_bytes": rs[0]["psi_bytes"], "step_seconds": statistics.median(r["step_seconds"] for r in rs),
                     "forward_backward_seconds": statistics.median(r["forward_backward_seconds"] for r in rs),
                     "compute_seconds": statistics.median(r["compute_seconds"] for r in rs),
                     "step_seconds_all": [r["step_seconds"] for r in rs]})
    return rows


def open_mpi(args):
    rsh = os.path.join(HERE, "ns_rsh.py")
    command = (f"if [ $MH_HOST = 1 ]; then exec /usr/bin/python3 {rsh} --serve 10.200.0.2 29700; fi; "
               f"mpirun --allow-run-as-root --host 10.200.0.1:2,10.200.0.2:2 -np 4 --mca plm_rsh_agent {rsh} "
               "--mca mpi_yield_when_idle 1 --mca btl tcp,self,vader --mca btl_tcp_if_include eth0 "
               f"--mca oob_tcp_if_include eth0 {args.build}/bench/mpi/ddp_bench_mpi --min {MIB} --max {64 * MIB} "
               "--factor 2 --rounds 1 --calls 3")
    times = {}
    for _ in range(args.reps):
        logs = on_hosts(command, args.rate, 400)
        for line in logs[0].splitlines():
            m = re.match(r"\| (\d+) MiB \| \d+ \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", line)
            if m:
                times.setdefault(int(m.group(1)) * MIB, []).append((float(m.group(2)), float(m.group(3))))
    rows = []
    for b, ts in sorted(times.items()):
        t_mpi = statistics.median(t[0] for t in ts) / 1e6
        t_ddp_mpi = statistics.median(t[1] for t in ts) / 1e6
        rows.append({"bytes": b, "mpi_seconds": t_mpi, "mpi_busbw": b * 1.5 / t_mpi,
                     "ddp_mpi_seconds": t_ddp_mpi, "ddp_mpi_busbw": b * 1.5 / t_ddp_mpi})
    return {"command": command.split("fi; ", 1)[1], "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build", nargs="?")
    ap.add_argument("--from-json")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--overlap-batch", type=int, default=16)
    ap.add_argument("--hook-batch", type=int, default=1)
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            return write(json.load(f))
    args.build = os.path.abspath(args.build)
    load = os.getloadavg()[0]
    result = {"rate": args.rate, "reps": args.reps, "load_average": load,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    result["link"] = link_rate(args)
    print("link", result["link"], flush=True)
    result["allreduce_2x2"] = allreduce(args, 2)
    result["allreduce_2x1"] = allreduce(args, 1)
    print("allreduce done", flush=True)
    result["policies"] = policies(args)
    print("policies done", flush=True)
    result["steps"] = steps(args)
    print("steps done", flush=True)
    try:
        result["open_mpi"] = open_mpi(args)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        result["open_mpi"] = {"error": str(e)[-2000:], "rows": []}
    write(result)


def human(b):
    return f"{b // MIB} MiB"


def targets(r, link):
    """Issue 15's targets against this run's medians."""
    big = [a["busbw"] / link for a in r["allreduce_2x2"] if a["bytes"] >= 4 * MIB]
    hybrid = [abs(p["link_bytes_per_step"] / p["theory_bytes"] - 1) for p in r["policies"]
              if p["policy"].startswith("hybrid")]
    st = {(s["hook"], s["after_backward"], s["batch"]): s["step_seconds"] for s in r["steps"]}
    ob, hb = r["steps"][0]["batch"], r["steps"][-1]["batch"]
    gain = 1 - st[("plain", False, ob)] / st[("plain", True, ob)]
    speedup = st[("plain", False, hb)] / st[("bf16", False, hb)]

    def line(what, value, ok):
        return f"| {what} | {value} | {'met' if ok else '**not met**'} |"

    return ["## Targets (issue 15)", "", "| target | this run | |", "|---|---:|---|",
            line("all_reduce busbw ≥ 90 % of the link from 4 MiB up, 2 × 2", f"{min(big) * 100:.0f} % (lowest)",
                 min(big) >= 0.9),
            line("hybrid<full_shard> link bytes within 1 % of 2Ψ(R−1)/R", f"{max(hybrid) * 100:.2f} %",
                 max(hybrid) <= 0.01),
            line("overlap gain ≥ 25 %", f"{gain * 100:.1f} %", gain >= 0.25),
            line("bf16 hook step ≥ 1.6× faster, link-bound", f"{speedup:.2f}×", speedup >= 1.6), ""]


def write(r):
    link = r["link"]["one"]
    docs = os.path.join(ROOT, "docs", "bench")
    with open(os.path.join(docs, "multihost_link.json"), "w") as f:
        json.dump(r, f, indent=1)
    with open(os.path.join(docs, "multihost_link.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "key", "value1", "value2", "value3"])
        w.writerow(["link", "one_way_Bps", link, "both_ways_Bps", r["link"]["both"]])
        for name in ("allreduce_2x2", "allreduce_2x1"):
            for row in r[name]:
                w.writerow([name, row["bytes"], row["seconds"], row["busbw"], row["busbw"] / link])
        for row in r["policies"]:
            w.writerow(["policy:" + row["policy"], row["rank"], row["link_bytes_per_step"], row["theory_bytes"],
                        row["link_bytes_per_step"] / row["theory_bytes"] - 1])
        for row in r["steps"]:
            w.writerow(["step:" + row["hook"] + (":after_backward" if row["after_backward"] else ":overlap"),
                        row["batch"], row["step_seconds"], row["forward_backward_seconds"], row["compute_seconds"]])
        for row in r["open_mpi"]["rows"]:
            w.writerow(["open_mpi", row["bytes"], row["mpi_seconds"], row["mpi_busbw"], row["ddp_mpi_busbw"]])

    md = ["# Benchmarks over a rate-limited link: 2 simulated hosts", ""]
    md += [f"Two hosts made by `tests/support/multihost.sh` (network, PID, IPC, UTS and mount namespaces each; a "
           f"bridge; `tc tbf rate {r['rate']}` on each host's outgoing traffic), on the shared 2-core VM (load "
           f"average {r['load_average']:.1f} at the start: other builds ran), {r['date']}. Every figure is the median "
           f"of {r['reps']} runs (the variants compared alternate run by run); ddp-launch `--bind none` (both hosts "
           "share the same 2 cores).", ""]
    md += ["Reproduce (as root): `cmake --build build --target ddp-launch ddp_link_bench ddp_bench_mpi && "
           "bench/multihost/run_link.py build`", ""]
    md += ["![link](../img/multihost_link.png)", ""]
    md += targets(r, link)
    md += ["## The link", "",
           "A plain TCP transfer of 128 MiB (`bench/multihost/link_rate.py`), payload bytes per second:", "",
           "| direction | rate |", "|---|---:|",
           f"| one way | {link / 1e6:.1f} MB/s ({link * 8 / 1e9:.3f} Gbit/s) |",
           f"| both ways at once (each) | {r['link']['both'] / 1e6:.1f} MB/s |", "",
           "Ratios below are against the one-way rate.", ""]
    md += ["## all_reduce busbw (f32 sum; busbw = bytes·2(N−1)/N / time)", "",
           "| size | 2×2 time ms | 2×2 busbw MB/s | 2×2 / link | 2×1 time ms | 2×1 busbw MB/s | 2×1 / link "
           "| Open MPI 2×2 busbw MB/s | Open MPI / link |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mpi = {row["bytes"]: row for row in r["open_mpi"]["rows"]}
    for a, b in zip(r["allreduce_2x2"], r["allreduce_2x1"]):
        m = mpi.get(a["bytes"])
        mcol = f"{m['mpi_busbw'] / 1e6:.1f} | {m['mpi_busbw'] / link:.2f}" if m else "– | –"
        md.append(f"| {human(a['bytes'])} | {a['seconds'] * 1e3:.1f} | {a['busbw'] / 1e6:.1f} | {a['busbw'] / link:.2f} "
                  f"| {b['seconds'] * 1e3:.1f} | {b['busbw'] / 1e6:.1f} | {b['busbw'] / link:.2f} | {mcol} |")
    md.append("")
    md += ["## Bytes across the link per step, by sharding policy (2 hosts × 2 ranks)", "",
           "Each host's first rank reads eth0's `tx_bytes` (`/sys/class/net/eth0/statistics`) after a barrier, runs "
           "10 steps (after one warm-up step; the rendezvous and the construction are before it), and reads it after a "
           "barrier: all bytes the host put on the link, TCP/IP and Ethernet headers and ACKs included. Model: the "
           "naive MLP of 8 layers 1024×1024 (Ψ = parameter bytes). Theory, per host: the ring over ranks 0..3 crosses "
           "the link on one edge per host, which carries what one rank sends: all_reduce 2Ψ(N−1)/N, reduce_scatter "
           "and all_gather Ψ(N−1)/N each (N = 4): replicate 1.5Ψ, shard_grad_op 1.5Ψ (reduce-scatter + all-gather), "
           "full_shard 2.25Ψ (two all-gathers + reduce-scatter); hybrid<full_shard> with a shard group per host: the "
           "all-reduce of each rank's Ψ/2 shard with its counterpart on the other host, 2Ψ(R−1)/R = Ψ per host (R = "
           "2 hosts), the all-gathers and reduce-scatters inside the host.", "",
           "| policy | host (rank) | Ψ MB | link bytes/step MB | theory MB | link / theory − 1 | payload/step of that rank MB |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["policies"]:
        md.append(f"| {row['policy']} | {row['rank'] // 2} ({row['rank']}) | {row['psi_bytes'] / 1e6:.2f} | "
                  f"{row['link_bytes_per_step'] / 1e6:.3f} | {row['theory_bytes'] / 1e6:.3f} | "
                  f"{(row['link_bytes_per_step'] / row['theory_bytes'] - 1) * 100:+.2f} % | "
                  f"{row['rank_payload_per_step'] / 1e6:.3f} |")
    md.append("")
    st = {(s["hook"], s["after_backward"], s["batch"]): s for s in r["steps"]}
    md += ["## Step time: the bf16 hook and the overlap (2 hosts × 1 rank, replicate, SGD momentum)", "",
           "Same naive MLP (Ψ = 33.6 MB: 0.28 s of link time per all-reduce). \"overlap\": 4 MiB buckets (the first "
           "1 MiB), each launched as soon as the backward has produced its gradients; \"after backward\": "
           "`ddp::bucket_bytes<1 GiB, 1 GiB>`, one bucket larger than the model, whose all-reduce the last "
           "gradient of the backward launches, so nothing overlaps (ddp needs no other knob for it). compute = "
           "forward + backward under `no_sync()` (no communication); fwd+bwd = the same inside a step (bucket "
           "launches included, the communication running beside it); step = the slowest rank's whole step.", "",
           "| variant | batch | buckets | step ms | fwd+bwd ms | compute ms | each run's step ms |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for s in r["steps"]:
        name = f"{s['hook']} hook, " + ("after backward" if s["after_backward"] else "overlap")
        md.append(f"| {name} | {s['batch']} | {s['buckets']} | {s['step_seconds'] * 1e3:.0f} | "
                  f"{s['forward_backward_seconds'] * 1e3:.0f} | {s['compute_seconds'] * 1e3:.0f} | "
                  + ", ".join(f"{t * 1e3:.0f}" for t in s["step_seconds_all"]) + " |")
    md.append("")
    ob, hb = r["steps"][0]["batch"], r["steps"][-1]["batch"]
    overlap, after = st[("plain", False, ob)], st[("plain", True, ob)]
    plain, bf16 = st[("plain", False, hb)], st[("bf16", False, hb)]
    gain = 1 - overlap["step_seconds"] / after["step_seconds"]
    md += [f"- Overlap gain at batch {ob}: 1 − overlap / after-backward = **{gain * 100:.1f} %** "
           f"({after['step_seconds'] * 1e3:.0f} → {overlap['step_seconds'] * 1e3:.0f} ms).",
           f"- bf16 hook at batch {hb} (link-bound): plain / bf16 = **{plain['step_seconds'] / bf16['step_seconds']:.2f}×**"
           f" ({plain['step_seconds'] * 1e3:.0f} → {bf16['step_seconds'] * 1e3:.0f} ms).", ""]
    om = r["open_mpi"]
    md += ["## Open MPI across the same hosts", ""]
    if om["rows"]:
        md += ["The hosts have no sshd, so mpirun starts its daemon on host 1 through `bench/multihost/ns_rsh.py` "
               "(`--mca plm_rsh_agent`: a one-connection remote shell listening on host 1's address). "
               "`mpi_yield_when_idle 1` because 4 polling ranks on 2 cores otherwise starve each other "
               "(10× slower without it here). Shared memory (vader) inside a host, TCP on eth0 between hosts:", "",
               f"`{om['command']}`", "",
               "| size | MPI_Allreduce ms | busbw MB/s | / link | ddp::mpi over it, busbw MB/s | ddp::tcp busbw MB/s (2×2) | ddp::tcp / Open MPI |",
               "|---:|---:|---:|---:|---:|---:|---:|"]
        ddp = {a["bytes"]: a for a in r["allreduce_2x2"]}
        for row in om["rows"]:
            d = ddp[row["bytes"]]
            md.append(f"| {human(row['bytes'])} | {row['mpi_seconds'] * 1e3:.1f} | {row['mpi_busbw'] / 1e6:.1f} | "
                      f"{row['mpi_busbw'] / link:.2f} | {row['ddp_mpi_busbw'] / 1e6:.1f} | {d['busbw'] / 1e6:.1f} | "
                      f"{d['busbw'] / row['mpi_busbw']:.2f}× |")
    else:
        md += ["Open MPI did not run: " + om.get("error", "")[:500]]
    md.append("")
    with open(os.path.join(docs, "multihost_link.md"), "w") as f:
        f.write("\n".join(md))

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    sizes = [a["bytes"] for a in r["allreduce_2x2"]]
    axes[0].plot(sizes, [a["busbw"] / 1e6 for a in r["allreduce_2x2"]], "o-", label="ddp::tcp 2 hosts × 2 ranks")
    axes[0].plot(sizes, [a["busbw"] / 1e6 for a in r["allreduce_2x1"]], "s-", label="ddp::tcp 2 hosts × 1 rank")
    if om["rows"]:
        axes[0].plot([m["bytes"] for m in om["rows"]], [m["mpi_busbw"] / 1e6 for m in om["rows"]], "^--",
                     label="Open MPI 2 × 2")
    axes[0].axhline(link / 1e6, color="gray", ls=":", label="link (plain TCP)")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("bytes")
    axes[0].set_title("all_reduce busbw (MB/s)")
    axes[0].legend(fontsize=8)
    names = [row["policy"] for row in r["policies"] if row["rank"] == 0]
    measured = [row["link_bytes_per_step"] / row["psi_bytes"] for row in r["policies"] if row["rank"] == 0]
    theory = [row["theory_bytes"] / row["psi_bytes"] for row in r["policies"] if row["rank"] == 0]
    x = range(len(names))
    axes[1].bar([i - 0.2 for i in x], measured, 0.4, label="measured (eth0)")
    axes[1].bar([i + 0.2 for i in x], theory, 0.4, label="theory")
    axes[1].set_xticks(list(x), names, fontsize=8)
    axes[1].set_title("bytes across the link per step per host (× Ψ)")
    axes[1].legend(fontsize=8)
    labels = [f"{s['hook']}\n{'after bwd' if s['after_backward'] else 'overlap'}\nbatch {s['batch']}" for s in r["steps"]]
    axes[2].bar(range(len(labels)), [s["step_seconds"] * 1e3 for s in r["steps"]], label="step")
    axes[2].bar(range(len(labels)), [s["compute_seconds"] * 1e3 for s in r["steps"]], 0.4, label="compute alone")
    axes[2].set_xticks(range(len(labels)), labels, fontsize=8)
    axes[2].set_title("step time (ms), 2 hosts × 1 rank")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    img = os.path.join(ROOT, "docs", "img", "multihost_link.png")
    fig.savefig(img, dpi=90)
    print("wrote docs/bench/multihost_link.md, .csv, .json and", img)


if __name__ == "__main__":
    sys.exit(main())
