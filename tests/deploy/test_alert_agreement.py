"""End to end: a real Prometheus scrapes a real gradwatchd while a replay crosses the contingency
threshold; gradwatchd's built-in GradNormContingency and the shipped PromQL rule
(deploy/prometheus/gradwatch-rules.yml) both reach a real Alertmanager, and agree on the run and on
when the threshold was crossed.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_PROMETHEUS_PATH,
GRADWATCH_ALERTMANAGER_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

from stack import SCALE, free_port, wait_for, get_json, stop_processes

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = "e2e-contingency"
PARAMS = [
    {"name": "final_norm.weight", "numel": 6144, "kind": "norm_gain", "weight_decay": 0.0, "role": "final_norm"},
    {"name": "lm_head.weight", "numel": 1000000, "kind": "output", "weight_decay": 0.1},
    {"name": "layers.0.w1", "numel": 1000000, "kind": "mlp", "weight_decay": 0.1},
]





def rfc3339(text: str) -> float:
    """Alertmanager's timestamps (nanoseconds, 'Z') as Unix seconds."""
    text = text.replace("Z", "+00:00")
    head, _, zone = text.partition("+")
    if "." in head:
        base, frac = head.split(".")
        head = f"{base}.{frac[:6]}"
    return datetime.datetime.fromisoformat(f"{head}+{zone}").timestamp()


class BuiltInAndPrometheusRuleAgree(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-e2e-alerts-")
        self.procs = []
        self.logs = []

    def tearDown(self):
        stop_processes(self.procs, self.logs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        self.logs.append(log)
        p = subprocess.Popen(argv, stdout=log, stderr=log)
        self.procs.append(p)
        return p

    def test_both_reach_alertmanager_for_the_run_when_it_crossed(self):
        am_port = free_port()
        with open(os.path.join(self.dir, "alertmanager.yml"), "w") as f:
            f.write("route: {receiver: 'null', group_by: [alertname, run], group_wait: 1s}\n"
                    "receivers: [{name: 'null'}]\n")
        self.start("alertmanager", [os.environ.get("GRADWATCH_ALERTMANAGER_PATH", "prometheus-alertmanager"),
                                    "--config.file", os.path.join(self.dir, "alertmanager.yml"),
                                    "--storage.path", os.path.join(self.dir, "am"),
                                    "--web.listen-address", f"127.0.0.1:{am_port}", "--cluster.listen-address="])
        am = f"http://127.0.0.1:{am_port}"
        wait_for(lambda: get_json(f"{am}/api/v2/status"), 60, "Alertmanager ready")

        with open(os.path.join(self.dir, "gradwatchd.yaml"), "w") as f:
            f.write(f"alerts:\n  receivers: [{{type: alertmanager, name: am, url: '{am}'}}]\n")
        ready = os.path.join(self.dir, "ready.json")
        self.start("gradwatchd", [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config",
                                  os.path.join(self.dir, "gradwatchd.yaml"), "--listen", "127.0.0.1:0",
                                  "--metrics-listen", "127.0.0.1:0", "--data-dir", os.path.join(self.dir, "data"),
                                  "--ready-file", ready])
        wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, "gradwatchd ready")
        with open(ready) as f:
            ports = json.load(f)

        prom_port = free_port()
        with open(os.path.join(self.dir, "prometheus.yml"), "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    f"rule_files: ['{os.path.join(ROOT, 'deploy', 'prometheus', 'gradwatch-rules.yml')}']\n"
                    f"alerting: {{alertmanagers: [{{static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]}}]}}\n"
                    "scrape_configs:\n"
                    "  - job_name: gradwatch\n"
                    f"    static_configs: [{{targets: ['127.0.0.1:{ports['metrics_port']}']}}]\n")
        self.start("prometheus", [os.environ.get("GRADWATCH_PROMETHEUS_PATH", "prometheus"), "--config.file",
                                  os.path.join(self.dir, "prometheus.yml"), "--storage.tsdb.path",
                                  os.path.join(self.dir, "tsdb"), "--web.listen-address", f"127.0.0.1:{prom_port}"])
        prom = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: (lambda b: b and b["data"]["activeTargets"] and
                          b["data"]["activeTargets"][0]["health"] == "up")(get_json(f"{prom}/api/v1/targets")),
                 60, "Prometheus scraping gradwatchd")

        # 20 s of steps at 20 a second, paced in real time: the total grad norm crosses 5 at step
        # 200, 10 s in, and stays above; the run stays active after the replay (no Goodbye).
        t0 = time.time() + 1
        history = os.path.join(self.dir, "run.jsonl")
        with open(history, "w") as f:
            f.write(json.dumps({"run": RUN, "params": PARAMS}) + "\n")
            for i in range(400):
                total = 1.0 + i * 0.01 if i < 200 else 5.5
                lm = total * 0.95
                f.write(json.dumps({"_step": 1000 + i, "_timestamp": round(t0 + i * 0.05, 3), "grad/norm/total": total,
                                    "grad/norm/lm_head.weight": lm, "grad/norm/final_norm.weight": 0.01,
                                    "grad/norm/layers.0.w1": (max(total * total - lm * lm - 1e-4, 0)) ** 0.5,
                                    # the incident's evidence: 4.3x its init norm sqrt(6144) = 78.4, still rising
                                    "params/norm/final_norm.weight": 340 + i * 0.1, "train/loss": 2.5}) + "\n")
        crossed_at = t0 + 200 * 0.05
        replay = subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr",
                                 f"127.0.0.1:{ports['grpc_port']}", "replay", history, "--speed", "1"],
                                capture_output=True, text=True, timeout=300 * SCALE)
        self.assertIn(replay.returncode, (0, 3), replay.stdout + replay.stderr)

        def contingency():
            alerts = get_json(f"{am}/api/v2/alerts?" + urllib.parse.urlencode(
                {"filter": ['alertname="GradNormContingency"', f'run="{RUN}"']}, doseq=True)) or []
            prom_side = [a for a in alerts if "instance" in a["labels"]]
            daemon_side = [a for a in alerts if "instance" not in a["labels"]]
            return (prom_side[0], daemon_side[0]) if prom_side and daemon_side else None

        # The shipped rule waits `for: 1m` after it first sees the crossing.
        from_prometheus, from_daemon = wait_for(contingency, 180, "both GradNormContingency alerts in Alertmanager")
        for alert in (from_prometheus, from_daemon):
            self.assertEqual(alert["labels"]["run"], RUN)
            self.assertEqual(alert["labels"]["severity"], "page")
            self.assertEqual(alert["status"]["state"], "active")
        self.assertEqual(from_prometheus["labels"]["job"], "gradwatch")

        # When. The daemon dates its alert from the step that crossed (that step's wall time: its
        # for_steps count from there). Prometheus sends its alert when it fires, `for: 1m` after
        # the first evaluation that saw a scrape above 5 (its activeAt, 1 s scrapes and rules).
        daemon_start = rfc3339(from_daemon["startsAt"])
        self.assertLess(abs(daemon_start - crossed_at), 1.0 * SCALE,
                        f"daemon's startsAt {daemon_start} against the crossing at {crossed_at}")
        rule_alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
        active = [a for a in rule_alerts if a["labels"]["alertname"] == "GradNormContingency"
                  and a["labels"]["run"] == RUN]
        self.assertEqual(len(active), 1)
        active_at = rfc3339(active[0]["activeAt"])
        self.assertGreaterEqual(active_at, crossed_at - 1.0)
        self.assertLess(active_at - crossed_at, 5.0 * SCALE, f"Prometheus saw it cross at {active_at}, not {crossed_at}")
        prom_start = rfc3339(from_prometheus["startsAt"])
        self.assertGreaterEqual(prom_start - active_at, 60 - 1.0)
        self.assertLess(prom_start - active_at, 60 + 5.0 * SCALE)
        # The two agree on the crossing to within Prometheus's scrape and evaluation intervals.
        self.assertLess(abs(active_at - daemon_start), 5.0 * SCALE)

        # Both carry the recommendation: weight decay on final_norm (the daemon's from the evidence: the final norm
        # grown without decay, the lm_head at 90%).
        for alert in (from_prometheus, from_daemon):
            text = json.dumps(alert["annotations"])
            self.assertIn("final_norm", text)
            self.assertIn("weight decay", text)
        self.assertEqual(from_daemon["annotations"]["cause"], "norm_gain_inflates_output")
        self.assertEqual(from_daemon["annotations"]["remediation_supported"], "true")


if __name__ == "__main__":
    unittest.main()
