"""The run view in a real browser: Debian's headless chromium opens the page of a replayed
incident run on a real gradwatchd, with no console error; the charts hold the replayed data (read
back from the DOM the page built); an alert's generatorURL opens the same page; a mouse drag zooms
to a step range at full resolution and a button goes back; a page left open follows a live run
as steps arrive, its alert timeline showing the page fire and resolve; screenshots are saved under
GRADWATCH_TEST_OUTPUT (default: test-output/ in the working directory).

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_TEST_TIME_SCALE, GRADWATCH_TEST_OUTPUT.
"""

import html.parser
import json
import os
import random
import shutil
import subprocess
import tempfile
import unittest
import urllib.parse

from browser import Browser
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
        # The what-if of weight decay on the final norm, drawn from its last step on.
        self.assertTrue(dom.find("line", **{"class": "projection"}), "the what-if's path")
        text = " ".join(dom.text)
        self.assertIn("Norm of final_norm.weight", text)
        self.assertIn("switched to near-dropless EP routing", text)
        self.assertIn("Recommendation: enable weight decay on final_norm.weight", text)
        self.assertIn("Dotted: the what-if of weight decay 0.1 from step", text)
        bars = [a for a in dom.find("rect") if "data-value" in a]
        self.assertTrue(bars, "shares and amplification bars")

        for name, url in (("runs", f"{self.base}/runs/"), ("run", link)):
            path = os.path.join(self.out, f"{name}.png")
            _, console = self.browse(url, screenshot=path)
            self.assertEqual(console, [])
            self.assertGreater(os.path.getsize(path), 10000, path)

    def open_page(self, url):
        """A Browser showing url once the page has rendered."""
        browser = Browser(self.chromium, self.dir)
        self.addCleanup(browser.close)
        browser.navigate(url)
        browser.wait_for("window.gradwatch && window.gradwatch.renders >= 1", 60, "the page's first render")
        return browser

    def test_a_drag_zooms_to_a_step_range_at_full_resolution_and_the_button_goes_back(self):
        page = self.open_page(f"{self.base}/runs/{RUN}")
        whole = page.evaluate("window.gradwatch.series['grad/norm/total'].map(p => [p.step, p.last, p.count])")
        self.assertEqual(len(whole), 1000, "the whole run in the page's budget of 1,000 points")
        self.assertTrue(any(count > 1 for _, _, count in whole), "points covering several steps (min-max bands)")
        renders = page.evaluate("window.gradwatch.renders")
        # The plot area of the total grad norm chart, in CSS pixels: drag across its middle fifth.
        left, top, width, height, x0, x1 = page.evaluate(
            "(() => { const svg = document.querySelector('svg[data-chart=total]'), r = svg.getBoundingClientRect();"
            " return [r.left, r.top, r.width, r.height, Number(svg.dataset.x0), Number(svg.dataset.x1)]; })()")
        scale = width / 640  # the chart's viewBox is 640 wide with 62 px left of the plot and 16 right
        plot_left, plot_width = left + 62 * scale, (640 - 62 - 16) * scale
        page.drag(plot_left + 0.4 * plot_width, top + height / 2, plot_left + 0.6 * plot_width)
        page.wait_for(f"window.gradwatch.range !== null && window.gradwatch.renders > {renders}", 60, "the zoom")
        lo, hi = page.evaluate("window.gradwatch.range")
        # The axis spans the data and, cut at half its span beyond, the forecast.
        self.assertEqual(x0, whole[0][0])
        self.assertGreaterEqual(x1, whole[-1][1])
        self.assertAlmostEqual(lo, x0 + 0.4 * (x1 - x0), delta=0.02 * (x1 - x0))
        self.assertAlmostEqual(hi, x0 + 0.6 * (x1 - x0), delta=0.02 * (x1 - x0))
        zoomed = page.evaluate("window.gradwatch.series['grad/norm/total'].map(p => [p.step, p.count])")
        self.assertTrue(zoomed)
        self.assertTrue(all(lo - 1 <= step <= hi + 1 for step, _ in zoomed), (lo, hi, zoomed[:3], zoomed[-3:]))
        # Full resolution: every step the daemon keeps in that range is one point.
        kept = get_json(f"{self.base}/api/v1/runs/{RUN}/series?key=grad%2Fnorm%2Ftotal&from={int(lo)}&to={int(hi) + 1}"
                        "&max_points=100000")["points"]
        self.assertEqual([int(p["step"]) for p in kept], [step for step, _ in zoomed])
        self.assertTrue(all(count == 1 for _, count in zoomed))
        self.assertIn("zoomed to steps", page.evaluate("document.querySelector('.toolbar').textContent"))
        # Both step charts follow the range.
        final = page.evaluate("Object.keys(window.gradwatch.series).find(k => k.startsWith('params/norm/'))")
        steps = page.evaluate(f"window.gradwatch.series[{json.dumps(final)}].map(p => p.step)")
        self.assertTrue(steps and all(lo - 1 <= step <= hi + 1 for step in steps))
        page.screenshot(os.path.join(self.out, "run-zoomed.png"))

        renders = page.evaluate("window.gradwatch.renders")
        x, y = page.evaluate("(() => { const r = document.getElementById('reset-zoom').getBoundingClientRect();"
                             " return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        page.click(x, y)
        page.wait_for(f"window.gradwatch.range === null && window.gradwatch.renders > {renders}", 60, "the whole run again")
        self.assertEqual(page.evaluate("window.gradwatch.series['grad/norm/total'].length"), 1000)
        self.assertEqual(page.console, [], "console messages")

    def write_steps(self, path, steps, total_at):
        rng = random.Random(7)
        with open(path, "w") as f:
            for step in steps:
                f.write(json.dumps({"_step": step, "grad/norm/total": total_at(step) + rng.gauss(0, 0.05),
                                    "params/norm/final_norm.weight": 78.0 + 0.05 * step,
                                    "train/loss": 2.0 - 0.001 * step}) + "\n")

    def replay(self, path, run):
        r = subprocess.run([os.environ.get("GRADWATCH_CLI_PATH", "gradwatch"), "--addr", self.grpc, "replay", path,
                            "--run", run, "--max", "--json"], capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_an_open_page_follows_a_live_run_and_its_alert_timeline_shows_a_page_fire_and_resolve(self):
        run = "live-demo"
        # Steady near 1, then (after the page is open) above 5 for 100 steps and back to 1.
        first, second = os.path.join(self.dir, "first.jsonl"), os.path.join(self.dir, "second.jsonl")
        self.write_steps(first, range(1, 201), lambda step: 1.0)
        self.write_steps(second, range(201, 401), lambda step: 5.5 if step <= 300 else 1.0)
        self.replay(first, run)
        page = self.open_page(f"{self.base}/runs/{run}")
        self.assertEqual(page.evaluate("Number(window.gradwatch.summary.info.last_step)"), 200)
        self.assertEqual(page.evaluate("window.gradwatch.series['grad/norm/total'].length"), 200)
        self.assertFalse(page.evaluate("window.gradwatch.history.some(e => e.alert.name === 'GradNormContingency')"))
        renders = page.evaluate("window.gradwatch.renders")

        self.replay(second, run)  # the page is not reloaded: it polls
        page.wait_for("Number(window.gradwatch.summary.info.last_step) === 400 && "
                      "window.gradwatch.series['grad/norm/total'].length === 400 && "
                      "window.gradwatch.history.some(e => e.alert.name === 'GradNormContingency' && "
                      "e.alert.state === 'ALERT_STATE_RESOLVED')", 60, "the live steps and the resolution")
        self.assertGreater(page.evaluate("window.gradwatch.renders"), renders)
        self.assertEqual(page.evaluate("performance.getEntriesByType('navigation').length"), 1, "no reload")
        spans = page.evaluate(
            "[...document.querySelectorAll('svg[data-chart=alerts] rect.span')].map(r => "
            "[r.dataset.state, Number(r.dataset.from), Number(r.dataset.to), r.dataset.fingerprint])")
        page_fp = page.evaluate("window.gradwatch.history.find(e => e.alert.name === 'GradNormContingency').alert.fingerprint")
        mine = [(state, lo, hi) for state, lo, hi, fp in spans if fp == page_fp]
        self.assertEqual([state for state, _, _ in mine][-2:], ["pending", "firing"], spans)
        pending, firing = mine[-2], mine[-1]
        self.assertGreaterEqual(pending[1], 201)
        self.assertEqual(pending[2], firing[1])
        self.assertLess(firing[1], 300)
        self.assertGreater(firing[2], 300, "firing until it resolved after the norm fell back")
        self.assertLess(firing[2], 400, "closed at the resolution, not drawn to the last step")
        self.assertGreaterEqual(page.evaluate("document.querySelectorAll('svg[data-chart=alerts] line.resolved-tick').length"), 1)
        changes = page.evaluate("[...document.querySelectorAll('#alert-history li')].map(li => li.dataset.state)")
        self.assertIn("resolved", changes)
        self.assertIn("firing", changes)
        text = page.evaluate("document.getElementById('alert-history').textContent")
        self.assertIn("No cause can be named from the total alone", text)  # a run that sends only its total
        self.assertIn("back to", text)
        page.screenshot(os.path.join(self.out, "run-live.png"))
        self.assertEqual(page.console, [], "console messages")


if __name__ == "__main__":
    unittest.main()
