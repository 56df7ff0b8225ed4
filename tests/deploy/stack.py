"""What the tests/deploy tests share: the time scale, free loopback ports, waiting on readiness."""

import json
import os
import socket
import subprocess
import time
import urllib.request

# Every wait is multiplied by GRADWATCH_TEST_TIME_SCALE (sanitizer builds run slower).
SCALE = max(1.0, float(os.environ.get("GRADWATCH_TEST_TIME_SCALE", "1")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, seconds: float, what: str):
    """condition()'s first true result, polled until seconds × SCALE have passed."""
    deadline = time.monotonic() + seconds * SCALE
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds * SCALE:.0f} s waiting for {what}")
        time.sleep(0.2)


def get_json(url: str):
    """The JSON at url, or None when it cannot be had (not up yet, an error, not JSON)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def stop_processes(processes, logs=()):
    """SIGTERM every process still running (in reverse order of start), SIGKILL one that does not
    exit within 30 s; then close the log files."""
    for p in reversed(list(processes)):
        if p is None or p.poll() is not None:
            continue
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for f in logs:
        f.close()


def start_prometheus(directory: str, config_text: str, *extra_args: str):
    """Debian's prometheus on a free loopback port, its config, TSDB and log in `directory`; returns
    (process, log file, port). Stop it with stop_processes."""
    port = free_port()
    config = os.path.join(directory, "prometheus.yml")
    with open(config, "w") as f:
        f.write(config_text)
    log = open(os.path.join(directory, "prometheus.log"), "w")
    process = subprocess.Popen(
        [os.environ.get("GRADWATCH_PROMETHEUS_PATH", "prometheus"), "--config.file", config,
         "--storage.tsdb.path", os.path.join(directory, "tsdb"), "--web.listen-address", f"127.0.0.1:{port}",
         *extra_args],
        stdout=log, stderr=log)
    return process, log, port
