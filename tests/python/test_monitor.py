"""gradwatch.Monitor against the real gradwatchd."""

import logging
import math
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import unittest
from unittest import mock

import numpy as np

import gradwatch
from gradwatch import _catalog, _monitor
from gradwatch.v1 import gradwatch_pb2 as pb
import grpc

from support import (STORAGE_UNAVAILABLE, Daemon, fill, fill_until_refused, make_test_certs, mount_tmpfs,
                     time_scale, wait_for)

CATALOG = [
    {"name": "final_norm.weight", "numel": 64},
    {"name": "lm_head.weight", "numel": 6400, "weight_decay": 0.1},
    "layers.0.mlp.weight",
]


def metrics(step: int, total: float = 0.5) -> dict:
    return {
        "train/loss": 3.0 - step * 1e-3,
        "grad/norm/total": total,
        "grad/norm/final_norm.weight": 0.1,
        "params/norm/final_norm.weight": 8.0 + 0.01 * step,
        "grad/norm/lm_head.weight": 0.4,
        "grad/norm/layers.0.mlp.weight": 0.2,
        "optim/learning_rate": 3e-4,
    }


def messages(logs, text: str) -> list:
    """The messages of the records assertLogs caught so far that contain `text`."""
    return [r.getMessage() for r in list(logs.records) if text in r.getMessage()]


def log_until(mon: gradwatch.Monitor, step: int, condition, seconds: float, what: str) -> int:
    """Logs a step every ~20 ms after `step` until condition() holds; the last step logged."""
    def logged() -> bool:
        nonlocal step
        step += 1
        mon.log(step, metrics(step))
        return condition()

    wait_for(logged, seconds, what)
    return step


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (SIGSTOP)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread exited
            continue
        if state != "T":
            return False
    return True


class MonitorTest(unittest.TestCase):
    def setUp(self) -> None:
        self.daemon = Daemon()

    def tearDown(self) -> None:
        self.daemon.close()

    def monitor(self, run: str, **kwargs) -> gradwatch.Monitor:
        kwargs.setdefault("params", CATALOG)
        kwargs.setdefault("config", {"weight_decay": 0.1})
        return gradwatch.Monitor(run, address=self.daemon.address, **kwargs)

    def test_steps_events_catalog_and_a_clean_finish(self) -> None:
        with self.monitor("py-basic", labels={"team": "pretrain"}) as mon:
            for s in range(1, 201):
                m = metrics(s)
                if s >= 50:
                    m["grad/norm/layers.1.attn.weight"] = 0.3  # not in the catalog: it is added
                self.assertTrue(mon.log(s, m))
                if s == 100:
                    self.assertTrue(mon.event(s, "routing switch"))
            self.assertTrue(mon.flush(30))
        self.assertTrue(mon.stats().finished)

        run = self.daemon.run("py-basic")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.step_count, 200)
        self.assertEqual(run.info.labels["team"], "pretrain")
        params = {p.name: p for p in run.params}
        self.assertEqual(params["final_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["final_norm.weight"].weight_decay, 0.0)
        self.assertEqual(params["lm_head.weight"].kind, pb.PARAM_KIND_OUTPUT)
        self.assertEqual(params["lm_head.weight"].weight_decay, 0.1)
        self.assertEqual(params["layers.0.mlp.weight"].kind, pb.PARAM_KIND_MLP)
        self.assertEqual(params["layers.1.attn.weight"].kind, pb.PARAM_KIND_ATTENTION)
        self.assertEqual([e.text for e in run.events], ["routing switch"])
        norms = self.daemon.points("py-basic", "params/norm/final_norm.weight")
        self.assertEqual([p.step for p in norms], list(range(1, 201)))
        for p in norms:
            self.assertAlmostEqual(p.value, 8.0 + 0.01 * p.step, places=9)
        added = self.daemon.points("py-basic", "grad/norm/layers.1.attn.weight")
        self.assertEqual([p.step for p in added], list(range(50, 201)))

    def test_every_step_goes_to_each_of_several_daemons_and_a_dead_one_holds_up_nothing(self) -> None:
        replica = Daemon()
        try:
            address = f"{self.daemon.address},{replica.address}"
            with gradwatch.Monitor("py-replicas", address=address, params=CATALOG) as mon:
                self.assertEqual(mon.addresses, [self.daemon.address, replica.address])
                for s in range(1, 101):
                    self.assertTrue(mon.log(s, metrics(s)))
                self.assertTrue(mon.event(50, "routing switch"))
                self.assertTrue(mon.flush(30))
                self.assertEqual(mon.stats().acked_through_step, 100)
                self.assertEqual(set(mon.stats_by_daemon()), {self.daemon.address, replica.address})
            for d in (self.daemon, replica):
                run = d.run("py-replicas")
                self.assertEqual(run.info.step_count, 100)
                self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
                self.assertEqual([e.text for e in run.events], ["routing switch"])
            self.assertEqual([(p.step, p.value) for p in self.daemon.points("py-replicas", "params/norm/final_norm.weight")],
                             [(p.step, p.value) for p in replica.points("py-replicas", "params/norm/final_norm.weight")])

            # One replica gone: the other gets every step, flush says not every daemon has them.
            replica.stop(signal.SIGKILL)
            mon = gradwatch.Monitor("py-half", address=[self.daemon.address, replica.address], params=CATALOG)
            for s in range(1, 51):
                self.assertTrue(mon.log(s, metrics(s)))
            wait_for(lambda: mon.stats_by_daemon()[self.daemon.address].acked_through_step == 50, 30,
                     "the live daemon's acks")
            self.assertFalse(mon.flush(3))
            by_daemon = mon.stats_by_daemon()
            self.assertEqual(by_daemon[self.daemon.address].acked_through_step, 50)
            self.assertIsNone(by_daemon[replica.address].acked_through_step)
            self.assertIsNone(mon.stats().acked_through_step)
            self.assertFalse(mon.close(finished=True, timeout=3))
            self.assertEqual(self.daemon.run("py-half").info.step_count, 50)
            self.assertEqual(self.daemon.run("py-half").info.state, pb.RUN_STATE_FINISHED)
        finally:
            replica.close()

    def test_values_are_anything_float_takes(self) -> None:
        class Scalar:  # a JAX or torch 0-d value: it converts with float()
            def __float__(self) -> float:
                return 0.25

        with self.monitor("py-values") as mon:
            mon.log(1, {"grad/norm/total": np.float32(0.5), "train/loss": np.float64(2.5),
                        "grad/norm/final_norm.weight": np.array(0.125), "train/tokens": 4096,
                        "params/norm/final_norm.weight": Scalar(), "my/metric": 7})
            with self.assertRaises(TypeError):
                mon.log(2, {"train/loss": "high"})
            with self.assertRaises(ValueError):
                mon.log(-1, {"train/loss": 1.0})
        latest = {v.key: v.value for v in self.daemon.run("py-values").latest}
        self.assertEqual(latest["grad/norm/total"], 0.5)
        self.assertEqual(latest["train/loss"], 2.5)
        self.assertEqual(latest["grad/norm/final_norm.weight"], 0.125)
        self.assertEqual(latest["params/norm/final_norm.weight"], 0.25)
        self.assertEqual(latest["my/metric"], 7.0)

    def test_the_contingency_alert_reaches_the_callback(self) -> None:
        alerts = []
        seen = threading.Event()

        def on_alert(alert: pb.Alert) -> None:
            alerts.append(alert)
            if alert.name == "GradNormContingency":
                seen.set()

        with self.monitor("py-alert", on_alert=on_alert) as mon:
            for s in range(1001, 1041):  # past the first steps, whose pages are held (alerts.min_steps_before_page)
                mon.log(s, metrics(s, total=0.5 if s < 1020 else 6.0))
            self.assertTrue(mon.flush(30))
            self.assertTrue(seen.wait(30))
        firing = [a for a in alerts if a.name == "GradNormContingency"]
        self.assertTrue(firing)
        self.assertEqual(firing[0].state, pb.ALERT_STATE_FIRING)
        # The lm_head carries a small share and the final norm barely moves: no cause, no weight-decay advice.
        self.assertEqual(firing[0].annotations["cause"], "none")
        self.assertEqual(firing[0].annotations["remediation_supported"], "false")
        self.assertIn("No cause found in the per-parameter norms", firing[0].annotations["recommendation"])

    def test_a_daemon_killed_and_restarted_mid_run_loses_nothing(self) -> None:
        mon = self.monitor("py-restart")
        for s in range(1, 101):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(30))
        self.daemon.stop(signal.SIGKILL)
        for s in range(101, 201):  # queued while the daemon is away
            self.assertTrue(mon.log(s, metrics(s)))
        self.daemon.start()  # the same port
        for s in range(201, 301):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(60))
        stats = mon.stats()
        self.assertGreaterEqual(stats.reconnects, 1)
        self.assertEqual(stats.dropped, 0)
        self.assertTrue(mon.close(finished=True))
        run = self.daemon.run("py-restart")
        self.assertEqual(run.info.step_count, 300)
        self.assertEqual([p.step for p in self.daemon.points("py-restart", "train/loss")], list(range(1, 301)))

    def test_steps_beyond_the_queue_are_dropped_counted_and_reported(self) -> None:
        mon = self.monitor("py-drops", queue_capacity=10)
        mon.log(1, metrics(1))
        self.assertTrue(mon.flush(30))
        self.daemon.stop()
        kept = sum(mon.log(s, metrics(s)) for s in range(2, 27))
        self.assertEqual(kept, 10)
        self.assertEqual(mon.stats().dropped, 15)
        self.daemon.start()
        self.assertTrue(mon.flush(60))
        self.assertTrue(mon.log(27, metrics(27)))
        self.assertTrue(mon.close())
        run = self.daemon.run("py-drops")
        self.assertEqual(run.info.step_count, 12)
        self.assertEqual(run.client_dropped_steps, 15)

    def test_a_loop_that_raises_leaves_the_run_open(self) -> None:
        with self.assertRaises(RuntimeError):
            with self.monitor("py-crash") as mon:
                mon.log(1, metrics(1))
                raise RuntimeError("out of memory")
        self.assertFalse(mon.stats().finished)
        run = self.daemon.run("py-crash")
        self.assertEqual(run.info.step_count, 1)
        self.assertNotEqual(run.info.state, pb.RUN_STATE_FINISHED)

    def test_a_refused_hello_is_reported_and_flush_gives_up(self) -> None:
        with self.monitor("py-world") as mon:
            mon.log(1, metrics(1))
        other = self.monitor("py-world", rank=0, world_size=2)  # another world size, not a resume
        other.log(2, metrics(2))
        self.assertFalse(other.flush(30))
        stats = other.stats()
        self.assertTrue(stats.rejected)
        self.assertIn("ERROR_REASON_WORLD_SIZE_CHANGED", stats.errors_by_reason)
        self.assertFalse(other.close())

    def test_a_refused_hello_is_warned_of_once_with_the_daemons_reason(self) -> None:
        with self.monitor("py-world-warned") as mon:
            mon.log(1, metrics(1))
        other = self.monitor("py-world-warned", rank=0, world_size=2)
        with self.assertLogs("gradwatch", "WARNING") as logs:
            other.log(2, metrics(2))
            wait_for(lambda: other.stats().rejected, 30, "the Hello to be refused")
            for s in range(3, 30):  # logged on, after the refusal: no more warnings
                other.log(s, metrics(s))
            self.assertEqual(len(logs.records), 1, logs.output)
            self.assertFalse(other.close(timeout=1))  # and says what it leaves unsent
        [refused] = [r for r in logs.records if "refused run" in r.getMessage()]
        self.assertGreaterEqual(refused.levelno, logging.WARNING)
        self.assertIn(f"the daemon at {self.daemon.address} refused run py-world-warned rank 0", refused.getMessage())
        self.assertIn("ERROR_REASON_WORLD_SIZE_CHANGED", refused.getMessage())
        self.assertIn("this run's steps and events are not sent to it", refused.getMessage())
        [gave_up] = messages(logs, "close gave up")
        self.assertIn("28 steps and 0 events not acknowledged (steps 2 to 29); close leaves them unsent", gave_up)

    def test_a_normal_run_logs_no_warning(self) -> None:
        with self.assertNoLogs("gradwatch", "WARNING"):
            with self.monitor("py-quiet") as mon:
                for s in range(1, 301):
                    self.assertTrue(mon.log(s, metrics(s)))
                    if s == 100:
                        self.assertTrue(mon.event(s, "routing switch"))
                    if s == 150:
                        self.assertTrue(mon.update_params(s, [{"name": "final_norm.weight", "weight_decay": 0.1}]))
                self.assertTrue(mon.flush(30))
        stats = mon.stats()
        self.assertTrue(stats.finished)
        self.assertEqual((stats.acked_through_step, stats.dropped, stats.refused), (300, 0, 0), stats)

    def test_a_daemon_up_late_is_warned_of_then_reconnected_and_gets_every_step(self) -> None:
        self.daemon.stop()  # its port is kept: nothing listens there until start()
        with mock.patch.object(_monitor, "_UNREACHABLE_AFTER", 1.0):
            mon = self.monitor("py-late")
            with self.assertLogs("gradwatch", "WARNING") as logs:
                step = log_until(mon, 0, lambda: messages(logs, "cannot reach"), 30, "the unreachable warning")
                self.daemon.start()  # the same port
                step = log_until(mon, step, lambda: messages(logs, "reconnected"), 60, "the reconnection")
            self.assertTrue(mon.flush(60))
        [down] = messages(logs, "cannot reach")
        self.assertIn(f"cannot reach the daemon at {self.daemon.address}", down)
        [up] = messages(logs, "reconnected")
        back = re.search(r"reconnected to the daemon at (\S+) after (\d+) s \(run py-late rank 0\); (\d+) steps? and "
                         r"0 events queued are being sent", up)
        self.assertIsNotNone(back, up)
        self.assertEqual(back[1], self.daemon.address)
        self.assertTrue(1 <= int(back[3]) <= step, up)
        self.assertEqual(len(logs.records), 2, logs.output)  # nothing else: the queue stayed below half
        stats = mon.stats()
        self.assertEqual((stats.acked_through_step, stats.dropped, stats.refused), (step, 0, 0), stats)
        self.assertTrue(mon.close())
        self.assertEqual(self.daemon.run("py-late").info.step_count, step)

    def test_resume_from_a_checkpoint_replaces_the_steps_after_it(self) -> None:
        mon = self.monitor("py-resume")
        for s in range(1, 101):
            mon.log(s, metrics(s))
        self.assertTrue(mon.close(finished=False))
        resumed = self.monitor("py-resume", resume_from_step=51)
        for s in range(51, 81):
            resumed.log(s, {"train/loss": 1.0})
        self.assertTrue(resumed.close())
        run = self.daemon.run("py-resume")
        self.assertEqual(run.info.last_step, 80)
        losses = self.daemon.points("py-resume", "train/loss")
        self.assertEqual([p.step for p in losses], list(range(1, 81)))
        self.assertTrue(all(p.value == 1.0 for p in losses if p.step >= 51))

    def test_squared_partial_sums_of_two_ranks_are_merged(self) -> None:
        ranks = [self.monitor("py-ranks", rank=r, world_size=2) for r in range(2)]
        for s in range(1, 11):
            for r, mon in enumerate(ranks):
                mon.log(s, {"grad/norm/total": 9.0 if r == 0 else 16.0, "grad/norm/lm_head.weight": 1.0},
                        squared=True)
        for mon in ranks:
            self.assertTrue(mon.flush(30))
        for mon in ranks:
            mon.close(finished=False)
        latest = {v.key: v.value for v in self.daemon.run("py-ranks").latest}
        self.assertAlmostEqual(latest["grad/norm/total"], 5.0)
        self.assertAlmostEqual(latest["grad/norm/lm_head.weight"], math.sqrt(2.0))

    def catalog_events(self, run: str) -> list:
        return [e for e in self.daemon.run(run).events if e.source == "catalog"]

    def test_update_params_is_acked_and_the_runs_catalog_follows_it(self) -> None:
        with self.monitor("py-update") as mon:
            for s in range(1, 51):
                mon.log(s, metrics(s))
            self.assertTrue(mon.update_params(51, [
                {"name": "final_norm.weight", "weight_decay": 0.1},
                {"name": "layers.0.mlp.weight", "kind": "router", "role": "gate", "group": "routing"}]))
            for s in range(51, 101):
                mon.log(s, metrics(s))
            self.assertTrue(mon.flush(30))  # the update's EventAck included
            stats = mon.stats()
            self.assertEqual((stats.catalog_updates_sent, stats.unacked, stats.errors), (1, 0, 0), stats)
        run = self.daemon.run("py-update")
        params = {p.name: p for p in run.params}
        self.assertAlmostEqual(params["final_norm.weight"].weight_decay, 0.1)
        self.assertEqual(params["final_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["layers.0.mlp.weight"].kind, pb.PARAM_KIND_ROUTER)
        self.assertEqual((params["layers.0.mlp.weight"].role, params["layers.0.mlp.weight"].group), ("gate", "routing"))
        self.assertAlmostEqual(params["lm_head.weight"].weight_decay, 0.1)  # not named: unchanged
        [event] = self.catalog_events("py-update")
        self.assertEqual(event.step, 51)
        self.assertIn("final_norm.weight", event.text)
        self.assertIn("layers.0.mlp.weight", event.text)

    def test_a_reconnect_hello_carries_the_updated_catalog(self) -> None:
        mon = self.monitor("py-update-hello")
        for s in range(1, 21):
            mon.log(s, metrics(s))
        self.assertTrue(mon.update_params(21, [{"name": "final_norm.weight", "weight_decay": 0.05}]))
        for s in range(21, 31):  # the daemon applies the change with the first step it covers
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(30))
        self.daemon.restart()
        for s in range(31, 41):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(60))
        self.assertGreaterEqual(mon.stats().reconnects, 1)
        self.assertTrue(mon.close(finished=False))
        # Another process's Monitor, made with the catalog as it was: its Hello differs from the run's
        # (which the daemon logs, and does not apply without a resume). The reconnect's Hello did not.
        other = self.monitor("py-update-hello")
        other.log(41, metrics(41))
        self.assertTrue(other.close())
        differs = [line for line in self.daemon.log().splitlines()
                   if "py-update-hello" in line and "catalog differs" in line]
        self.assertEqual(len(differs), 1, differs)
        params = {p.name: p for p in self.daemon.run("py-update-hello").params}
        self.assertAlmostEqual(params["final_norm.weight"].weight_decay, 0.05)
        self.assertEqual([e.step for e in self.catalog_events("py-update-hello")], [21])

    def test_an_unacknowledged_update_is_sent_again_after_a_reconnect(self) -> None:
        mon = self.monitor("py-update-resend")
        for s in range(1, 21):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(30))
        os.kill(self.daemon.proc.pid, signal.SIGSTOP)  # takes nothing in, acks nothing
        wait_for(lambda: stopped(self.daemon.proc.pid), 30, "gradwatchd to stop")
        self.assertTrue(mon.update_params(21, [{"name": "final_norm.weight", "weight_decay": 0.1}]))
        mon.log(21, metrics(21))
        wait_for(lambda: mon.stats().catalog_updates_sent == 1, 30, "the update to be written")
        self.assertGreaterEqual(mon.stats().unacked, 1)
        self.daemon.stop(signal.SIGKILL)
        self.daemon.start()
        for s in range(22, 41):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(60))
        stats = mon.stats()
        self.assertEqual((stats.catalog_updates_sent, stats.errors), (2, 0), stats)
        self.assertTrue(mon.close())
        run = self.daemon.run("py-update-resend")
        self.assertEqual(run.info.step_count, 40)
        self.assertAlmostEqual({p.name: p for p in run.params}["final_norm.weight"].weight_decay, 0.1)
        self.assertEqual([e.step for e in self.catalog_events("py-update-resend")], [21])


class UnreachableDaemonTest(unittest.TestCase):
    """Warnings about a daemon that cannot be reached (127.0.0.1:1: nothing listens) and about its queue."""

    def monitor(self, run: str, **kwargs) -> gradwatch.Monitor:
        mon = gradwatch.Monitor(run, address="127.0.0.1:1", params=CATALOG, **kwargs)
        self.addCleanup(mon.close, finished=False, timeout=0)
        return mon

    def test_it_is_warned_of_once_and_close_says_what_it_leaves_unsent(self) -> None:
        mon = self.monitor("py-unreachable")
        with self.assertLogs("gradwatch", "WARNING") as logs:
            start = time.monotonic()
            step = log_until(mon, 0, lambda: messages(logs, "cannot reach"), 30, "the unreachable warning")
            warned_after = time.monotonic() - start
            # Logging on for a while (it warns once a minute at most): no second warning.
            until = time.monotonic() + 2
            step = log_until(mon, step, lambda: time.monotonic() > until, 30, "two more seconds")
            began = time.monotonic()
            self.assertFalse(mon.close(timeout=1))
            closed_in = time.monotonic() - began
        self.assertGreaterEqual(warned_after, _monitor._UNREACHABLE_AFTER)  # quiet for the first seconds
        self.assertLess(warned_after, _monitor._UNREACHABLE_AFTER + 5 * time_scale())
        [line] = messages(logs, "cannot reach")
        self.assertIn("cannot reach the daemon at 127.0.0.1:1 for 5 s (UNAVAILABLE: ", line)
        queued = re.search(r"run py-unreachable rank 0: (\d+) steps? and 0 events queued \(capacity 10000 steps\)", line)
        self.assertIsNotNone(queued, line)
        self.assertTrue(1 <= int(queued[1]) < step, line)
        self.assertLess(closed_in, 5 * time_scale())
        [gave_up] = messages(logs, "close gave up")
        self.assertIn(f"{step} steps and 0 events not acknowledged (steps 1 to {step}); close leaves them unsent",
                      gave_up)
        self.assertEqual(len(logs.records), 2, logs.output)

    def test_it_is_warned_of_again_only_after_the_interval(self) -> None:
        interval = 0.5
        with mock.patch.object(_monitor, "_WARN_INTERVAL", interval), \
                mock.patch.object(_monitor, "_UNREACHABLE_AFTER", 0.2):
            mon = self.monitor("py-unreachable-rate")
            with self.assertLogs("gradwatch", "WARNING") as logs:
                step = log_until(mon, 0, lambda: messages(logs, "cannot reach"), 30, "the unreachable warning")
                first = time.monotonic()
                log_until(mon, step, lambda: time.monotonic() > first + 3, 30, "three more seconds")
                # close() tries one reconnect before it gives up, and warns while it does: on a busy
                # machine that takes seconds, so the span ends when close returns.
                self.assertFalse(mon.close(timeout=0))
                span = time.monotonic() - first
        warned = [r for r in logs.records if "cannot reach" in r.getMessage()]
        self.assertGreaterEqual(len(warned), 2, logs.output)  # again once the interval passed
        self.assertLessEqual(len(warned), 1 + span / interval, logs.output)
        for before, after in zip(warned, warned[1:]):
            self.assertGreaterEqual(after.created - before.created, interval - 0.05, logs.output)

    def test_a_queue_past_half_then_dropping_is_warned_of_with_counts(self) -> None:
        with mock.patch.object(_monitor, "_WARN_INTERVAL", 0.3):
            mon = self.monitor("py-small-queue", queue_capacity=10)
            with self.assertLogs("gradwatch", "WARNING") as logs:
                for s in range(1, 6):
                    self.assertTrue(mon.log(s, metrics(s)))
                self.assertEqual(messages(logs, "past half"), [])  # 5 of 10: not past half
                self.assertTrue(mon.log(6, metrics(6)))
                [half] = messages(logs, "past half")
                for s in range(7, 11):
                    self.assertTrue(mon.log(s, metrics(s)))
                self.assertEqual(messages(logs, "is full"), [])
                self.assertFalse(mon.log(11, metrics(11)))
                [full] = messages(logs, "is full")
                # Dropping on: the next warning, an interval later, counts the drops since this one.
                log_until(mon, 11, lambda: len(messages(logs, "is full")) > 1, 30, "the second drop warning")
                dropped = mon.stats().dropped
                self.assertFalse(mon.close(timeout=0))
        self.assertIn("the queue for the daemon at 127.0.0.1:1 is past half full: 6 of 10 steps held "
                      "(run py-small-queue rank 0; not connected: ", half)
        self.assertIn("once full, further steps are dropped (counted in stats().dropped)", half)
        self.assertIn("the queue for the daemon at 127.0.0.1:1 is full (10 steps; run py-small-queue rank 0; ", full)
        self.assertIn("1 step dropped since the queue filled, 1 in all (stats().dropped)", full)
        # The second drop warning (on a busy machine a third may follow before close).
        again = messages(logs, "is full")[1]
        counts = re.search(r"(\d+) steps? dropped since the last warning, (\d+) in all \(stats\(\)\.dropped\)", again)
        self.assertIsNotNone(counts, again)
        self.assertEqual(int(counts[1]), int(counts[2]) - 1, again)  # all but the one the first warning counted
        self.assertTrue(2 <= int(counts[2]) <= dropped, again)
        self.assertEqual(len(messages(logs, "past half")), 1, logs.output)  # it stayed past half: not again


class UpdateParamsValidationTest(unittest.TestCase):
    """update_params checks its input before it queues anything; no daemon is needed."""

    def setUp(self) -> None:
        self.mon = gradwatch.Monitor("py-validate", address="127.0.0.1:1", params=CATALOG, start=False)

    def tearDown(self) -> None:
        self.mon.close(finished=False, timeout=1)

    def test_each_mistake_is_named(self) -> None:
        cases = [
            ([{"name": "final_norm.weight", "decay": 0.1}], ValueError, r"unknown fields \['decay'\]"),
            ([{"weight_decay": 0.1}], ValueError, "has no name"),
            ([{"name": "nope.weight", "weight_decay": 0.1}], ValueError, "'nope.weight' is not in the catalog"),
            ([{"name": "final_norm.weight"}], ValueError, "'final_norm.weight': no field to change"),
            ([{"name": "final_norm.weight", "weight_decay": -0.1}], ValueError,
             "'final_norm.weight': weight_decay must be finite and >= 0, not -0.1"),
            ([{"name": "final_norm.weight", "weight_decay": float("nan")}], ValueError,
             "weight_decay must be finite and >= 0, not nan"),
            ([{"name": "final_norm.weight", "weight_decay": "high"}], ValueError,
             "weight_decay 'high' is not a number"),
            ([{"name": "final_norm.weight", "kind": "gain"}], ValueError,
             r"'final_norm.weight': unknown parameter kind 'gain' \(one of norm_gain, output"),
            ([{"name": "final_norm.weight", "role": 3}], ValueError, "role must be text"),
            ([{"name": "final_norm.weight", "group": "g" * 257}], ValueError, "group is over 256 bytes"),
            ([{"name": "final_norm.weight", "weight_decay": 0.1}, {"name": "final_norm.weight", "role": "x"}],
             ValueError, "'final_norm.weight' is named twice"),
            ([], ValueError, "no parameter to change"),
            ({"name": "final_norm.weight", "weight_decay": 0.1}, TypeError, "a sequence of mappings"),
            (["final_norm.weight"], TypeError, "a change is a mapping with a name, not str"),
        ]
        for params, error, message in cases:
            with self.subTest(params=params), self.assertRaisesRegex(error, message):
                self.mon.update_params(10, params)
        with self.assertRaisesRegex(ValueError, "step -1 is negative"):
            self.mon.update_params(-1, [{"name": "final_norm.weight", "weight_decay": 0.1}])
        with self.assertRaisesRegex(ValueError, "update_params: step 9223372036854775808 is above the largest step"):
            self.mon.update_params(2 ** 63, [{"name": "final_norm.weight", "weight_decay": 0.1}])
        self.assertEqual(self.mon.stats().queued, 0)  # nothing queued by a refused call

    def test_steps_above_2_63_minus_1_are_refused_before_they_are_queued(self) -> None:
        for step in (2 ** 63, 2 ** 64 - 1, 10 ** 30):
            with self.subTest(step=step):
                with self.assertRaisesRegex(ValueError, f"step {step} is above the largest step the daemon keeps, "
                                                        "9223372036854775807"):
                    self.mon.log(step, {"train/loss": 1.0})
                with self.assertRaisesRegex(ValueError, "event: step .* is above the largest step"):
                    self.mon.event(step, "past the end")
        self.assertEqual(self.mon.stats().queued, 0)
        self.assertTrue(self.mon.log(2 ** 63 - 1, {"train/loss": 1.0}))

    def test_a_valid_change_is_queued(self) -> None:
        self.mon.log(1, {"grad/norm/layers.1.attn.weight": 0.3})  # log() extends the catalog
        self.assertTrue(self.mon.update_params(2, [
            {"name": "final_norm.weight", "weight_decay": 0.1, "kind": "norm", "role": "final_norm", "group": ""},
            {"name": "layers.1.attn.weight", "weight_decay": 0}]))
        self.assertEqual(self.mon.stats().queued, 2)  # the step and the update


class RadialUpdateMessageTest(unittest.TestCase):
    """updates/radial/<param> goes into the step's ParamStats.radial_update; no daemon is needed."""

    def setUp(self) -> None:
        self.mon = gradwatch.Monitor("py-radial", address="127.0.0.1:1", params=CATALOG, start=False)
        self.stream = self.mon._streams[0]

    def tearDown(self) -> None:
        self.mon.close(finished=False, timeout=1)

    def built(self) -> dict:
        """The last queued step as the stream writes it: parameter name -> ParamStats."""
        message = self.stream._message(self.stream._pending[-1])
        names = [p.name for p in self.stream._params]
        return {names[p.index]: p for p in message.step.params}

    def test_the_key_is_split_as_a_parameters(self) -> None:
        self.assertEqual(_catalog.split_key("updates/radial/final_norm.weight"), ("radial", "final_norm.weight"))
        self.assertIsNone(_catalog.split_key("updates/radial/"))

    def test_a_radial_update_is_signed_and_a_squared_one_is_a_dot(self) -> None:
        self.assertTrue(self.mon.log(1, {"updates/radial/x": -0.25, "params/norm/x": 2.0}))
        x = self.built()["x"]  # a parameter the catalog lacked: added
        self.assertEqual(x.radial_update.WhichOneof("value"), "radial")
        self.assertEqual(x.radial_update.radial, -0.25)
        self.assertEqual(x.param.norm, 2.0)
        self.assertTrue(self.mon.log(2, {"updates/radial/x": -0.5, "params/norm/x": 4.0}, squared=True))
        x = self.built()["x"]
        self.assertEqual(x.radial_update.WhichOneof("value"), "dot")
        self.assertEqual(x.radial_update.dot, -0.5)
        self.assertEqual(x.param.sq_sum, 4.0)
        self.assertTrue(self.mon.log(3, {"updates/radial/final_norm.weight": float("nan")}))
        self.assertTrue(math.isnan(self.built()["final_norm.weight"].radial_update.radial))

    def test_a_dot_without_the_ranks_parameter_norm_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, r"'updates/radial/lm_head.weight' with squared=True is this rank's "
                                                r".*log 'params/norm/lm_head.weight' with it"):
            self.mon.log(1, {"updates/radial/lm_head.weight": 0.1, "grad/norm/lm_head.weight": 1.0}, squared=True)
        self.assertEqual(self.mon.stats().queued, 0)


class TlsTest(unittest.TestCase):
    """A daemon that requires client certificates (mutual TLS), with certificates the test makes."""

    def setUp(self) -> None:
        self.certs = tempfile.mkdtemp(prefix="gradwatch-py-certs-")
        make_test_certs(self.certs)
        def read(name: str) -> bytes:
            with open(self.cert(name), "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
        self.daemon = Daemon(
            "log: {level: info}\nsecurity:\n"
            f"  tls_cert_file: {self.cert('server.pem')}\n  tls_key_file: {self.cert('server.key')}\n"
            f"  tls_client_ca_file: {self.cert('ca.pem')}\n", credentials)

    def tearDown(self) -> None:
        self.daemon.close()
        shutil.rmtree(self.certs, ignore_errors=True)

    def cert(self, name: str) -> str:
        return os.path.join(self.certs, name)

    def test_steps_reach_a_daemon_that_requires_client_certificates(self) -> None:
        with gradwatch.Monitor("py-tls", address=self.daemon.address, params=CATALOG, tls_ca=self.cert("ca.pem"),
                               tls_cert=self.cert("client.pem"), tls_key=self.cert("client.key")) as mon:
            for s in range(1, 21):
                self.assertTrue(mon.log(s, metrics(s)))
            self.assertTrue(mon.flush(30))
        self.assertEqual(self.daemon.run("py-tls").info.step_count, 20)

    def test_the_environment_gives_the_files(self) -> None:
        saved = dict(os.environ)
        os.environ.update(GRADWATCH_TLS_CA=self.cert("ca.pem"), GRADWATCH_TLS_CERT=self.cert("client.pem"),
                          GRADWATCH_TLS_KEY=self.cert("client.key"))
        try:
            with gradwatch.Monitor("py-tls-env", address=self.daemon.address, params=CATALOG) as mon:
                self.assertTrue(mon.log(1, metrics(1)))
                self.assertTrue(mon.flush(30))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.assertEqual(self.daemon.run("py-tls-env").info.step_count, 1)

    def test_a_client_without_the_right_certificate_gets_nothing_in(self) -> None:
        for tls in ({}, {"tls_ca": self.cert("ca.pem")},
                    {"tls_ca": self.cert("ca.pem"), "tls_cert": self.cert("other-client.pem"),
                     "tls_key": self.cert("other-client.key")}):
            mon = gradwatch.Monitor("py-tls-refused", address=self.daemon.address, params=CATALOG, **tls)
            try:
                self.assertTrue(mon.log(1, metrics(1)))  # queued: training never blocks
                self.assertFalse(mon.flush(2), tls)
            finally:
                mon.close(finished=False, timeout=1)
        with self.assertRaises(grpc.RpcError):
            self.daemon.run("py-tls-refused")

    def test_files_that_cannot_be_read_are_named(self) -> None:
        with self.assertRaisesRegex(ValueError, "cannot read the TLS CA file .*missing.pem"):
            gradwatch.Monitor("py-tls-bad", address=self.daemon.address, tls_ca=self.cert("missing.pem"))
        with self.assertRaisesRegex(ValueError, "tls_cert and tls_key go together"):
            gradwatch.Monitor("py-tls-bad", address=self.daemon.address, tls_cert=self.cert("client.pem"))


class TokenTest(unittest.TestCase):
    """A daemon with security.tokens_file: the token goes with the stream; a missing one is refused."""

    def setUp(self) -> None:
        import hashlib
        self.dir = tempfile.mkdtemp(prefix="gradwatch-py-tokens-")
        tokens = os.path.join(self.dir, "tokens.yaml")
        with open(tokens, "w") as f:
            f.write("tokens:\n  - {name: trainer, sha256: %s, scopes: [write, read], runs: [\"py-*\"]}\n"
                    % hashlib.sha256(b"py-secret").hexdigest())
        self.daemon = Daemon(f"log: {{level: info}}\nsecurity: {{tokens_file: {tokens}}}\n")

    def tearDown(self) -> None:
        self.daemon.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_the_token_is_sent_and_runs_outside_its_patterns_are_refused(self) -> None:
        with gradwatch.Monitor("py-token", address=self.daemon.address, params=CATALOG, token="py-secret") as mon:
            self.assertTrue(mon.log(1, metrics(1)))
            self.assertTrue(mon.flush(30))
        refused = []
        for run, token in (("py-none", None), ("other-run", "py-secret")):
            mon = gradwatch.Monitor(run, address=self.daemon.address, params=CATALOG, token=token,
                                    on_error=lambda e: refused.append(e.message))
            mon.log(1, metrics(1))
            self.assertFalse(mon.flush(3))
            mon.close(finished=False, timeout=1)
        self.assertTrue(any("requires a bearer token" in m for m in refused), refused)
        self.assertTrue(any("may write only runs matching py-*" in m for m in refused), refused)



def in_threads(*calls):
    """Runs each call on a thread of its own; their results, in order, once all returned."""
    results = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300 * time_scale())
        if t.is_alive():
            raise AssertionError("a call did not return in 300 s")
    return results


class StorageFaultTest(unittest.TestCase):
    """A daemon whose data directory is a small tmpfs, filled up until its journal fails to commit: it
    refuses steps and events with the retryable ERROR_REASON_STORAGE_UNAVAILABLE until the filler
    file is deleted. The Monitor keeps everything refused and sends it again after its back-off."""

    def setUp(self) -> None:
        mnt = mount_tmpfs(self, 16)
        self.filler = os.path.join(mnt, "filler")
        self.daemon = Daemon(data_dir=os.path.join(mnt, "data"))
        self.addCleanup(self.daemon.close)  # before the unmount
        self.addCleanup(self.free)  # before the daemon stops, which writes its snapshots

    def free(self) -> None:
        if os.path.exists(self.filler):
            os.unlink(self.filler)

    def monitor(self, run: str, **kwargs) -> gradwatch.Monitor:
        mon = gradwatch.Monitor(run, address=self.daemon.address, params=CATALOG, **kwargs)
        self.addCleanup(mon.close, finished=False, timeout=0)  # a no-op once the test closed it
        wait_for(lambda: mon.stats().connected, 60, f"{run}'s stream to be accepted")
        return mon

    def wait_refused(self, *monitors: gradwatch.Monitor) -> None:
        """Keeps the disk full until each monitor got a STORAGE_UNAVAILABLE (more than it had). Each
        must have something to send the daemon does not hold already: what it received before its
        journal failed is held (awaiting the commit), not refused."""
        before = [m.stats().errors_by_reason.get(STORAGE_UNAVAILABLE, 0) for m in monitors]

        def refused() -> bool:
            fill(self.filler)  # the daemon may have freed some room since
            return all(m.stats().errors_by_reason.get(STORAGE_UNAVAILABLE, 0) > b for m, b in zip(monitors, before))

        wait_for(refused, 60, "the daemon to refuse with STORAGE_UNAVAILABLE")

    def test_steps_and_an_event_refused_on_a_full_disk_are_kept_and_delivered_once(self) -> None:
        mon = self.monitor("py-full", initial_backoff=0.05, max_backoff=0.5)
        fill_until_refused(self.daemon.address, self.filler)
        for s in range(1, 2001):
            self.assertTrue(mon.log(s, metrics(s)))
            if s == 1000:
                self.assertTrue(mon.event(s, "routing switch"))
        self.wait_refused(mon)
        fill(self.filler)

        with self.assertLogs("gradwatch", "WARNING") as logs:
            self.assertFalse(mon.flush(2))  # nothing more becomes durable while the disk is full
        gave_up = [r.getMessage() for r in logs.records if "flush gave up" in r.getMessage()]
        self.assertEqual(len(gave_up), 1, logs.output)
        counts = re.search(r"(\d+) steps and (\d+) events not acknowledged", gave_up[0])
        self.assertIsNotNone(counts, gave_up[0])
        self.assertTrue(1 <= int(counts[1]) <= 2000, gave_up[0])
        self.assertEqual(int(counts[2]), 1, gave_up[0])
        stats = mon.stats()
        self.assertTrue(stats.storage_retrying)
        self.assertEqual((stats.dropped, stats.refused, stats.rejected), (0, 0, False), stats)
        self.assertGreaterEqual(stats.queued + stats.unacked, int(counts[1]))
        self.assertLess(self.daemon.run("py-full").info.step_count, 2000)

        self.free()
        self.assertTrue(mon.flush(120))
        stats = mon.stats()
        self.assertEqual(stats.acked_through_step, 2000)
        self.assertEqual((stats.queued, stats.unacked, stats.dropped, stats.refused), (0, 0, 0, 0), stats)
        self.assertFalse(stats.storage_retrying)
        # Nothing was refused for good: no resend came back as a regression or a conflict.
        self.assertEqual(set(stats.errors_by_reason), {STORAGE_UNAVAILABLE}, stats)
        self.assertGreaterEqual(stats.reconnects, 1)
        self.assertTrue(mon.close(finished=True, timeout=60))

        run = self.daemon.run("py-full")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.step_count, 2000)
        losses = self.daemon.points("py-full", "train/loss")
        self.assertEqual([p.step for p in losses], list(range(1, 2001)))
        for p in losses:
            self.assertAlmostEqual(p.value, 3.0 - p.step * 1e-3, places=9)
        self.assertEqual([(e.step, e.text) for e in run.events], [(1000, "routing switch")])

    def test_flush_and_close_shorter_than_the_back_off_wait_for_one_reconnect(self) -> None:
        backoff = 6.0  # every reconnect waits 4.8 to 7.2 s; each call below gives 1 s
        mons = {run: self.monitor(run, initial_backoff=backoff, max_backoff=backoff)
                for run in ("py-short-flush", "py-short-close", "py-short-finish")}
        fill_until_refused(self.daemon.address, self.filler)
        for mon in mons.values():
            for s in range(1, 51):
                self.assertTrue(mon.log(s, metrics(s)))
            self.assertTrue(mon.event(25, "routing switch"))
        self.wait_refused(*mons.values())  # each now backs off before it tries again

        # Still full: each call gives up, but only once a reconnect was tried and refused again.
        flushing, closing = mons["py-short-flush"], mons["py-short-close"]
        before = {run: m.stats() for run, m in mons.items()}
        fill(self.filler)
        flushed, closed = in_threads(lambda: flushing.flush(1), lambda: closing.close(finished=True, timeout=1))
        self.assertFalse(flushed)
        self.assertFalse(closed)
        for run in ("py-short-flush", "py-short-close"):
            after = mons[run].stats()
            self.assertGreater(after.errors_by_reason[STORAGE_UNAVAILABLE],
                               before[run].errors_by_reason[STORAGE_UNAVAILABLE], run)
            self.assertGreater(after.reconnects, before[run].reconnects, run)
            self.assertEqual((after.dropped, after.refused), (0, 0), run)
        self.assertFalse(closing.stats().finished)
        self.assertNotEqual(self.daemon.run("py-short-close").info.state, pb.RUN_STATE_FINISHED)

        # Room again: the calls wait for the reconnect after the back-off, which delivers everything.
        self.free()
        wait_for(lambda: "storage recovered" in self.daemon.log(), 60, "the daemon's journal to recover")
        finishing = mons["py-short-finish"]
        flushed, finished = in_threads(lambda: flushing.flush(1), lambda: finishing.close(finished=True, timeout=1))
        self.assertTrue(flushed)
        self.assertTrue(finished)
        self.assertTrue(flushing.close(finished=True, timeout=60))
        for run in ("py-short-flush", "py-short-finish"):
            stats = mons[run].stats()
            self.assertEqual((stats.acked_through_step, stats.dropped, stats.refused), (50, 0, 0), run)
            info = self.daemon.run(run)
            self.assertEqual(info.info.state, pb.RUN_STATE_FINISHED, run)
            self.assertEqual([p.step for p in self.daemon.points(run, "train/loss")], list(range(1, 51)), run)
            self.assertEqual([(e.step, e.text) for e in info.events], [(25, "routing switch")], run)


class PermanentErrorTest(unittest.TestCase):
    """An Error that is not retryable refuses the step it names for good: dropped and counted, the rest delivered."""

    def setUp(self) -> None:
        self.daemon = Daemon()

    def tearDown(self) -> None:
        self.daemon.close()

    def test_a_conflicting_step_is_refused_and_counted_and_the_others_are_kept(self) -> None:
        mon = gradwatch.Monitor("py-conflict", address=self.daemon.address, params=CATALOG)
        for s in range(1, 11):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(30))
        mon.log(10, metrics(10, total=9.0))  # step 10 again, other values: STEP_CONFLICT
        for s in range(11, 21):
            mon.log(s, metrics(s))
        self.assertTrue(mon.flush(30))
        stats = mon.stats()
        self.assertEqual((stats.refused, stats.dropped, stats.acked_through_step), (1, 0, 20), stats)
        self.assertEqual(stats.errors_by_reason, {"ERROR_REASON_STEP_CONFLICT": 1})
        self.assertTrue(mon.close())
        self.assertEqual([p.step for p in self.daemon.points("py-conflict", "train/loss")], list(range(1, 21)))


if __name__ == "__main__":
    unittest.main()
