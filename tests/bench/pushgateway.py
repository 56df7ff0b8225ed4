#!/usr/bin/python3
"""The Pushgateway side of tests/bench/run.sh.

For each workload RUNSxRANKSxPARAMS:STEPS, starts Debian's prometheus-pushgateway and a real
prometheus scraping it every second (loopback, free ports, temporary directories), pushes one PUT
per rank per step (text format: grad and param norm of every parameter, the total grad norm, and
gradwatch_bench_step whose value is the step), at most --time-limit seconds per workload, and measures the Pushgateway's CPU from
/proc/PID/stat. Then it asks Prometheus for every raw sample of gradwatch_bench_step and counts the
distinct steps of each (run, rank): the share of steps that ever reached Prometheus.

Usage: pushgateway.py --json FILE [--time-limit SECONDS] RUNSxRANKSxPARAMS:STEPS...
Progress goes to stderr; the figures to FILE as JSON.
"""
import argparse
import calendar
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

READY_TIMEOUT_S = 60


def log(text):
    print(f"[pushgateway] {text}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(port, path, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_ready(proc, port, name):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready")
        try:
            if get(port, "/-/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{name} not ready within {READY_TIMEOUT_S} s")


def query(port, promql):
    status, body = get(port, "/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=120)
    if status != 200:
        raise RuntimeError(f"prometheus query {promql!r}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)["data"]["result"]


def scrape_after(port, t):
    """Prometheus's last scrape of the Pushgateway if it began after wall time t, else None."""
    status, body = get(port, "/api/v1/targets")
    if status != 200:
        return None
    for target in json.loads(body)["data"]["activeTargets"]:
        # RFC 3339 in UTC with nanoseconds; the seconds part is enough here.
        stamp = target.get("lastScrape", "")[:19]
        if stamp.startswith("0001") or not stamp:
            continue
        if calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")) > t + 1:
            return target
    return None


def run_workload(runs, ranks, params, steps, workdir, time_limit):
    pgw_port, prom_port = free_port(), free_port()
    pgw_dir = os.path.join(workdir, "pgw")
    prom_dir = os.path.join(workdir, "prom")
    os.makedirs(pgw_dir)
    os.makedirs(prom_dir)
    config = os.path.join(prom_dir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
                "scrape_configs:\n"
                "  - job_name: pushgateway\n"
                "    honor_labels: true\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{pgw_port}']}}]\n")
    pgw = subprocess.Popen(["prometheus-pushgateway", f"--web.listen-address=127.0.0.1:{pgw_port}",
                            f"--persistence.file={pgw_dir}/persist"],
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(pgw_dir, "log"), "w"))
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={prom_dir}/data",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(prom_dir, "log"), "w"))
    try:
        wait_ready(pgw, pgw_port, "pushgateway")
        wait_ready(prom, prom_port, "prometheus")
        # The parameters' names as gradwatch_bench's catalog gives them (a Llama-style model's).
        layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
        names = ["lm_head.weight"] + [f"model.layers.{(i - 1) // len(layer)}.{layer[(i - 1) % len(layer)]}.weight"
                                      for i in range(1, params)]
        grad_lines = [f'gradwatch_bench_grad_norm{{param="{n}"}} ' for n in names]
        param_lines = [f'gradwatch_bench_param_norm{{param="{n}"}} ' for n in names]
        conn = http.client.HTTPConnection("127.0.0.1", pgw_port, timeout=60)
        log(f"{runs}x{ranks}x{params} x {steps} steps (at most {time_limit} s)")
        cpu0, t0, wall0 = cpu_seconds(pgw.pid), time.monotonic(), time.time()
        pushes = 0  # rank-steps pushed: the pushing stops at the time limit
        for step in range(1, steps + 1):
            if time.monotonic() - t0 > time_limit:
                break
            grad = f"{0.01 + 1e-9 * (step % 97)}\n"
            param = f"{100 + 1e-4 * step}\n"
            body = ("".join(line + grad for line in grad_lines) + "".join(line + param for line in param_lines) +
                    f"gradwatch_bench_total_grad_norm {0.3 + 1e-7 * step}\ngradwatch_bench_step {step}\n").encode()
            for run in range(runs):
                for rank in range(ranks):
                    if time.monotonic() - t0 > time_limit:
                        break
                    conn.request("PUT", f"/metrics/job/trainer/run/run-{run}/rank/{rank}", body=body)
                    resp = conn.getresponse()
                    resp.read()
                    if resp.status not in (200, 202):
                        raise RuntimeError(f"push answered HTTP {resp.status}")
                    pushes += 1
        wall = time.monotonic() - t0
        if pushes < runs * ranks * steps:
            log(f"  time limit: stopped after {pushes} of {runs * ranks * steps} pushes")
        cpu = cpu_seconds(pgw.pid) - cpu0
        # Wait for one scrape (successful or not) that began after the last push, so the last step
        # had its chance. A scrape of many series can outlive the 1 s timeout: those steps never
        # reach Prometheus, which is what is measured.
        end = time.time()
        deadline = time.monotonic() + 60
        target = None
        while target is None:
            if time.monotonic() > deadline:
                raise RuntimeError("prometheus did not scrape the pushgateway after the last push")
            time.sleep(0.2)
            target = scrape_after(prom_port, end)
        window = int(time.time() - wall0) + 30
        result = query(prom_port, f"gradwatch_bench_step[{window}s]")
        seen = {(r["metric"].get("run"), r["metric"].get("rank")): len({float(v) for _, v in r["values"]})
                for r in result}
        if len(seen) > runs * ranks:
            raise RuntimeError(f"prometheus holds {len(seen)} step series, more than {runs * ranks}")
        share = sum(seen.values()) / max(pushes, 1)
        samples = pushes * (2 * params + 1)
        log(f"  {samples / max(cpu, 0.01):,.0f} samples per pushgateway CPU-second, "
            f"{100 * share:.1f}% of steps reached prometheus")
        return {"shape": f"{runs}x{ranks}x{params}", "runs": runs, "ranks": ranks, "params": params,
                "steps": steps, "pushes": pushes, "samples": samples, "wall_s": wall, "server_cpu_s": cpu,
                "samples_per_cpu_s": samples / max(cpu, 0.01), "pushes_per_s": pushes / wall,
                "steps_in_prometheus": sum(seen.values()), "share_in_prometheus": share,
                "last_scrape_health": target.get("health"), "last_scrape_error": target.get("lastError", "")}
    finally:
        for proc in (prom, pgw):
            proc.terminate()
        for proc in (prom, pgw):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--time-limit", type=float, default=120,
                        help="seconds of pushing per workload; it stops after the push under way")
    parser.add_argument("workloads", nargs="+", help="RUNSxRANKSxPARAMS:STEPS")
    args = parser.parse_args()
    # SIGTERM unwinds, so the finally blocks stop the Pushgateway and Prometheus.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = []
    for spec in args.workloads:
        shape, steps = spec.split(":")
        runs, ranks, params = (int(x) for x in shape.split("x"))
        workdir = tempfile.mkdtemp(prefix="gradwatch-bench-pgw-")
        try:
            rows.append(run_workload(runs, ranks, params, int(steps), workdir, args.time_limit))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump({"pushgateway": rows}, f, indent=2)


if __name__ == "__main__":
    main()
