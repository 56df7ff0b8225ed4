"""High availability on existing engines: two gradwatchd replicas watch one run (the CLI sends every
step to both: --addr a,b) and page through two prometheus-alertmanager instances clustered on
loopback. The receiver gets one page while both replicas fire, and the page still arrives with one
replica and one Alertmanager killed.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_ALERTMANAGER_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.request

from stack import SCALE, free_port, wait_for, stop_processes

PARAMS = [
    {"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain", "weight_decay": 0.0, "role": "final_norm"},
    {"name": "lm_head.weight", "numel": 1000000, "kind": "output", "weight_decay": 0.1},
]




class Receiver:
    """The pager: records every Alertmanager webhook notification."""

    def __init__(self):
        self.notifications = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with outer.lock:
                    outer.notifications.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def pages(self, run: str):
        """Firing GradNormContingency notifications for the run."""
        with self.lock:
            return [n for n in self.notifications
                    if n["status"] == "firing" and n["commonLabels"].get("alertname") == "GradNormContingency"
                    and n["commonLabels"].get("run") == run]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def write_run(path: str, run: str):
    """60 steps; the total grad norm is 5.5 from step 20 on (the built-in rule fires after 10)."""
    with open(path, "w") as f:
        f.write(json.dumps({"run": run, "params": PARAMS}) + "\n")
        t0 = time.time() - 60
        for i in range(60):
            total = 1.0 if i < 20 else 5.5
            f.write(json.dumps({"_step": i + 1, "_timestamp": round(t0 + i, 3), "grad/norm/total": total,
                                "grad/norm/lm_head.weight": total * 0.99, "grad/norm/final_norm.weight": 0.01,
                                "params/norm/final_norm.weight": 80 + i}) + "\n")


class TwoReplicasTwoAlertmanagers(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-fleet-ha-")
        self.procs = {}
        self.logs = []
        self.receiver = Receiver()

    def tearDown(self):
        stop_processes(self.procs.values(), self.logs)
        self.receiver.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=log)

    def kill(self, name):
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def replay(self, addresses, path):
        return subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr", ",".join(addresses),
                               "--timeout", str(5 * SCALE), "replay", path, "--max", "--stall-timeout",
                               str(10 * SCALE)],
                              capture_output=True, text=True, timeout=300 * SCALE)

    def firing_on(self, metrics_port, run):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return False
        return any(line.startswith("gradwatch_alerts{") and 'alertname="GradNormContingency"' in line
                   and 'alertstate="firing"' in line and f'run="{run}"' in line for line in text.splitlines())

    def test_one_page_from_two_replicas_and_still_a_page_after_losing_one_of_each(self):
        am_ports = [free_port(), free_port()]
        cluster_ports = [free_port(), free_port()]
        with open(os.path.join(self.dir, "alertmanager.yml"), "w") as f:
            f.write("route: {receiver: pager, group_by: [alertname, run], group_wait: 1s, group_interval: 1m, "
                    "repeat_interval: 1h}\n"
                    f"receivers: [{{name: pager, webhook_configs: [{{url: 'http://127.0.0.1:{self.receiver.port}/'}}]}}]\n")
        for i in range(2):
            self.start(f"am{i}", [os.environ.get("GRADWATCH_ALERTMANAGER_PATH", "prometheus-alertmanager"),
                                  "--config.file", os.path.join(self.dir, "alertmanager.yml"),
                                  "--storage.path", os.path.join(self.dir, f"am{i}"),
                                  "--web.listen-address", f"127.0.0.1:{am_ports[i]}",
                                  "--cluster.listen-address", f"127.0.0.1:{cluster_ports[i]}",
                                  "--cluster.peer", f"127.0.0.1:{cluster_ports[1 - i]}",
                                  "--cluster.peer-timeout", "3s"])

        def cluster_formed():
            for port in am_ports:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/status", timeout=5) as r:
                        status = json.load(r)
                except OSError:
                    return False
                if len(status["cluster"].get("peers") or []) != 2:
                    return False
            return True

        wait_for(cluster_formed, 60, "the two Alertmanagers to form a cluster")

        with open(os.path.join(self.dir, "gradwatchd.yaml"), "w") as f:
            f.write("alerts:\n  receivers:\n" + "".join(
                f"    - {{type: alertmanager, name: am{i}, url: 'http://127.0.0.1:{am_ports[i]}'}}\n" for i in range(2)))
        ports = []
        for i in range(2):
            ready = os.path.join(self.dir, f"ready{i}.json")
            self.start(f"gradwatchd{i}", [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config",
                                          os.path.join(self.dir, "gradwatchd.yaml"), "--listen", "127.0.0.1:0",
                                          "--metrics-listen", "127.0.0.1:0", "--data-dir",
                                          os.path.join(self.dir, f"data{i}"), "--ready-file", ready])
            wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, f"gradwatchd {i} ready")
            with open(ready) as f:
                ports.append(json.load(f))
        grpc = [f"127.0.0.1:{p['grpc_port']}" for p in ports]

        # Both replicas get every step, both fire; the cluster pages once.
        run_a = os.path.join(self.dir, "a.jsonl")
        write_run(run_a, "ha-a")
        out = self.replay(grpc, run_a)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        for address in grpc:
            self.assertIn(f"daemon {address}", out.stdout)
        self.assertEqual(out.stdout.count("last acked step  60"), 2, out.stdout)
        for p in ports:
            wait_for(lambda: self.firing_on(p["metrics_port"], "ha-a"), 60, "both replicas firing for ha-a")
        wait_for(lambda: self.receiver.pages("ha-a"), 60, "the page for ha-a")
        # Both Alertmanagers got the alert from both replicas; their gossip keeps it to one
        # notification (the second instance waits its peer timeout, 3 s, then sees it was sent).
        time.sleep(10 * SCALE)
        self.assertEqual(len(self.receiver.pages("ha-a")), 1, self.receiver.notifications)
        self.assertEqual(len(self.receiver.pages("ha-a")[0]["alerts"]), 1)

        # One replica and one Alertmanager die: a new incident still pages.
        self.kill("gradwatchd1")
        self.kill("am0")
        run_b = os.path.join(self.dir, "b.jsonl")
        write_run(run_b, "ha-b")
        out = self.replay(grpc, run_b)
        self.assertEqual(out.returncode, 3, out.stdout + out.stderr)  # one daemon holds every step
        self.assertIn(f"cannot reach the daemon at {grpc[1]}", out.stderr)
        self.assertIn("last acked step  60", out.stdout)
        wait_for(lambda: self.firing_on(ports[0]["metrics_port"], "ha-b"), 60, "the surviving replica firing for ha-b")
        wait_for(lambda: self.receiver.pages("ha-b"), 60, "the page for ha-b through the surviving Alertmanager")
        self.assertEqual(len(self.receiver.pages("ha-b")), 1)


if __name__ == "__main__":
    unittest.main()
