"""docs/configuration.md and docs/metrics.md checked against the daemon itself, so that they cannot
drift: the configuration keys and defaults against `gradwatchd --check-config`, the metric families,
types and labels against a live /metrics.

Environment: GRADWATCHD_PATH, GRADWATCH_CLI_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCALE = max(1.0, float(os.environ.get("GRADWATCH_TEST_TIME_SCALE", "1")))
DAEMON = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
CLI = os.environ.get("GRADWATCH_CLI_PATH", "gradwatch")

# One receiver of each list, so that their keys show; the URLs lead nowhere (port 9, discard).
FULL_CONFIG = """\
alerts:
  receivers: [{type: webhook, name: hook, url: 'http://127.0.0.1:9/'}]
remote_write: [{url: 'http://127.0.0.1:9/api/v1/write', name: tsdb}]
"""


def table_rows(path: str):
    """The first, second and third cells of every table row of a Markdown file whose first cell is
    `code`."""
    rows = []
    with open(path) as f:
        for line in f:
            m = re.match(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|([^|]*)\|", line)
            if m:
                rows.append((m.group(1), m.group(2).strip(), m.group(3).strip()))
    return rows


def flatten(value, prefix=""):
    """{"a.b": value}, and "a[].b" for the entries of lists of mappings; an empty mapping is a value
    (alerts.overrides: {})."""
    out = {}
    if isinstance(value, dict) and (value or not prefix):
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for item in value:
            out.update(flatten(item, prefix + "[]"))
    else:
        out[prefix] = value
    return out


def check_config(config_text: str, directory: str) -> dict:
    path = os.path.join(directory, "gradwatchd.yaml")
    with open(path, "w") as f:
        f.write(config_text)
    out = subprocess.run([DAEMON, "--check-config", "--config", path], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"--check-config failed ({out.returncode}): {out.stderr}")
    return json.loads(out.stdout[:out.stdout.rindex("configuration OK")])


class ConfigurationReference(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-config-ref-")
        self.rows = table_rows(os.path.join(ROOT, "docs", "configuration.md"))
        self.documented = {key: default.strip("`") for key, _, default in self.rows}

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_every_key_is_documented_and_every_documented_key_exists(self):
        shown = set(flatten(check_config(FULL_CONFIG, self.dir)))
        self.assertEqual(len(self.rows), len(self.documented), "a key is documented twice")
        self.assertEqual(sorted(shown - set(self.documented)), [], "keys --check-config shows that the page lacks")
        self.assertEqual(sorted(set(self.documented) - shown), [], "keys the page documents that do not exist")

    def test_documented_defaults_are_the_daemons(self):
        defaults = flatten(check_config("", self.dir))
        checked = 0
        for key, default in self.documented.items():
            if default == "—":
                continue
            with self.subTest(key=key):
                self.assertIn(key, defaults)
                actual = defaults[key]
                try:
                    expected = json.loads(default)
                except ValueError:
                    expected = default
                if isinstance(actual, (int, float)) and not isinstance(actual, bool):
                    self.assertEqual(float(expected), float(actual))
                else:
                    self.assertEqual(expected, actual)
                checked += 1
        self.assertGreater(checked, 30)


def parse_metrics(text: str):
    """{family: type} from the TYPE lines, and {family: set of label names} from the samples."""
    types, labels = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        name = m.group(1)
        family = next((f for f in (name, re.sub(r"_(bucket|sum|count)$", "", name)) if f in types), name)
        names = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or "")) - {"le", "quantile"}
        labels.setdefault(family, set()).update(names)
    return types, labels


class MetricReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="gradwatch-metric-ref-")
        config = os.path.join(cls.dir, "gradwatchd.yaml")
        with open(config, "w") as f:
            f.write(FULL_CONFIG)
        ready = os.path.join(cls.dir, "ready.json")
        cls.log = open(os.path.join(cls.dir, "gradwatchd.log"), "w")
        cls.daemon = subprocess.Popen([DAEMON, "--config", config, "--listen", "127.0.0.1:0", "--metrics-listen",
                                       "127.0.0.1:0", "--data-dir", os.path.join(cls.dir, "data"), "--ready-file", ready],
                                      stdout=cls.log, stderr=cls.log)
        try:
            deadline = time.monotonic() + 60 * SCALE
            while not (os.path.exists(ready) and os.path.getsize(ready) > 0):
                if time.monotonic() > deadline or cls.daemon.poll() is not None:
                    raise AssertionError("gradwatchd did not become ready")
                time.sleep(0.1)
            with open(ready) as f:
                ports = json.load(f)
            history = os.path.join(cls.dir, "run.jsonl")
            subprocess.run([sys.executable, os.path.join(ROOT, "deploy", "examples", "make_incident_run.py"), "--out",
                            history], check=True)
            subprocess.run([CLI, "--addr", f"127.0.0.1:{ports['grpc_port']}", "replay", history, "--max"],
                           check=True, capture_output=True, timeout=600 * SCALE)
            with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=30) as r:
                cls.types, cls.labels = parse_metrics(r.read().decode())
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.daemon.terminate()
        cls.daemon.wait(timeout=60)
        cls.log.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        self.rows = table_rows(os.path.join(ROOT, "docs", "metrics.md"))
        self.documented = {name: (kind, labels) for name, kind, labels in self.rows}

    def test_every_family_is_documented_and_every_documented_family_is_served(self):
        self.assertEqual(len(self.rows), len(self.documented), "a family is documented twice")
        self.assertEqual(sorted(set(self.types) - set(self.documented)), [], "families served that the page lacks")
        self.assertEqual(sorted(set(self.documented) - set(self.types)), [], "families documented but not served")

    def test_types_and_labels_are_the_documented_ones(self):
        with_samples = 0
        for name, (kind, labels) in self.documented.items():
            if name not in self.types:
                continue
            with self.subTest(family=name):
                self.assertEqual(self.types[name], kind)
                if name not in self.labels:
                    continue  # no sample in this scenario (no snapshot, no change point yet)
                with_samples += 1
                listed = [l.strip() for l in labels.split(",") if l.strip()]
                open_ended = "…" in listed
                patterns = [l[:-1] for l in listed if l.endswith("*")]
                plain = {l for l in listed if l != "…" and not l.endswith("*")}
                served = self.labels[name]
                self.assertEqual(sorted(plain - served), [], "documented labels the samples lack")
                extra = {l for l in served - plain if not any(l.startswith(p) for p in patterns)}
                if not open_ended:
                    self.assertEqual(sorted(extra), [], "labels on the samples that the page does not list")
        self.assertGreater(with_samples, 60)


if __name__ == "__main__":
    unittest.main()
