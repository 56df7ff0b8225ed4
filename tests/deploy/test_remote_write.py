"""remote_write against Debian's real prometheus (--web.enable-remote-write-receiver): every step of a
run reaches the TSDB with its wall time, and a receiver outage, a clean restart and a killed daemon
lose none of them.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_PROMETHEUS_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

from stack import SCALE, free_port, wait_for, stop_processes

PARAMS = [
    {"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain", "weight_decay": 0.0},
    {"name": "lm_head.weight", "numel": 1000000, "kind": "output", "weight_decay": 0.1},
]




def write_run(path: str, run: str, steps: int, t0: float):
    """A JSONL run of `steps` steps, 0.25 s apart from t0; returns {timestamp ms: total grad norm}."""
    sent = {}
    with open(path, "w") as f:
        f.write(json.dumps({"run": run, "params": PARAMS}) + "\n")
        for i in range(steps):
            wall = round(t0 + i * 0.25, 3)
            total = round(0.5 + i * 0.001, 6)
            sent[int(round(wall * 1000))] = total
            f.write(json.dumps({"_step": 100 + i, "_timestamp": wall, "grad/norm/total": total, "train/loss": 2.5,
                                "grad/norm/final_norm.weight": 0.01, "grad/norm/lm_head.weight": 0.4,
                                "params/norm/final_norm.weight": 80 + i * 0.01}) + "\n")
    return sent


class Stack:
    """A gradwatchd with one remote-write receiver, and the Prometheus that receives."""

    def __init__(self, directory: str):
        self.dir = directory
        self.prom_port = free_port()
        self.config = os.path.join(directory, "gradwatchd.yaml")
        with open(self.config, "w") as f:
            f.write("remote_write:\n"
                    f"  - url: http://127.0.0.1:{self.prom_port}/api/v1/write\n"
                    "    name: tsdb\n"
                    "    queue_config: {max_samples_per_send: 500}\n"
                    "    remote_timeout_seconds: 5\n")
        self.daemon = None
        self.prometheus = None
        self.logs = []
        self.ports = None

    def log(self, name: str):
        f = open(os.path.join(self.dir, name), "a")
        self.logs.append(f)
        return f

    def start_daemon(self):
        ready = os.path.join(self.dir, "ready.json")
        if os.path.exists(ready):
            os.remove(ready)
        log = self.log("gradwatchd.log")
        self.daemon = subprocess.Popen(
            [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config", self.config, "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--data-dir", os.path.join(self.dir, "data"), "--ready-file", ready],
            stdout=log, stderr=log)
        wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, "gradwatchd's ready file")
        with open(ready) as f:
            self.ports = json.load(f)

    def stop_daemon(self, sig):
        self.daemon.send_signal(sig)
        self.daemon.wait(timeout=120 * SCALE)
        self.daemon = None

    def start_prometheus(self):
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global: {scrape_interval: 15s}\n")
        log = self.log("prometheus.log")
        self.prometheus = subprocess.Popen(
            [os.environ.get("GRADWATCH_PROMETHEUS_PATH", "prometheus"), "--config.file", config,
             "--storage.tsdb.path", os.path.join(self.dir, "tsdb"), "--web.listen-address",
             f"127.0.0.1:{self.prom_port}", "--web.enable-remote-write-receiver"], stdout=log, stderr=log)
        wait_for(lambda: self.api("/-/ready") is not None, 60, "Prometheus ready")

    def api(self, path: str, params=None):
        url = f"http://127.0.0.1:{self.prom_port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read()
        except OSError:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return body

    def replay(self, path: str):
        out = subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr",
                              f"127.0.0.1:{self.ports['grpc_port']}", "replay", path, "--max"],
                             capture_output=True, text=True, timeout=300 * SCALE)
        if out.returncode != 0:
            raise AssertionError(f"replay failed ({out.returncode}): {out.stdout}{out.stderr}")

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("gradwatch_remote_write_"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0]] = float(value)
        return out

    def samples(self, run: str) -> dict:
        """Every raw sample Prometheus holds of the run's total grad norm: {timestamp ms: value}."""
        body = self.api("/api/v1/query", {"query": f'gradwatch_total_grad_norm{{run="{run}"}}[2h]',
                                          "time": f"{time.time() + 60:.3f}"})
        if not body or body.get("status") != "success" or not body["data"]["result"]:
            return {}
        return {int(round(float(t) * 1000)): float(v) for t, v in body["data"]["result"][0]["values"]}

    def close(self):
        stop_processes([self.prometheus, self.daemon], self.logs)


class RemoteWriteToPrometheus(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-remote-write-")
        self.stack = Stack(self.dir)

    def tearDown(self):
        self.stack.close()
        if os.environ.get("GRADWATCH_KEEP_TEST_DIRS"):
            print(f"logs kept in {self.dir}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def test_every_step_reaches_prometheus_with_its_wall_time(self):
        s = self.stack
        s.start_prometheus()
        s.start_daemon()
        steps = 600
        history = os.path.join(self.dir, "run.jsonl")
        sent = write_run(history, "rw-live", steps, time.time() - steps * 0.25)
        s.replay(history)
        got = wait_for(lambda: (lambda g: g if len(g) >= steps else None)(s.samples("rw-live")), 60,
                       f"{steps} samples in Prometheus")
        self.assertEqual(got, sent, "every step, at its wall time, with its value")

        # query_range at the steps' own spacing gives the N samples back at their timestamps.
        start = min(sent) / 1000
        body = s.api("/api/v1/query_range", {"query": 'gradwatch_total_grad_norm{run="rw-live"}', "start": f"{start:.3f}",
                                             "end": f"{max(sent) / 1000:.3f}", "step": "0.25"})
        values = body["data"]["result"][0]["values"]
        self.assertEqual(len(values), steps)
        self.assertEqual({int(round(float(t) * 1000)): float(v) for t, v in values}, sent)

        # The step numbers, and the other series under their /metrics names and labels.
        last = s.api("/api/v1/query", {"query": 'max_over_time(gradwatch_last_step{run="rw-live"}[2h])',
                                       "time": f"{time.time() + 60:.3f}"})
        self.assertEqual(float(last["data"]["result"][0]["value"][1]), 100 + steps - 1)
        series = s.api("/api/v1/series", {"match[]": '{run="rw-live"}', "start": f"{start - 60:.3f}"})["data"]
        self.assertIn({"__name__": "gradwatch_grad_norm", "run": "rw-live", "param": "lm_head.weight",
                       "group": "output"}, series)
        self.assertIn({"__name__": "gradwatch_param_norm", "run": "rw-live", "param": "final_norm.weight",
                       "group": "norm_gain"}, series)
        self.assertIn({"__name__": "gradwatch_loss", "run": "rw-live"}, series)
        m = wait_for(lambda: (lambda m: m if m["gradwatch_remote_write_queue_samples"] == 0 else None)(s.metrics()),
                     30, "an empty queue")
        self.assertEqual(m["gradwatch_remote_write_samples_sent_total"], steps * 6)  # 5 series and the step
        self.assertEqual(m["gradwatch_remote_write_samples_failed_total"], 0)
        self.assertEqual(m["gradwatch_remote_write_samples_dropped_total"], 0)
        self.assertEqual(m["gradwatch_remote_write_lag_seconds"], 0)

    def test_outage_clean_restart_and_kill_lose_no_step(self):
        s = self.stack
        s.start_daemon()  # the receiver is down
        steps = 200
        a = os.path.join(self.dir, "a.jsonl")
        sent_a = write_run(a, "rw-a", steps, time.time() - 120)
        s.replay(a)
        m = wait_for(lambda: (lambda m: m if m["gradwatch_remote_write_retries_total"] >= 2 else None)(s.metrics()),
                     60, "retries while the receiver is down")
        self.assertEqual(m["gradwatch_remote_write_samples_sent_total"], 0)
        self.assertGreater(m["gradwatch_remote_write_queue_samples"], 0)
        self.assertGreater(m["gradwatch_remote_write_lag_seconds"], 60)
        # A clean stop cannot deliver (its snapshot then covers steps the receiver lacks) ...
        s.stop_daemon(signal.SIGTERM)
        s.start_daemon()
        b = os.path.join(self.dir, "b.jsonl")
        sent_b = write_run(b, "rw-b", steps, time.time() - 60)
        s.replay(b)
        # ... and a killed daemon neither.
        s.stop_daemon(signal.SIGKILL)
        s.start_prometheus()
        s.start_daemon()
        got_a = wait_for(lambda: (lambda g: g if len(g) >= steps else None)(s.samples("rw-a")), 120,
                         "run rw-a in Prometheus")
        got_b = wait_for(lambda: (lambda g: g if len(g) >= steps else None)(s.samples("rw-b")), 120,
                         "run rw-b in Prometheus")
        self.assertEqual(got_a, sent_a)
        self.assertEqual(got_b, sent_b)
        m = wait_for(lambda: (lambda m: m if m["gradwatch_remote_write_queue_samples"] == 0 else None)(s.metrics()),
                     60, "an empty queue")
        self.assertEqual(m["gradwatch_remote_write_samples_failed_total"], 0)
        self.assertEqual(m["gradwatch_remote_write_samples_dropped_total"], 0)


if __name__ == "__main__":
    unittest.main()
