"""deploy/grafana/gradwatch-run.json: its structure, and every query it makes answered with data by a
real Prometheus that scrapes a real gradwatchd holding a replayed incident-shaped run.

Grafana is not on these machines: the test checks what Grafana would send (each panel's and
annotation's PromQL with $run set, and the run variable's label_values) against Debian's
prometheus. Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_PROMETHEUS_PATH,
GRADWATCH_TEST_TIME_SCALE.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.parse
import urllib.request

from stack import SCALE, start_prometheus, stop_processes, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "gradwatch-run.json")
RUN = "moe-incident-demo"




def queries(dashboard: dict):
    """(where, PromQL) for every query the dashboard makes, with $run and the datasource set."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} target {target['refId']}", target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        out.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return [(where, expr.replace("$run", RUN)) for where, expr in out]


class DashboardStructure(unittest.TestCase):
    def setUp(self):
        with open(DASHBOARD) as f:
            self.dash = json.load(f)

    def test_importable_shape(self):
        d = self.dash
        self.assertEqual(d["uid"], "gradwatch-run")
        self.assertTrue(d["title"])
        self.assertIsInstance(d["schemaVersion"], int)
        variables = {v["name"]: v for v in d["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        self.assertEqual(variables["run"]["type"], "query")
        self.assertEqual(variables["run"]["definition"], "label_values(gradwatch_last_step, run)")
        ids = [p["id"] for p in d["panels"]]
        self.assertEqual(len(ids), len(set(ids)), "panel ids are unique")
        for p in d["panels"]:
            with self.subTest(panel=p["title"]):
                self.assertIn(p["type"], {"timeseries", "table", "stat"})
                self.assertEqual(p["datasource"]["uid"], "${datasource}")
                self.assertTrue({"x", "y", "w", "h"} <= set(p["gridPos"]))
                self.assertLessEqual(p["gridPos"]["x"] + p["gridPos"]["w"], 24)
                self.assertTrue(p["targets"])
                for t in p["targets"]:
                    if t["expr"].startswith("gradwatch_rule_bound{"):
                        continue  # the rules are the daemon's, not a run's
                    self.assertIn('run="$run"', t["expr"])
        for a in d["annotations"]["list"]:
            self.assertIn('run="$run"', a["expr"])

    def test_panels_the_issue_asks_for(self):
        exprs = " ".join(t["expr"] for p in self.dash["panels"] for t in p["targets"])
        for metric in ["gradwatch_total_grad_norm", "gradwatch_rule_bound", "gradwatch_param_norm", "gradwatch_slope_per_kstep",
                       "gradwatch_norm_amplification", "gradwatch_group_grad_norm_share", "gradwatch_slope_change_ratio",
                       "gradwatch_steps_to_threshold", "gradwatch_alerts"]:
            self.assertIn(metric, exprs)
        total = next(p for p in self.dash["panels"] if "gradwatch_total_grad_norm" in p["targets"][0]["expr"])
        drawn = [t["expr"] for t in total["targets"]]
        self.assertIn('gradwatch_rule_bound{kind="threshold", series="grad/norm/total", severity="page", bound="value"}',
                      drawn, "the page rule's own threshold is drawn on the total grad norm")
        # The learning rate is orders of magnitude below the loss: on the loss's axis it draws flat.
        loss = next(p for p in self.dash["panels"] if any("gradwatch_loss" in t["expr"] for t in p["targets"]))
        rate = next(t for t in loss["targets"] if "gradwatch_learning_rate" in t["expr"])
        own_axis = [o for o in loss["fieldConfig"]["overrides"]
                    if o["matcher"] == {"id": "byFrameRefID", "options": rate["refId"]}]
        self.assertEqual(len(own_axis), 1, "the learning rate has an override of its own")
        self.assertIn({"id": "custom.axisPlacement", "value": "right"}, own_axis[0]["properties"])
        for p in self.dash["panels"]:
            with self.subTest(panel=p["title"]):
                steps = p.get("fieldConfig", {}).get("defaults", {}).get("thresholds", {}).get("steps", [])
                self.assertEqual([s["value"] for s in steps if s["value"] is not None], [],
                                 "no literal bound: an override would leave it behind")


class DashboardAgainstPrometheus(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gradwatch-grafana-")
        cls.procs = []
        cls.logs = []
        try:
            cls._start()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def _start(cls):
        ready = os.path.join(cls.dir, "ready.json")
        daemon_log = open(os.path.join(cls.dir, "gradwatchd.log"), "w")
        cls.logs.append(daemon_log)
        cls.procs.append(subprocess.Popen(
            [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config", os.path.join(ROOT, "deploy", "gradwatchd.yaml"),
             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--data-dir", os.path.join(cls.dir, "data"),
             "--ready-file", ready], stdout=daemon_log, stderr=daemon_log))
        wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 30, "gradwatchd's ready file")
        with open(ready) as f:
            ports = json.load(f)
        history = os.path.join(cls.dir, "run.jsonl")
        subprocess.run([sys.executable, os.path.join(ROOT, "deploy", "examples", "make_incident_run.py"), "--out", history,
                        "--from-step", "50000", "--to-step", "110000", "--every", "50"], check=True)
        replay = subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr",
                                 f"127.0.0.1:{ports['grpc_port']}", "replay", history, "--max"],
                                capture_output=True, text=True, timeout=600 * SCALE)
        if replay.returncode != 0:
            raise AssertionError(f"replay failed ({replay.returncode}): {replay.stdout}{replay.stderr}")

        process, prom_log, prom_port = start_prometheus(
            cls.dir,
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: gradwatch\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{ports['metrics_port']}']}}]\n")
        cls.procs.append(process)
        cls.logs.append(prom_log)
        cls.prometheus = f"http://127.0.0.1:{prom_port}"
        wait_for(lambda: len(cls.query(f'count_over_time(gradwatch_last_step{{run="{RUN}"}}[1m])')) == 1
                 and float(cls.query(f'count_over_time(gradwatch_last_step{{run="{RUN}"}}[1m])')[0]["value"][1]) >= 3,
                 120, "three scrapes of the replayed run")

    @classmethod
    def tearDownClass(cls):
        stop_processes(cls.procs, cls.logs)
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def api(cls, path: str, params) -> dict:
        url = f"{cls.prometheus}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except OSError:
            return {"status": "unreachable", "data": {"result": []}}
        return body

    @classmethod
    def query(cls, expr: str) -> list:
        body = cls.api("/api/v1/query", {"query": expr})
        return body["data"]["result"] if body.get("status") == "success" else []

    def test_run_variable_lists_the_run(self):
        body = self.api("/api/v1/label/run/values", {"match[]": "gradwatch_last_step"})
        self.assertEqual(body["status"], "success")
        self.assertIn(RUN, body["data"])

    def test_the_drawn_threshold_is_the_rules(self):
        page = self.query('gradwatch_rule_bound{kind="threshold", series="grad/norm/total", severity="page", bound="value"}')
        self.assertEqual([(r["metric"]["alertname"], r["metric"]["op"], float(r["value"][1])) for r in page],
                         [("GradNormContingency", ">=", 5.0)])

    def test_every_query_returns_data(self):
        with open(DASHBOARD) as f:
            dash = json.load(f)
        for where, expr in queries(dash):
            with self.subTest(where=where):
                body = self.api("/api/v1/query", {"query": expr})
                self.assertEqual(body.get("status"), "success", f"{where}: {expr}: {body}")
                self.assertTrue(body["data"]["result"], f"{where}: {expr} returned no data")


if __name__ == "__main__":
    unittest.main()
