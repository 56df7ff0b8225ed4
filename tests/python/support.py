"""The real gradwatchd for the Python client's tests: started on loopback in a temporary directory,
waited for by its ready file, stopped or killed, and restarted on the same port."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
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


def mount_tmpfs(test: unittest.TestCase, size_mb: int) -> str:
    """A tmpfs of `size_mb` MiB mounted on a new temporary directory, unmounted and removed at the
    test's cleanup (cleanups run last first: register what writes into it afterwards). Skips the
    test when it cannot be mounted (not root, no CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        test.skipTest("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="gradwatch-py-tmpfs-")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", mnt],
                                 capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        mounted = subprocess.CompletedProcess([], 1, "", str(e))
    if mounted.returncode != 0:
        os.rmdir(mnt)
        test.skipTest(f"cannot mount a tmpfs: {mounted.stderr.strip() or mounted.returncode}")

    def unmount() -> None:
        if subprocess.run(["umount", mnt], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60)
        shutil.rmtree(mnt, ignore_errors=True)

    test.addCleanup(unmount)
    return mnt


def fill(path: str) -> None:
    """Appends zeros to the file `path` until its file system has no room left (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            while True:
                try:
                    os.write(fd, chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


STORAGE_UNAVAILABLE = "ERROR_REASON_STORAGE_UNAVAILABLE"


def fill_until_refused(address: str, filler: str, seconds: float = 60) -> None:
    """Fills the file system of the file `filler` (the one of a daemon's data directory) until the
    daemon at `address` refuses a step of a probe run with ERROR_REASON_STORAGE_UNAVAILABLE: its
    journal has failed to commit, and from then on it refuses every step and event, of every run,
    until a commit succeeds again. (Steps it received before the failure stay held, not refused.)"""
    import gradwatch  # the package under test, found on PYTHONPATH as the tests' own imports are

    probe = gradwatch.Monitor("storage-probe", address=address, initial_backoff=0.05, max_backoff=0.2)
    step = 0

    def refused() -> bool:
        nonlocal step
        fill(filler)  # the daemon may have freed some room since
        step += 1
        probe.log(step, {"train/loss": 1.0})
        return probe.stats().errors_by_reason.get(STORAGE_UNAVAILABLE, 0) > 0

    try:
        wait_for(refused, seconds, "the daemon to refuse a step with STORAGE_UNAVAILABLE")
    finally:
        probe.close(finished=False, timeout=0)


class Daemon:
    """gradwatchd in a temporary data directory (or `data_dir`); grpc_port is kept across restart()."""

    def __init__(self, config_yaml: str = "log: {level: info}\n",
                 credentials: Optional[grpc.ChannelCredentials] = None, data_dir: Optional[str] = None) -> None:
        self.binary = os.environ.get("GRADWATCHD_PATH", "gradwatchd")
        self.credentials = credentials  # for the queries, when the daemon serves TLS
        self.dir = tempfile.mkdtemp(prefix="gradwatch-py-")
        self.data_dir = data_dir or os.path.join(self.dir, "data")
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
            [self.binary, "--config", self.config, "--data-dir", self.data_dir,
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
