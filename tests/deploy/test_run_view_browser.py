"""The run view in a real browser: Debian's headless chromium opens the page of a replayed
incident run on a real gradwatchd, with no console error; the charts hold the replayed data (read
back from the DOM the page built); an alert's generatorURL opens the same page; screenshots are
saved under GRADWATCH_TEST_OUTPUT (default: test-output/ in the working directory).

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_TEST_TIME_SCALE, GRADWATCH_TEST_OUTPUT.
"""

import html.parser
import json
import os
import shutil
import subprocess
import tempfile
import unittest
import urllib.parse

from stack import free_port, get_json, stop_processes, wait_for

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUN = "moe-incident-demo"
# A closed network: nothing but the daemon on loopback.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
                  "--disable-default-apps", "--enable-logging=stderr", "--v=0"]


class Dom(html.parser.HTMLParser):
    """The elements of a dumped DOM: (tag, attributes) in document order, and the text."""

    def __init__(self, text):
        super().__init__()
        self.elements, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag, **attrs):
        return [a for t, a in self.elements
                if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


class RunViewBrowserTest(unittest.TestCase):
    def setUp(self):
        self.chromium = shutil.which("chromium")
        if not self.chromium:
            self.fail("chromium is not installed (deploy/packages-test.txt)")
        self.dir = tempfile.mkdtemp(prefix="gradwatch-browser-")
        self.out = os.path.join(os.environ.get("GRADWATCH_TEST_OUTPUT", os.path.join(os.getcwd(), "test-output")),
                                "run-view")
        os.makedirs(self.out, exist_ok=True)
        self.processes, self.logs = [], []
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = os.path.join(self.dir, "gradwatchd.yaml")
        with open(config, "w") as f:
            f.write(f"alerts: {{external_url: '{self.base}'}}\n")
        ready = os.path.join(self.dir, "ready.json")
        log = open(os.path.join(self.dir, "gradwatchd.log"), "w")
        self.logs.append(log)
        self.processes.append(subprocess.Popen(
            [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config", config, "--listen", "127.0.0.1:0",
             "--metrics-listen", f"127.0.0.1:{self.port}", "--data-dir", os.path.join(self.dir, "data"),
             "--ready-file", ready], stdout=log, stderr=log))
        wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, "gradwatchd's ready file")
        with open(ready) as f:
            self.grpc = f"127.0.0.1:{json.load(f)['grpc_port']}"
        run = os.path.join(self.dir, "incident.jsonl")
        subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "deploy", "examples", "make_incident_run.py"),
                        "--out", run], check=True, timeout=120)
        replay = subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr", self.grpc, "replay", run,
                                 "--max", "--json"], capture_output=True, text=True, timeout=300)
        self.assertEqual(replay.returncode, 0, replay.stdout + replay.stderr)

    def tearDown(self):
        stop_processes(self.processes, self.logs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def browse(self, url, screenshot=None):
        """The DOM chromium built for url once its scripts ran, and its console errors."""
        profile = tempfile.mkdtemp(dir=self.dir)
        args = [self.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000",
                "--window-size=1400,2200"]
        args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        r = subprocess.run(args + [url], capture_output=True, text=True, timeout=180)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        console = [line for line in r.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
        return r.stdout, console

    def test_the_page_shows_the_replayed_run_and_an_alert_link_opens_it(self):
        summary = get_json(f"{self.base}/api/v1/runs/{RUN}")
        steps = int(summary["info"]["step_count"])
        self.assertGreater(steps, 1000)

        dom_text, console = self.browse(f"{self.base}/runs/")
        self.assertEqual(console, [])
        dom = Dom(dom_text)
        self.assertEqual([a["data-run"] for a in dom.find("tr") if "data-run" in a], [RUN])

        # The alert's link: <external_url>/runs/<run>, as the notifications carry it.
        alerts = get_json(f"{self.base}/api/v1/alerts?run={RUN}")["alerts"]
        self.assertTrue(alerts, "the incident fired no alert")
        link = f"{self.base}/runs/{urllib.parse.quote(alerts[0]['labels']['run'], safe='')}"
        dom_text, console = self.browse(link)
        self.assertEqual(console, [], "console messages")
        dom = Dom(dom_text)
        body = dom.find("body")[0]
        self.assertGreaterEqual(int(body.get("data-renders", "0")), 1, "the page never rendered")
        self.assertNotIn("data-errors", body)
        # The total grad norm over the whole run, in the page's budget of 1,000 points (buckets
        # with min-max bands beyond it).
        series = [a for a in dom.find("path") if a.get("class") == "series"]
        self.assertEqual(len(series), 2, "total grad norm and final norm")
        self.assertEqual(int(series[0]["data-points"]), min(steps, 1000) if steps <= 1000 else 1000)
        self.assertTrue(dom.find("polygon", **{"class": "band"}) or steps <= 1000, "min-max bands")
        self.assertTrue(dom.find("line", **{"class": "threshold"}), "the threshold line")
        self.assertTrue(dom.find("line", **{"class": "fit-before"}), "the slope before the event")
        self.assertTrue(dom.find("line", **{"class": "fit-after"}), "the slope after the event")
        self.assertTrue(dom.find("line", **{"class": "event"}), "the event")
        text = " ".join(dom.text)
        self.assertIn("Norm of final_norm.weight", text)
        self.assertIn("switched to near-dropless EP routing", text)
        self.assertIn("Recommendation: enable weight decay on final_norm.weight", text)
        bars = [a for a in dom.find("rect") if "data-value" in a]
        self.assertTrue(bars, "shares and amplification bars")

        for name, url in (("runs", f"{self.base}/runs/"), ("run", link)):
            path = os.path.join(self.out, f"{name}.png")
            _, console = self.browse(url, screenshot=path)
            self.assertEqual(console, [])
            self.assertGreater(os.path.getsize(path), 10000, path)


if __name__ == "__main__":
    unittest.main()
