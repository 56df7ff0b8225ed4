"""The real gradwatchd for the Python client's tests: started on loopback in a temporary directory,
waited for by its ready file, stopped or killed, and restarted on the same port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Callable, List, Optional

import grpc

from gradwatch.v1 import gradwatch_pb2 as pb
from gradwatch.v1 import gradwatch_pb2_grpc as pb_grpc


def time_scale() -> float:
    """How much longer every wait may take (sanitizer builds run slower); GRADWATCH_TEST_TIME_SCALE."""
    try:
        return max(1.0, float(os.environ.get("GRADWATCH_TEST_TIME_SCALE", "1")))
    except ValueError:
        return 1.0


def make_test_certs(directory: str) -> None:
    """The TLS tests' certificates in `directory` (tests/support/make_test_certs.sh)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "make_test_certs.sh")
    subprocess.run(["bash", script, directory], check=True, capture_output=True, timeout=120 * time_scale())


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Polls `condition` until it holds, for up to `seconds` × time_scale()."""
    deadline = time.monotonic() + seconds * time_scale()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds * time_scale():.0f} s waiting for {what}")
        time.sleep(0.02)


class Daemon:
    """gradwatchd in a temporary data directory; grpc_port is kept across restart()."""

    def __init__(self, config_yaml: str = "log: {level: info}\n",
                 credentials: Optional[grpc.ChannelCredentials] = None) -> None:
        self.binary = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
        self.credentials = credentials  # for the queries, when the daemon serves TLS
        self.dir = tempfile.mkdtemp(prefix="gradwatch-py-")
        self.config = os.path.join(self.dir, "gradwatchd.yaml")
        with open(self.config, "w") as f:
            f.write(config_yaml)
        self.grpc_port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        ready = os.path.join(self.dir, "ready.json")
        if os.path.exists(ready):
            os.unlink(ready)
        self.stderr = open(os.path.join(self.dir, "gradwatchd.stderr.log"), "a")
        self.proc = subprocess.Popen(
            [self.binary, "--config", self.config, "--data-dir", os.path.join(self.dir, "data"),
             "--listen", f"127.0.0.1:{self.grpc_port}", "--metrics-listen", "127.0.0.1:0", "--ready-file", ready],
            stdout=subprocess.DEVNULL, stderr=self.stderr)

        def is_ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"gradwatchd exited with {self.proc.returncode}: {self.log()[-2000:]}")
            return os.path.exists(ready) and os.path.getsize(ready) > 0

        wait_for(is_ready, 60, "gradwatchd to be ready")
        with open(ready) as f:
            self.grpc_port = json.load(f)["grpc_port"]
        self.channel = (grpc.secure_channel(self.address, self.credentials) if self.credentials is not None
                        else grpc.insecure_channel(self.address))
        self.query = pb_grpc.QueryStub(self.channel)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.channel.close()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60 * time_scale())
        self.stderr.close()
        return code

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()

    def log(self) -> str:
        with open(os.path.join(self.dir, "gradwatchd.stderr.log")) as f:
            return f.read()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- queries --------------------------------------------------------------------------------

    def run(self, run_id: str) -> pb.RunSummary:
        return self.query.GetRun(pb.GetRunRequest(run_id=run_id), timeout=30)

    def points(self, run_id: str, key: str) -> List[pb.SeriesPoint]:
        return list(self.query.GetSeries(pb.GetSeriesRequest(run_id=run_id, key=key), timeout=30).points)

    def alerts(self, run_id: str) -> List[pb.Alert]:
        return list(self.query.ListAlerts(pb.ListAlertsRequest(run_id=run_id), timeout=30).alerts)
