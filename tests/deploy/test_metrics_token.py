"""/metrics behind a token: Debian's real prometheus scrapes a gradwatchd with
security.metrics_require_token, with the shipped scrape config's `authorization.credentials_file`
(up), without a token (401, down) and with a token that lacks the read scope (403, down); and the
shipped job with its TLS and token lines uncommented scrapes a daemon that serves HTTPS (up), while
the same job trusting another CA, or in plain HTTP, is down.

Environment: GRADWATCHD_PATH, GRADWATCH_PROMETHEUS_PATH, GRADWATCH_TEST_TIME_SCALE.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest
import urllib.error
import urllib.request

import yaml

from stack import get_json, start_prometheus, stop_processes, wait_for

TOKENS = ("tokens:\n"
          f"  - {{name: prometheus, sha256: {hashlib.sha256(b'scrape-secret').hexdigest()}, scopes: [read]}}\n"
          f"  - {{name: trainer, sha256: {hashlib.sha256(b'write-secret').hexdigest()}, scopes: [write]}}\n")


def start_daemon(directory, security_yaml, processes, logs):
    """gradwatchd on free loopback ports with `security:` as given; returns its metrics port."""
    config = os.path.join(directory, "gradwatchd.yaml")
    with open(config, "w") as f:
        f.write(f"security: {security_yaml}\n")
    ready = os.path.join(directory, "ready.json")
    log = open(os.path.join(directory, "gradwatchd.log"), "w")
    logs.append(log)
    processes.append(subprocess.Popen(
        [os.environ.get("GRADWATCHD_PATH", "gradwatchd"), "--config", config, "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--data-dir", os.path.join(directory, "data"), "--ready-file", ready],
        stdout=log, stderr=log))
    wait_for(lambda: os.path.exists(ready) and os.path.getsize(ready) > 0, 60, "gradwatchd's ready file")
    with open(ready) as f:
        return json.load(f)["metrics_port"]


def target_health(prom_port):
    body = get_json(f"http://127.0.0.1:{prom_port}/api/v1/targets")
    if not body:
        return {}
    return {t["labels"]["job"]: (t["health"], t["lastError"]) for t in body["data"]["activeTargets"]}


def scraped_targets(prom_port, count):
    """Prometheus' targets once all `count` have been scraped (up or down), from one reading of
    /api/v1/targets: two readings could pair an empty answer with targets not yet scraped."""
    targets = target_health(prom_port)
    if len(targets) == count and all(h[0] in ("up", "down") for h in targets.values()):
        return targets
    return None

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class MetricsTokenTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-metrics-token-")
        self.processes, self.logs = [], []
        tokens = os.path.join(self.dir, "tokens.yaml")
        with open(tokens, "w") as f:
            f.write(TOKENS)
        self.metrics_port = start_daemon(self.dir, f"{{tokens_file: {tokens}, metrics_require_token: true}}",
                                         self.processes, self.logs)

    def tearDown(self):
        stop_processes(self.processes, self.logs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def get(self, token=None):
        request = urllib.request.Request(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def test_only_a_token_with_the_read_scope_scrapes(self):
        status, body = self.get()
        self.assertEqual(status, 401)
        self.assertIn("requires a bearer token", body)
        self.assertEqual(self.get("wrong")[0], 401)
        status, body = self.get("write-secret")
        self.assertEqual(status, 403)
        self.assertIn("token trainer has no 'read' scope", body)
        status, body = self.get("scrape-secret")
        self.assertEqual(status, 200)
        self.assertIn('gradwatch_auth_refusals_total{reason="unauthenticated"} 2', body)
        self.assertIn('gradwatch_auth_refusals_total{reason="permission_denied"} 1', body)

    def test_prometheus_scrapes_with_the_shipped_configs_credentials_file(self):
        with open(os.path.join(self.dir, "gradwatch.token"), "w") as f:
            f.write("scrape-secret\n")
        with open(os.path.join(self.dir, "trainer.token"), "w") as f:
            f.write("write-secret\n")
        with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
            shipped = yaml.safe_load(f)["scrape_configs"][0]
        target = f"127.0.0.1:{self.metrics_port}"
        jobs = []
        for name, credentials in (("with-token", "gradwatch.token"), ("without-token", None),
                                  ("read-less-token", "trainer.token")):
            job = {"job_name": name, "scrape_interval": "1s", "static_configs": [{"targets": [target]}]}
            if credentials:
                # The shipped job's commented block, as a user uncomments it.
                job["authorization"] = {"credentials_file": os.path.join(self.dir, credentials)}
            jobs.append(job)
        self.assertEqual(shipped["job_name"], "gradwatch")
        process, log, prom_port = start_prometheus(
            self.dir, yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
        self.processes.append(process)
        self.logs.append(log)

        targets = wait_for(lambda: scraped_targets(prom_port, 3), 120, "Prometheus to scrape the three jobs")
        self.assertEqual(targets["with-token"][0], "up", targets)
        self.assertEqual(targets["without-token"][0], "down")
        self.assertIn("401", targets["without-token"][1])
        self.assertEqual(targets["read-less-token"][0], "down")
        self.assertIn("403", targets["read-less-token"][1])
        # The samples arrived, not only a status: the daemon's series, from the job with the token only.
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=gradwatch_insecure_listener"
        result = wait_for(lambda: ((get_json(url) or {}).get("data") or {}).get("result"), 60, "a scraped series")
        self.assertEqual([r["metric"]["job"] for r in result], ["with-token"])


class MetricsTlsTest(unittest.TestCase):
    """The shipped scrape job, its TLS and token lines uncommented as a user would, against a
    gradwatchd serving HTTPS with certificates made by tests/support/make_test_certs.sh."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="gradwatch-metrics-tls-")
        self.processes, self.logs = [], []
        self.certs = os.path.join(self.dir, "certs")
        subprocess.run(["bash", os.path.join(ROOT, "tests", "support", "make_test_certs.sh"), self.certs],
                       check=True, timeout=120)
        tokens = os.path.join(self.dir, "tokens.yaml")
        with open(tokens, "w") as f:
            f.write(TOKENS)
        cert, key = os.path.join(self.certs, "server.pem"), os.path.join(self.certs, "server.key")
        self.metrics_port = start_daemon(
            self.dir, f"{{tls_cert_file: {cert}, tls_key_file: {key}, tokens_file: {tokens}, "
                      "metrics_require_token: true}", self.processes, self.logs)

    def tearDown(self):
        stop_processes(self.processes, self.logs)
        shutil.rmtree(self.dir, ignore_errors=True)

    def shipped_job_uncommented(self):
        """deploy/prometheus/prometheus.yml's gradwatch job with its commented scheme, tls_config and
        authorization lines uncommented."""
        with open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")) as f:
            text = f.read()
        keys = ("scheme", "tls_config", "ca_file", "authorization", "credentials_file")
        uncommented = re.sub(r"^( *)# ( *(?:%s):.*)$" % "|".join(keys), r"\1\2", text, flags=re.M)
        self.assertNotEqual(uncommented, text)
        job = yaml.safe_load(uncommented)["scrape_configs"][0]
        self.assertEqual(job["job_name"], "gradwatch")
        self.assertEqual(job["scheme"], "https")
        self.assertEqual(set(job["tls_config"]), {"ca_file"})
        self.assertEqual(set(job["authorization"]), {"credentials_file"})
        return job

    def test_prometheus_scrapes_a_tls_daemon_with_the_shipped_job(self):
        token = os.path.join(self.dir, "gradwatch.token")
        with open(token, "w") as f:
            f.write("scrape-secret\n")
        target = f"127.0.0.1:{self.metrics_port}"
        jobs = []
        for name, ca, scheme in (("tls", "ca.pem", "https"), ("untrusted", "other-ca.pem", "https"),
                                 ("plain", "ca.pem", "http")):
            job = self.shipped_job_uncommented()
            job.update({"job_name": name, "scrape_interval": "1s", "scheme": scheme,
                        "static_configs": [{"targets": [target]}]})
            job["tls_config"]["ca_file"] = os.path.join(self.certs, ca)
            job["authorization"]["credentials_file"] = token
            jobs.append(job)
        config = yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs})
        with open(os.path.join(self.dir, "check.yml"), "w") as f:
            f.write(config)
        check = subprocess.run([os.path.join(os.path.dirname(os.environ.get("GRADWATCH_PROMETHEUS_PATH",
                                                                               "/usr/bin/prometheus")), "promtool"),
                                "check", "config", os.path.join(self.dir, "check.yml")],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        process, log, prom_port = start_prometheus(self.dir, config)
        self.processes.append(process)
        self.logs.append(log)
        targets = wait_for(lambda: scraped_targets(prom_port, 3), 120, "Prometheus to scrape the three jobs")
        self.assertEqual(targets["tls"][0], "up", targets)
        self.assertEqual(targets["untrusted"][0], "down")
        self.assertIn("certificate", targets["untrusted"][1])
        self.assertEqual(targets["plain"][0], "down")
        self.assertIn("400", targets["plain"][1])
        url = f"http://127.0.0.1:{prom_port}/api/v1/query?query=gradwatch_insecure_listener"
        result = wait_for(lambda: ((get_json(url) or {}).get("data") or {}).get("result"), 60, "a scraped series")
        self.assertEqual([(r["metric"]["job"], r["value"][1]) for r in result], [("tls", "0")])


if __name__ == "__main__":
    unittest.main()
