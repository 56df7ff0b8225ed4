"""gradwatch.torch.Watch on a small model, against the real gradwatchd."""

import os
import socket
import sys
import threading
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradwatch
import gradwatch.torch as gwt
from gradwatch._catalog import Param, parse_kind
from gradwatch.v1 import gradwatch_pb2 as pb
from support import STORAGE_UNAVAILABLE, Daemon, fill, fill_until_refused, mount_tmpfs, time_scale, wait_for

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "examples"))
from tiny_trainer import RMSNorm  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.final_norm = RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(torch.relu(self.mlp(self.embed(tokens)))))


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if "norm" not in n and not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)


def move_into_new_group(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, weight_decay: float) -> None:
    """What a trainer does by hand to give one parameter its own weight decay."""
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p is not param]
    optimizer.add_param_group({"params": [param], "weight_decay": weight_decay})


def contingency(param: str = "final_norm.weight", wd: str = "0.1") -> pb.Alert:
    """A firing GradNormContingency whose diagnosis supports weight decay on `param`."""
    return pb.Alert(name="GradNormContingency", state=pb.ALERT_STATE_FIRING, step=5,
                    annotations={"remediation_param": param, "remediation_weight_decay": wd,
                                 "remediation_supported": "true", "remediation_why": "the final norm grew"})


def train_step(model, optimizer, generator):
    tokens = torch.randint(0, 32, (4, 8), generator=generator)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    return loss


class WatchTest(unittest.TestCase):
    def setUp(self) -> None:
        torch.manual_seed(0)
        self.daemon = Daemon()

    def tearDown(self) -> None:
        self.daemon.close()

    def test_catalog_and_norms_equal_those_torch_computes(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        init = {n: p.detach().norm().item() for n, p in model.named_parameters()}
        watch = gwt.Watch(model, opt, run="torch-basic", address=self.daemon.address, update_norms=True)
        generator = torch.Generator().manual_seed(1)
        expected = {}
        for step in range(1, 21):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss = train_step(model, opt, generator)
            expected[step] = {
                "grad": {n: p.grad.norm().item() for n, p in model.named_parameters()},
                "param": {n: p.detach().norm().item() for n, p in model.named_parameters()},
                "update": {n: (p.detach() - before[n]).norm().item() for n, p in model.named_parameters()},
                "total": torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in model.parameters()])).item(),
                "loss": loss.item(),
            }
            self.assertTrue(watch.step(step, loss=loss))
            opt.zero_grad()
        self.assertTrue(watch.close())

        run = self.daemon.run("torch-basic")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.step_count, 20)
        params = {p.name: p for p in run.params}
        self.assertEqual(params["final_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["final_norm.weight"].weight_decay, 0.0)
        self.assertEqual(params["final_norm.weight"].role, "final_norm")
        self.assertEqual(params["lm_head.weight"].kind, pb.PARAM_KIND_OUTPUT)
        self.assertAlmostEqual(params["lm_head.weight"].weight_decay, 0.1)
        self.assertEqual(params["embed.weight"].kind, pb.PARAM_KIND_EMBEDDING)
        rates = self.daemon.points("torch-basic", "optim/learning_rate")
        self.assertEqual(len(rates), 20)
        self.assertAlmostEqual(rates[-1].value, opt.param_groups[0]["lr"], places=12)
        self.assertEqual(params["mlp.bias"].weight_decay, 0.0)
        self.assertEqual(params["mlp.weight"].numel, 16 * 16)
        for name, norm in init.items():
            self.assertAlmostEqual(params[name].init_norm, norm, places=4)

        def series(key):
            return {p.step: p.value for p in self.daemon.points("torch-basic", key)}

        total = series("grad/norm/total")
        loss = series("train/loss")
        for step, e in expected.items():
            self.assertAlmostEqual(total[step], e["total"], delta=1e-5 * e["total"])
            self.assertAlmostEqual(loss[step], e["loss"], places=5)
        for name in init:
            for field, prefix in (("grad", "grad/norm/"), ("param", "params/norm/"), ("update", "updates/norm/")):
                got = series(prefix + name)
                for step, e in expected.items():
                    want = e[field][name]
                    self.assertAlmostEqual(got[step], want, delta=1e-5 * max(want, 1e-12), msg=f"{prefix}{name}@{step}")

    def test_radial_updates_from_adam_state_reach_the_daemon(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        watch = gwt.Watch(model, opt, run="torch-radial", address=self.daemon.address, radial_updates=True)
        generator = torch.Generator().manual_seed(2)
        expected = {}
        for step in range(1, 11):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            train_step(model, opt, generator)
            expected[step] = {n: (torch.dot((p.detach() - before[n]).flatten(), before[n].flatten())
                                  / before[n].norm()).item() for n, p in model.named_parameters()}
            self.assertTrue(watch.step(step))
            opt.zero_grad()
        self.assertTrue(watch.close())
        for name in expected[1]:
            got = {p.step: p.value for p in self.daemon.points("torch-radial", "updates/radial/" + name)}
            self.assertEqual(sorted(got), list(range(1, 11)), msg=name)
            weight = model.get_parameter(name).detach().norm().item()
            for step, e in expected.items():
                # float32 rounding of the stepped weight bounds the error (see RadialUpdateTest).
                self.assertAlmostEqual(got[step], e[name], delta=1e-5 * abs(e[name]) + 2 ** -22 * weight,
                                       msg=f"updates/radial/{name}@{step}")

    def test_a_model_with_layernorm_and_zero_initialised_tensors_is_accepted(self) -> None:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
        torch.nn.init.zeros_(model[2].weight)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        watch = gwt.Watch(model, opt, run="torch-layernorm", address=self.daemon.address)
        init = {p.name: p.init_norm for p in watch.catalog}
        self.assertIsNone(init["1.bias"], "a LayerNorm's bias starts at zero: its init norm is unknown")
        self.assertIsNone(init["2.weight"])
        self.assertAlmostEqual(init["1.weight"], 8 ** 0.5, places=5)  # float32 ones
        for step in range(1, 4):
            loss = model(torch.randn(2, 8)).square().mean()
            loss.backward()
            opt.step()
            self.assertTrue(watch.step(step, loss=loss))
            opt.zero_grad()
        self.assertTrue(watch.close())
        run = self.daemon.run("torch-layernorm")
        self.assertEqual(run.info.step_count, 3)
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)

    def test_every_n_steps_and_kind_overrides(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        with gwt.Watch(model, opt, run="torch-every", address=self.daemon.address, every=5,
                       kinds={"mlp.weight": "router"}) as watch:
            generator = torch.Generator().manual_seed(2)
            sent = [s for s in range(1, 21) if watch.step(s, loss=train_step(model, opt, generator))]
            opt.zero_grad()
        self.assertEqual(sent, [5, 10, 15, 20])
        params = {p.name: p for p in self.daemon.run("torch-every").params}
        self.assertEqual(params["mlp.weight"].kind, pb.PARAM_KIND_ROUTER)
        self.assertEqual([p.step for p in self.daemon.points("torch-every", "grad/norm/total")], [5, 10, 15, 20])
        with self.assertRaises(ValueError):
            gwt.Watch(model, opt, run="x", address=self.daemon.address, kinds={"nope.weight": "mlp"})

    def catalog_events(self, run: str) -> list:
        return [e for e in self.daemon.run(run).events if e.source == "catalog"]

    def test_weight_decay_changed_by_hand_reaches_the_runs_catalog(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        generator = torch.Generator().manual_seed(3)
        with gwt.Watch(model, opt, run="torch-wd", address=self.daemon.address) as watch:
            for step in range(1, 16):
                if step == 6:
                    move_into_new_group(opt, model.final_norm.weight, 0.1)
                if step == 11:
                    opt.param_groups[0]["weight_decay"] = 0.05  # the decayed parameters' group
                self.assertTrue(watch.step(step, loss=train_step(model, opt, generator)))
                opt.zero_grad()
            self.assertTrue(watch.monitor.flush(30))
            self.assertEqual(watch.monitor.stats().catalog_updates_sent, 2)
        params = {p.name: p for p in self.daemon.run("torch-wd").params}
        self.assertAlmostEqual(params["final_norm.weight"].weight_decay, 0.1)
        for name in ("embed.weight", "mlp.weight", "lm_head.weight"):
            self.assertAlmostEqual(params[name].weight_decay, 0.05, msg=name)
        self.assertEqual(params["mlp.bias"].weight_decay, 0.0)
        events = self.catalog_events("torch-wd")
        self.assertEqual([e.step for e in events], [6, 11])
        self.assertIn("final_norm.weight", events[0].text)
        self.assertIn("lm_head.weight", events[1].text)
        self.assertNotIn("final_norm.weight", events[1].text)
        self.assertNotIn("mlp.bias", events[1].text)

    def test_a_remediation_reaches_the_runs_catalog(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        remedy = gwt.Remediation(model, opt)
        generator = torch.Generator().manual_seed(4)
        with gwt.Watch(model, opt, run="torch-remedy", address=self.daemon.address, on_alert=remedy,
                       remediation=remedy) as watch:
            for step in range(1, 11):
                if step == 6:
                    remedy(contingency())  # as the daemon's alert would, on the Monitor's thread
                self.assertTrue(watch.step(step, loss=train_step(model, opt, generator)))
                opt.zero_grad()
        self.assertEqual(remedy.applied, {"final_norm.weight": 0.1})
        run = self.daemon.run("torch-remedy")
        self.assertAlmostEqual({p.name: p for p in run.params}["final_norm.weight"].weight_decay, 0.1)
        self.assertEqual([(e.step, e.text) for e in run.events if e.source == "trainer"],
                         [(6, "gradwatch remediation: weight decay 0.1 on final_norm.weight (was 0)")])
        [event] = self.catalog_events("torch-remedy")
        self.assertEqual(event.step, 6)
        self.assertIn("final_norm.weight", event.text)


class RemediationTest(unittest.TestCase):
    def test_the_remediation_fields_are_read_and_applied_once_between_steps(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        remedy = gwt.Remediation(model, opt)

        def alert(supported="true", name="GradNormContingency", state=pb.ALERT_STATE_FIRING, param="final_norm.weight",
                  wd="0.05"):
            return pb.Alert(name=name, state=state, step=1000,
                            annotations={"remediation_param": param, "remediation_weight_decay": wd,
                                         "remediation_supported": supported,
                                         "remediation_why": "final_norm.weight has not grown significantly"})

        remedy(alert(state=pb.ALERT_STATE_PENDING))
        remedy(alert(name="OtherAlert", param="mlp.weight"))
        self.assertEqual(remedy.apply(), [])
        with self.assertLogs("gradwatch", "WARNING") as logs:
            remedy(alert(supported="false"))  # the evidence does not hold the cause
        self.assertIn("final_norm.weight has not grown significantly", logs.output[0])
        self.assertEqual(remedy.pending, {})
        remedy(alert())
        self.assertEqual(remedy.applied, {})  # applied by the training loop, not the alert's thread
        events = remedy.apply()
        self.assertEqual(events, ["gradwatch remediation: weight decay 0.05 on final_norm.weight (was 0)"])
        self.assertEqual(remedy.applied, {"final_norm.weight": 0.05})
        remedy(alert(wd="0.1"))
        self.assertEqual(remedy.apply(), [])  # once
        groups = [g for g in opt.param_groups if any(p is model.final_norm.weight for p in g["params"])]
        self.assertEqual([(len(g["params"]), g["weight_decay"]) for g in groups], [(1, 0.05)])
        self.assertEqual(sum(len(g["params"]) for g in opt.param_groups), len(list(model.parameters())))

    def test_the_watch_marks_the_final_norm_and_sends_the_learning_rate(self) -> None:
        catalog = [Param(name="blocks.0.norm.weight", numel=4), Param(name="blocks.0.mlp.weight", numel=16),
                   Param(name="head_norm.weight", numel=4, kind="norm_gain"), Param(name="lm_head.weight", numel=16)]
        self.assertIs(gwt._final_norm(catalog), catalog[2])  # the last norm gain before the output layer
        catalog.append(Param(name="model.norm.weight", numel=4))
        self.assertIs(gwt._final_norm(catalog), catalog[4])  # named like a final norm
        self.assertIsNone(gwt._final_norm([Param(name="lm_head.weight", numel=16)]))


class RecordingMonitor:
    """The training loop's side of a Monitor, recording what the Watch queues; `accept` is what
    update_params answers (False: not queued)."""

    def __init__(self) -> None:
        self.logs = []  # (step, metrics, squared)
        self.updates = []
        self.events = []
        self.accept = True

    def log(self, step, metrics, squared=False) -> bool:
        self.logs.append((step, dict(metrics), squared))
        return True

    def event(self, step, text) -> bool:
        self.events.append((step, text))
        return True

    def update_params(self, step, params) -> bool:
        self.updates.append((step, list(params)))
        return self.accept


class FakeEvent:
    """A CUDA event's part the copy path uses, completed by the test: query() is False until done."""

    made = []

    def __init__(self) -> None:
        self.done = False
        self.recorded = False
        self.synchronized = False
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized = True
        self.done = True


class DeviceCopyTest(unittest.TestCase):
    """The CUDA path (a pinned buffer written with non_blocking=True, read when its event is done)
    through its seam on the CPU: plain buffers and events the test completes."""

    def setUp(self) -> None:
        FakeEvent.made = []
        torch.manual_seed(0)
        self.model = Tiny()
        self.opt = optimizer_for(self.model)
        self.gen = torch.Generator().manual_seed(1)

    def watches(self):
        """A Watch on the copy path and one on the CPU path, each with its RecordingMonitor."""
        asynchronous, synchronous = RecordingMonitor(), RecordingMonitor()
        a = gwt.Watch(self.model, self.opt, monitor=asynchronous, update_norms=True)
        a._copies = gwt._HostCopies(lambda n: torch.empty(n, dtype=torch.float64), FakeEvent)
        s = gwt.Watch(self.model, self.opt, monitor=synchronous, update_norms=True)
        return a, asynchronous, s, synchronous

    def test_a_step_is_sent_by_a_later_step_once_its_copy_is_done_with_the_values_read_at_once(self) -> None:
        a, amon, s, smon = self.watches()
        for step in (1, 2, 3):
            loss = train_step(self.model, self.opt, self.gen)
            self.assertTrue(a.step(step, loss=loss.detach(), metrics={"train/tokens": 28}))
            s.step(step, loss=loss.detach(), metrics={"train/tokens": 28})
            self.opt.zero_grad()
            # The copy of this step is not done: nothing waited for it, it stays queued.
            self.assertTrue(FakeEvent.made[-1].recorded)
            self.assertFalse(any(e.synchronized for e in FakeEvent.made))
            self.assertEqual([log[0] for log in amon.logs], list(range(1, step)))
            FakeEvent.made[-1].done = True
        a.step(4)  # sends step 3, whose copy is done; step 4's own copy stays pending
        self.assertEqual([log[0] for log in amon.logs], [1, 2, 3])
        for (step, got, _), (_, want, _) in zip(amon.logs, smon.logs):
            self.assertEqual(got.keys(), want.keys(), f"step {step}")
            for key in want:
                self.assertAlmostEqual(got[key], want[key], places=9, msg=f"step {step} {key}")

    def test_copies_are_sent_in_step_order_and_close_waits_for_the_last(self) -> None:
        a, amon, _, _ = self.watches()
        amon.close = lambda finished=True, timeout=None: True
        for step in (1, 2, 3):
            train_step(self.model, self.opt, self.gen)
            a.step(step)
            self.opt.zero_grad()
        FakeEvent.made[1].done = True  # step 2's copy is done, step 1's is not: nothing goes out of order
        train_step(self.model, self.opt, self.gen)
        a.step(4)
        self.assertEqual(amon.logs, [])
        FakeEvent.made[0].done = True
        a.step(5)
        self.assertEqual([log[0] for log in amon.logs], [1, 2])
        self.assertTrue(a.close())
        self.assertEqual([log[0] for log in amon.logs], [1, 2, 3, 4, 5])
        self.assertTrue(all(e.synchronized for e in FakeEvent.made[2:]))
        self.assertFalse(FakeEvent.made[0].synchronized)

    def test_buffers_are_reused_once_read(self) -> None:
        made = []

        def buffer(n):
            made.append(n)
            return torch.empty(n, dtype=torch.float64)

        copies = gwt._HostCopies(buffer, FakeEvent)
        first = copies.start(torch.arange(4, dtype=torch.float64))
        FakeEvent.made[-1].done = True
        self.assertEqual(copies.values(first, wait=False), [0.0, 1.0, 2.0, 3.0])
        second = copies.start(torch.arange(3, dtype=torch.float64) + 10)
        self.assertIsNone(copies.values(second, wait=False))
        self.assertEqual(copies.values(second, wait=True), [10.0, 11.0, 12.0])
        self.assertEqual(made, [4], "the second copy reused the first one's buffer")

    @unittest.skipUnless(torch.cuda.is_available(), "no CUDA device here: the copy path runs through its seam above")
    def test_on_cuda_the_training_thread_never_synchronizes(self) -> None:
        model = Tiny().cuda()
        opt = optimizer_for(model)
        mon = RecordingMonitor()
        mon.close = lambda finished=True, timeout=None: True
        watch = gwt.Watch(model, opt, monitor=mon, update_norms=True, radial_updates=True)
        tokens = torch.randint(0, 32, (4, 8), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(1, 6):
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
                loss.backward()
                opt.step()
                watch.step(step, loss=loss.detach())
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        watch.close()
        self.assertEqual([log[0] for log in mon.logs], [1, 2, 3, 4, 5])
        self.assertIn("train/loss", mon.logs[-1][1])


class LearningRateTest(unittest.TestCase):
    def test_a_param_group_with_its_own_learning_rate_sends_it_per_parameter(self) -> None:
        torch.manual_seed(0)
        model = Tiny()
        opt = optimizer_for(model)
        move_into_new_group(opt, model.final_norm.weight, 0.0)
        opt.param_groups[-1]["lr"] = 0.1
        mon = RecordingMonitor()
        watch = gwt.Watch(model, opt, monitor=mon)
        train_step(model, opt, torch.Generator().manual_seed(1))
        watch.step(1)
        metrics = mon.logs[-1][1]
        self.assertEqual(metrics["optim/learning_rate"], 1e-2)
        self.assertEqual(metrics["optim/learning_rate/final_norm.weight"], 0.1)
        # Parameters in groups at the run's rate get no key of their own.
        self.assertEqual([k for k in metrics if k.startswith("optim/learning_rate/")],
                         ["optim/learning_rate/final_norm.weight"])


class WeightDecayChangeTest(unittest.TestCase):
    """Watch.step reports the weight decays that changed in the param groups, and only those."""

    def setUp(self) -> None:
        torch.manual_seed(0)
        self.model = Tiny()
        self.opt = optimizer_for(self.model)
        self.mon = RecordingMonitor()

    def test_only_changes_are_reported_and_a_change_not_queued_is_tried_again(self) -> None:
        watch = gwt.Watch(self.model, self.opt, monitor=self.mon, init_norms=False)
        watch.step(1)
        self.assertEqual(self.mon.updates, [])
        move_into_new_group(self.opt, self.model.final_norm.weight, 0.1)
        watch.step(2)
        watch.step(3)
        self.assertEqual(self.mon.updates, [(2, [{"name": "final_norm.weight", "weight_decay": 0.1}])])
        self.opt.param_groups[0]["weight_decay"] = 0.05
        watch.step(4)
        self.assertEqual(self.mon.updates[1:], [(4, [{"name": n, "weight_decay": 0.05}
                                                     for n in ("embed.weight", "mlp.weight", "lm_head.weight")])])
        # A group of tensors the model does not have changes the groups but no watched weight decay.
        self.opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.3})
        watch.step(5)
        self.assertEqual(len(self.mon.updates), 2)
        self.mon.accept = False
        self.opt.param_groups[-2]["weight_decay"] = 0.2  # final_norm.weight's own group
        watch.step(6)
        watch.step(7)
        self.mon.accept = True
        watch.step(8)
        watch.step(9)
        change = [{"name": "final_norm.weight", "weight_decay": 0.2}]
        self.assertEqual(self.mon.updates[2:], [(6, change), (7, change), (8, change)])

    def test_a_remediation_is_reported_at_the_step_that_applies_it(self) -> None:
        remedy = gwt.Remediation(self.model, self.opt, weight_decay=0.05)
        watch = gwt.Watch(self.model, self.opt, monitor=self.mon, init_norms=False, remediation=remedy)
        watch.step(1)
        remedy(contingency())
        watch.step(2)
        watch.step(3)
        self.assertEqual(self.mon.events, [(2, "gradwatch remediation: weight decay 0.05 on final_norm.weight (was 0)")])
        self.assertEqual(self.mon.updates, [(2, [{"name": "final_norm.weight", "weight_decay": 0.05}])])

    def test_a_change_the_monitor_cannot_take_is_logged_once(self) -> None:
        mon = gradwatch.Monitor("torch-partial", address="127.0.0.1:1", params=["lm_head.weight"], start=False)
        try:
            watch = gwt.Watch(self.model, self.opt, monitor=mon, init_norms=False)
            move_into_new_group(self.opt, self.model.final_norm.weight, 0.1)
            with self.assertLogs("gradwatch", "WARNING") as logs:
                watch.step(1)
            self.assertIn("'final_norm.weight' is not in the catalog", logs.output[0])
            with self.assertNoLogs("gradwatch", "WARNING"):
                watch.step(2)
        finally:
            mon.close(finished=False, timeout=1)


def tree(**children: torch.nn.Module) -> torch.nn.Module:
    """A module holding `children` under their names: a model family's module tree, names and all."""
    module = torch.nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def linear(n_in: int, n_out: int, bias: bool = False) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out, bias=bias)


def each_layer(layers: int, kinds: dict) -> dict:
    """{name with {i}: kind} for layers 0 .. layers - 1."""
    return {name.format(i=i): kind for i in range(layers) for name, kind in kinds.items()}


class MoEGate(torch.nn.Module):
    """DeepSeek's router: a [n_experts, hidden] weight of its own (and V3's score correction)."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))
        self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(experts))


H, F, V = 8, 16, 32  # hidden, MLP width, vocabulary


def llama(layers: int = 2) -> torch.nn.Module:  # Llama, Mistral, Qwen2 (Hugging Face)
    def layer():
        return tree(self_attn=tree(q_proj=linear(H, H), k_proj=linear(H, H), v_proj=linear(H, H), o_proj=linear(H, H)),
                    mlp=tree(gate_proj=linear(H, F), up_proj=linear(H, F), down_proj=linear(F, H)),
                    input_layernorm=RMSNorm(H), post_attention_layernorm=RMSNorm(H))
    return tree(model=tree(embed_tokens=torch.nn.Embedding(V, H),
                           layers=torch.nn.ModuleList(layer() for _ in range(layers)), norm=RMSNorm(H)),
                lm_head=linear(H, V))


LLAMA = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm_gain", "lm_head.weight": "output",
         **each_layer(2, {"model.layers.{i}.self_attn.q_proj.weight": "attention",
                          "model.layers.{i}.self_attn.k_proj.weight": "attention",
                          "model.layers.{i}.self_attn.v_proj.weight": "attention",
                          "model.layers.{i}.self_attn.o_proj.weight": "attention",
                          "model.layers.{i}.mlp.gate_proj.weight": "mlp",
                          "model.layers.{i}.mlp.up_proj.weight": "mlp",
                          "model.layers.{i}.mlp.down_proj.weight": "mlp",
                          "model.layers.{i}.input_layernorm.weight": "norm_gain",
                          "model.layers.{i}.post_attention_layernorm.weight": "norm_gain"})}


def gpt2(layers: int = 2) -> torch.nn.Module:
    def block():
        return tree(ln_1=torch.nn.LayerNorm(H),
                    attn=tree(c_attn=linear(H, 3 * H, bias=True), c_proj=linear(H, H, bias=True)),
                    ln_2=torch.nn.LayerNorm(H), mlp=tree(c_fc=linear(H, F, bias=True), c_proj=linear(F, H, bias=True)))
    return tree(transformer=tree(wte=torch.nn.Embedding(V, H), wpe=torch.nn.Embedding(16, H),
                                 h=torch.nn.ModuleList(block() for _ in range(layers)), ln_f=torch.nn.LayerNorm(H)),
                lm_head=linear(H, V))


GPT2 = {"transformer.wte.weight": "embedding", "transformer.wpe.weight": "embedding",
        "transformer.ln_f.weight": "norm_gain", "transformer.ln_f.bias": "norm_gain", "lm_head.weight": "output",
        **each_layer(2, {"transformer.h.{i}.ln_1.weight": "norm_gain", "transformer.h.{i}.ln_1.bias": "norm_gain",
                         "transformer.h.{i}.attn.c_attn.weight": "attention",
                         "transformer.h.{i}.attn.c_attn.bias": "attention",
                         "transformer.h.{i}.attn.c_proj.weight": "attention",  # c_proj inside attn
                         "transformer.h.{i}.attn.c_proj.bias": "attention",
                         "transformer.h.{i}.ln_2.weight": "norm_gain", "transformer.h.{i}.ln_2.bias": "norm_gain",
                         "transformer.h.{i}.mlp.c_fc.weight": "mlp", "transformer.h.{i}.mlp.c_fc.bias": "mlp",
                         "transformer.h.{i}.mlp.c_proj.weight": "mlp",  # c_proj inside mlp
                         "transformer.h.{i}.mlp.c_proj.bias": "mlp"})}


def mixtral(experts: int = 4) -> torch.nn.Module:
    # hidden = experts: the gate's weight is square, a router by the experts beside it.
    h = experts
    layer = tree(self_attn=tree(q_proj=linear(h, h), k_proj=linear(h, h), v_proj=linear(h, h), o_proj=linear(h, h)),
                 block_sparse_moe=tree(gate=linear(h, experts), experts=torch.nn.ModuleList(
                     tree(w1=linear(h, F), w2=linear(F, h), w3=linear(h, F)) for _ in range(experts))),
                 input_layernorm=RMSNorm(h), post_attention_layernorm=RMSNorm(h))
    return tree(model=tree(embed_tokens=torch.nn.Embedding(V, h), layers=torch.nn.ModuleList([layer]), norm=RMSNorm(h)),
                lm_head=linear(h, V))


MIXTRAL = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm_gain", "lm_head.weight": "output",
           "model.layers.0.input_layernorm.weight": "norm_gain",
           "model.layers.0.post_attention_layernorm.weight": "norm_gain",
           "model.layers.0.block_sparse_moe.gate.weight": "router",
           **{f"model.layers.0.self_attn.{m}.weight": "attention" for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
           **{f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": "mlp"
              for e in range(4) for w in ("w1", "w2", "w3")}}


def deepseek_moe() -> torch.nn.Module:
    def swiglu():
        return tree(gate_proj=linear(H, F), up_proj=linear(H, F), down_proj=linear(F, H))

    def layer(mlp):
        return tree(self_attn=tree(q_proj=linear(H, H), kv_a_proj_with_mqa=linear(H, H), kv_a_layernorm=RMSNorm(H),
                                   kv_b_proj=linear(H, 2 * H), o_proj=linear(H, H)),
                    mlp=mlp, input_layernorm=RMSNorm(H), post_attention_layernorm=RMSNorm(H))
    moe = tree(gate=MoEGate(4, H), experts=torch.nn.ModuleList(swiglu() for _ in range(2)), shared_experts=swiglu())
    # A first dense layer, then an MoE one.
    return tree(model=tree(embed_tokens=torch.nn.Embedding(V, H),
                           layers=torch.nn.ModuleList([layer(swiglu()), layer(moe)]), norm=RMSNorm(H)),
                lm_head=linear(H, V))


DEEPSEEK = {"model.embed_tokens.weight": "embedding", "model.norm.weight": "norm_gain", "lm_head.weight": "output",
            **each_layer(2, {"model.layers.{i}.self_attn.q_proj.weight": "attention",
                             "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight": "attention",
                             "model.layers.{i}.self_attn.kv_a_layernorm.weight": "norm_gain",
                             "model.layers.{i}.self_attn.kv_b_proj.weight": "attention",
                             "model.layers.{i}.self_attn.o_proj.weight": "attention",
                             "model.layers.{i}.input_layernorm.weight": "norm_gain",
                             "model.layers.{i}.post_attention_layernorm.weight": "norm_gain"}),
            **{f"model.layers.0.mlp.{m}.weight": "mlp" for m in ("gate_proj", "up_proj", "down_proj")},
            "model.layers.1.mlp.gate.weight": "router", "model.layers.1.mlp.gate.e_score_correction_bias": "router",
            **{f"model.layers.1.mlp.{e}.{m}.weight": "mlp" for e in ("experts.0", "experts.1", "shared_experts")
               for m in ("gate_proj", "up_proj", "down_proj")}}


def megatron(layers: int = 2) -> torch.nn.Module:  # Megatron-LM's legacy GPT (and GPT-NeoX, BLOOM, Falcon's names)
    def layer():
        return tree(input_layernorm=torch.nn.LayerNorm(H),
                    self_attention=tree(query_key_value=linear(H, 3 * H, bias=True), dense=linear(H, H, bias=True)),
                    post_attention_layernorm=torch.nn.LayerNorm(H),
                    mlp=tree(dense_h_to_4h=linear(H, F, bias=True), dense_4h_to_h=linear(F, H, bias=True)))
    return tree(language_model=tree(
        embedding=tree(word_embeddings=torch.nn.Embedding(V, H), position_embeddings=torch.nn.Embedding(16, H)),
        encoder=tree(layers=torch.nn.ModuleList(layer() for _ in range(layers)), final_layernorm=torch.nn.LayerNorm(H)),
        output_layer=linear(H, V)))


MEGATRON = {"language_model.embedding.word_embeddings.weight": "embedding",
            "language_model.embedding.position_embeddings.weight": "embedding",
            "language_model.encoder.final_layernorm.weight": "norm_gain",
            "language_model.encoder.final_layernorm.bias": "norm_gain",
            "language_model.output_layer.weight": "output",
            **each_layer(2, {f"language_model.encoder.layers.{{i}}.{name}": kind for name, kind in {
                "input_layernorm.weight": "norm_gain", "input_layernorm.bias": "norm_gain",
                "self_attention.query_key_value.weight": "attention",
                "self_attention.query_key_value.bias": "attention",
                "self_attention.dense.weight": "attention", "self_attention.dense.bias": "attention",
                "post_attention_layernorm.weight": "norm_gain", "post_attention_layernorm.bias": "norm_gain",
                "mlp.dense_h_to_4h.weight": "mlp", "mlp.dense_h_to_4h.bias": "mlp",
                "mlp.dense_4h_to_h.weight": "mlp", "mlp.dense_4h_to_h.bias": "mlp"}.items()})}


class TELinear(torch.nn.Linear):
    """Transformer Engine's LayerNormLinear: the layer norm's gain is a parameter of the linear layer."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out, bias=False)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(n_in))


def megatron_core() -> torch.nn.Module:
    layer = tree(self_attention=tree(linear_qkv=TELinear(H, 3 * H), linear_proj=linear(H, H)),
                 mlp=tree(linear_fc1=TELinear(H, F), linear_fc2=linear(F, H)))
    return tree(embedding=tree(word_embeddings=torch.nn.Embedding(V, H)),
                decoder=tree(layers=torch.nn.ModuleList([layer]), final_layernorm=torch.nn.LayerNorm(H)),
                output_layer=linear(H, V))


MEGATRON_CORE = {"embedding.word_embeddings.weight": "embedding", "output_layer.weight": "output",
                 "decoder.final_layernorm.weight": "norm_gain", "decoder.final_layernorm.bias": "norm_gain",
                 "decoder.layers.0.self_attention.linear_qkv.weight": "attention",
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norm_gain",
                 "decoder.layers.0.self_attention.linear_proj.weight": "attention",
                 "decoder.layers.0.mlp.linear_fc1.weight": "mlp",
                 "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": "norm_gain",
                 "decoder.layers.0.mlp.linear_fc2.weight": "mlp"}


def torchtitan_llama(layers: int = 2) -> torch.nn.Module:
    def block():
        return tree(attention=tree(wq=linear(H, H), wk=linear(H, H), wv=linear(H, H), wo=linear(H, H)),
                    feed_forward=tree(w1=linear(H, F), w2=linear(F, H), w3=linear(H, F)),
                    attention_norm=RMSNorm(H), ffn_norm=RMSNorm(H))
    return tree(tok_embeddings=torch.nn.Embedding(V, H),
                layers=torch.nn.ModuleDict({str(i): block() for i in range(layers)}),
                norm=RMSNorm(H), output=linear(H, V))


TORCHTITAN = {"tok_embeddings.weight": "embedding", "norm.weight": "norm_gain", "output.weight": "output",
              **each_layer(2, {"layers.{i}.attention.wq.weight": "attention",
                               "layers.{i}.attention.wk.weight": "attention",
                               "layers.{i}.attention.wv.weight": "attention",
                               "layers.{i}.attention.wo.weight": "attention",
                               "layers.{i}.feed_forward.w1.weight": "mlp", "layers.{i}.feed_forward.w2.weight": "mlp",
                               "layers.{i}.feed_forward.w3.weight": "mlp",
                               "layers.{i}.attention_norm.weight": "norm_gain",
                               "layers.{i}.ffn_norm.weight": "norm_gain"})}


class KindTest(unittest.TestCase):
    """The kind Watch's catalog gives each parameter (infer_kinds) on the module trees of the common
    model families, with their real module names."""

    def catalog_kinds(self, model: torch.nn.Module, **watch_kwargs) -> dict:
        watch = gwt.Watch(model, torch.optim.SGD(model.parameters(), lr=0.1), monitor=RecordingMonitor(),
                          init_norms=False, **watch_kwargs)
        kinds = {p.name: p.kind for p in watch.catalog}
        # What the daemon gets: each kind a name it knows.
        self.assertEqual([p.to_proto(0.0).kind for p in watch.catalog], [parse_kind(k) for k in kinds.values()])
        self.assertEqual(list(kinds), [n for n, _ in model.named_parameters()])
        return kinds

    def assert_kinds(self, model: torch.nn.Module, expected: dict) -> None:
        kinds = self.catalog_kinds(model)
        self.assertEqual(kinds, expected)  # every parameter, none "other"
        self.assertEqual(gwt.infer_kinds(model), expected)

    def test_llama_and_mistral(self) -> None:
        self.assert_kinds(llama(), LLAMA)

    def test_gpt2_c_proj_by_its_parent(self) -> None:
        self.assert_kinds(gpt2(), GPT2)

    def test_mixtral_router_and_experts(self) -> None:
        self.assert_kinds(mixtral(), MIXTRAL)

    def test_deepseek_moe_gate_is_the_router_and_its_experts_mlp(self) -> None:
        self.assert_kinds(deepseek_moe(), DEEPSEEK)

    def test_megatron(self) -> None:
        self.assert_kinds(megatron(), MEGATRON)
        self.assert_kinds(megatron_core(), MEGATRON_CORE)

    def test_torchtitan_llama(self) -> None:
        self.assert_kinds(torchtitan_llama(), TORCHTITAN)

    def test_the_final_norm_of_each_family(self) -> None:
        for model, final in ((llama(), "model.norm.weight"), (gpt2(), "transformer.ln_f.weight"),
                             (megatron(), "language_model.encoder.final_layernorm.weight"),
                             (torchtitan_llama(), "norm.weight")):
            watch = gwt.Watch(model, torch.optim.SGD(model.parameters(), lr=0.1), monitor=RecordingMonitor(),
                              init_norms=False)
            self.assertEqual([p.name for p in watch.catalog if p.role == "final_norm"], [final])

    def test_only_whole_names_match(self) -> None:
        model = tree(
            update_gate=linear(H, H),           # not "up", not the router "gate"
            upsample=linear(H, H), downsample=torch.nn.Sequential(linear(H, H)),  # not up_proj, down_proj
            output_layernorm=torch.nn.LayerNorm(H),  # a norm gain, not the output layer
            output_proj=linear(H, H), gating=linear(H, 2), uplift=linear(H, H),
            gate=linear(H, H),                  # square and without experts: not a router
            dense=linear(H, H), key=linear(H, H), c_proj=linear(H, H),  # attention only inside an attention module
            blocks=torch.nn.ModuleList([tree(
                qkv=linear(H, 3 * H), attn_out=linear(H, H),           # the example trainer's
                mlp=tree(gate=linear(H, F), up=linear(H, F), down=linear(F, H)),  # a SwiGLU's gate: [F, H], no experts
                proj=tree(gate_proj=linear(H, F)))]))
        self.assertEqual(self.catalog_kinds(model), {
            "update_gate.weight": "other", "upsample.weight": "other", "downsample.0.weight": "other",
            "output_layernorm.weight": "norm_gain", "output_layernorm.bias": "norm_gain",
            "output_proj.weight": "other", "gating.weight": "other", "uplift.weight": "other", "gate.weight": "other",
            "dense.weight": "other", "key.weight": "other", "c_proj.weight": "other",
            "blocks.0.qkv.weight": "attention", "blocks.0.attn_out.weight": "attention",
            "blocks.0.mlp.gate.weight": "mlp", "blocks.0.mlp.up.weight": "mlp", "blocks.0.mlp.down.weight": "mlp",
            "blocks.0.proj.gate_proj.weight": "mlp"})

    def test_overrides_win_and_other_modules_keep_their_kinds(self) -> None:
        model = llama(layers=1)
        kinds = self.catalog_kinds(model, kinds={"model.layers.0.mlp.up_proj.weight": "router"})
        self.assertEqual(kinds["model.layers.0.mlp.up_proj.weight"], "router")
        self.assertEqual(kinds["model.layers.0.mlp.down_proj.weight"], "mlp")
        # A bare nn.Embedding, a MultiheadAttention and a norm layer of any name, a bias with its weight.
        model = tree(tokens=torch.nn.Embedding(V, H), mixer=torch.nn.MultiheadAttention(H, 2),
                     scale=torch.nn.GroupNorm(2, H), head=linear(H, V, bias=True))
        self.assertEqual(self.catalog_kinds(model), {
            "tokens.weight": "embedding", "mixer.in_proj_weight": "attention", "mixer.in_proj_bias": "attention",
            "mixer.out_proj.weight": "attention", "mixer.out_proj.bias": "attention",
            "scale.weight": "norm_gain", "scale.bias": "norm_gain", "head.weight": "other", "head.bias": "other"})


# The floor of the tolerance, relative to |w| + |Δw|: the step rounds each element of w(t+1) to float32
# (by up to 2**-24 of it), which the optimizer's state does not record, so r from the state may be off
# by 2**-24·|w| whatever r is; twice that covers the arithmetic too.
ROUNDING = 2.0 ** -23


def radial_reference(before: torch.Tensor, after: torch.Tensor) -> tuple:
    """r = ⟨Δw, w⟩/|w| of a step from copies of the weight before and after it, in float64, and the
    tolerance of a value computed in float32: 1e-5 relative, plus ROUNDING·(|w| + |Δw|)."""
    w = before.double()
    dw = after.double() - w
    r = (dw * w).sum().item() / w.norm().item()
    return r, 1e-5 * abs(r) + ROUNDING * (w.norm().item() + dw.norm().item())


class Gain(torch.nn.Module):
    """A norm gain at ones: loss() pushes it outward (sign +1), inward (-1) or not at all (0)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def loss(self, sign: float) -> torch.Tensor:
        return -sign * self.weight.sum()


class RadialUpdateTest(unittest.TestCase):
    """Watch(radial_updates=True): updates/radial/<param> from Adam's state or from update_norms'
    copy, held against r computed from copies of the weights; no daemon."""

    def setUp(self) -> None:
        torch.manual_seed(0)

    def train(self, model, opt, watch, mon, steps: int, seed: int = 5):
        """Trains `steps` steps; yields (step, r sent per name, (r, tolerance) from copies per name)."""
        generator = torch.Generator().manual_seed(seed)
        for step in range(1, steps + 1):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            train_step(model, opt, generator)
            self.assertTrue(watch.step(step))
            opt.zero_grad()
            logged_step, metrics, squared = mon.logs[-1]
            self.assertEqual((logged_step, squared), (step, False))
            sent = {k[len("updates/radial/"):]: v for k, v in metrics.items() if k.startswith("updates/radial/")}
            yield step, sent, {n: radial_reference(before[n], p.detach()) for n, p in model.named_parameters()}

    def test_from_adam_state_it_equals_r_from_a_copy(self) -> None:
        def adamw(model, **kwargs):
            return torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)

        cases = {
            "AdamW, weight decay 0": lambda m: adamw(m, weight_decay=0.0),
            "AdamW, weight decay 0.1 on some groups": optimizer_for,
            "AdamW, amsgrad": lambda m: adamw(m, weight_decay=0.1, amsgrad=True),
            "AdamW, foreach and maximize": lambda m: adamw(m, weight_decay=0.1, foreach=True, maximize=True),
            "Adam, L2 weight decay": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1),
            "Adam, amsgrad, betas": lambda m: torch.optim.Adam(m.parameters(), lr=3e-3, betas=(0.8, 0.95),
                                                               eps=1e-6, amsgrad=True),
        }
        for case, make in cases.items():
            with self.subTest(case):
                model = Tiny()
                opt = make(model)
                mon = RecordingMonitor()
                watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True)
                for step, sent, want in self.train(model, opt, watch, mon, steps=6):
                    self.assertEqual(set(sent), set(want), f"step {step}")
                    for name, (r, tolerance) in want.items():
                        self.assertAlmostEqual(sent[name], r, delta=tolerance, msg=f"{name} at step {step}")
                self.assertFalse(any(k.startswith("updates/norm/") for k in mon.logs[-1][1]))  # no copy kept

    def test_its_sign_says_whether_the_step_grows_the_norm(self) -> None:
        lr, dim = 1e-2, 8
        for sign, wd in ((1.0, 0.0), (-1.0, 0.0), (0.0, 0.5)):
            with self.subTest(sign=sign, weight_decay=wd):
                model = Gain(dim)
                opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
                mon = RecordingMonitor()
                watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True)
                for step in range(1, 4):
                    norm_before = model.weight.detach().norm().item()
                    model.loss(sign).backward()
                    opt.step()
                    watch.step(step)
                    opt.zero_grad()
                    r = mon.logs[-1][1]["updates/radial/weight"]
                    # Adam moves each element by lr·sign (its gradient is the same at every step);
                    # without a gradient, AdamW's decay alone scales the weight by 1 − lr·wd.
                    want = sign * lr * dim ** 0.5 if wd == 0 else -lr * wd * norm_before
                    self.assertAlmostEqual(r, want, delta=1e-5 * abs(want), msg=f"step {step}")
                    self.assertEqual(r > 0, sign > 0)

    def test_from_the_copy_of_update_norms_with_any_optimizer(self) -> None:
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        mon = RecordingMonitor()
        watch = gwt.Watch(model, opt, monitor=mon, update_norms=True, radial_updates=True)
        for step, sent, want in self.train(model, opt, watch, mon, steps=5):
            self.assertEqual(set(sent), set(want), f"step {step}")
            for name, (r, tolerance) in want.items():
                self.assertAlmostEqual(sent[name], r, delta=tolerance, msg=f"{name} at step {step}")

    def test_without_a_copy_or_adam_nothing_is_sent_and_why_is_logged_once(self) -> None:
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mon = RecordingMonitor()
        with self.assertLogs("gradwatch", "WARNING") as logs:
            watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True)
        [line] = logs.output
        self.assertIn("no updates/radial/ for 5 parameters (embed.weight, mlp.weight, mlp.bias, final_norm.weight, "
                      "lm_head.weight): torch.optim.sgd.SGD is not torch.optim.Adam or AdamW", line)
        self.assertIn("update_norms=True", line)
        generator = torch.Generator().manual_seed(6)
        with self.assertNoLogs("gradwatch", "WARNING"):
            for step in range(1, 3):
                train_step(model, opt, generator)
                watch.step(step)
                opt.zero_grad()
        self.assertFalse(any(k.startswith("updates/radial/") for _, metrics, _ in mon.logs for k in metrics))

    def test_a_parameter_without_adam_state_is_skipped_and_one_not_stepped_sends_0(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        mon = RecordingMonitor()
        watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True)
        generator = torch.Generator().manual_seed(7)
        late = model.final_norm.weight

        def step(n: int, late_grad: bool) -> dict:
            before = late.detach().clone()
            tokens = torch.randint(0, 32, (4, 8), generator=generator)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1)).backward()
            if not late_grad:
                late.grad = None  # the optimizer leaves it: no state at first, then no step
            opt.step()
            watch.step(n)
            opt.zero_grad()
            self.assertEqual(torch.equal(before, late.detach()), not late_grad)
            return mon.logs[-1][1]

        with self.assertLogs("gradwatch", "WARNING") as logs:
            metrics = step(1, late_grad=False)
        self.assertNotIn("updates/radial/final_norm.weight", metrics)  # skipped, not sent as 0
        self.assertIn("updates/radial/lm_head.weight", metrics)
        [line] = logs.output
        self.assertIn("no updates/radial/ for 1 parameter (final_norm.weight): no Adam state", line)
        with self.assertNoLogs("gradwatch", "WARNING"):
            step(2, late_grad=False)
            metrics = step(3, late_grad=True)
        self.assertNotEqual(metrics["updates/radial/final_norm.weight"], 0.0)
        metrics = step(4, late_grad=False)
        self.assertEqual(metrics["updates/radial/final_norm.weight"], 0.0)  # w(t+1) = w(t)
        self.assertNotEqual(metrics["updates/radial/lm_head.weight"], 0.0)

    def test_unsent_steps_keep_the_step_counts(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        mon = RecordingMonitor()
        watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True, every=3)
        generator = torch.Generator().manual_seed(8)
        for step in range(1, 7):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            train_step(model, opt, generator)
            watch.step(step)
            opt.zero_grad()
        self.assertEqual([s for s, _, _ in mon.logs], [3, 6])
        sent = mon.logs[-1][1]
        for name, p in model.named_parameters():  # the last step's update, not the 3 since step 3
            r, tolerance = radial_reference(before[name], p.detach())
            self.assertAlmostEqual(sent[f"updates/radial/{name}"], r, delta=tolerance, msg=name)

    def test_the_radial_update_reaches_the_step_message(self) -> None:
        mon = gradwatch.Monitor("torch-radial", address="127.0.0.1:1", start=False)
        try:
            model = Tiny()
            opt = optimizer_for(model)
            watch = gwt.Watch(model, opt, monitor=mon, radial_updates=True)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            train_step(model, opt, torch.Generator().manual_seed(9))
            self.assertTrue(watch.step(1))
            stream = mon._streams[0]
            message = stream._message(stream._pending[-1])
            names = [p.name for p in stream._params]
            sent = {names[p.index]: p for p in message.step.params}
            for name, p in model.named_parameters():
                self.assertEqual(sent[name].radial_update.WhichOneof("value"), "radial", name)
                r, tolerance = radial_reference(before[name], p.detach())
                self.assertAlmostEqual(sent[name].radial_update.radial, r, delta=tolerance, msg=name)
        finally:
            mon.close(finished=False, timeout=1)


def _sharded_rank(rank: int, world: int, port: int, out) -> None:
    """A rank of a sharded model (each rank its own shard: its own Tiny), reporting to a recorder."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = Tiny()
    opt = optimizer_for(model)
    mon = RecordingMonitor()
    watch = gwt.Watch(model, opt, monitor=mon, sharded=True, radial_updates=True)
    generator = torch.Generator().manual_seed(20 + rank)
    want = {}
    for step in range(1, 4):
        before = {n: p.detach().clone().double() for n, p in model.named_parameters()}
        train_step(model, opt, generator)
        watch.step(step)
        opt.zero_grad()
        want[step] = {}
        for n, p in model.named_parameters():
            dw = p.detach().double() - before[n]
            # ⟨Δw_s, w_s⟩, and its tolerance (radial_reference's, times |w_s|).
            dot, w = (dw * before[n]).sum().item(), before[n].norm().item()
            want[step][n] = (dot, 1e-5 * abs(dot) + ROUNDING * (w + dw.norm().item()) * w)
    out.put((rank, mon.logs, want))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_rank(rank: int, world: int, port: int, address: str, out) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Tiny())
    opt = optimizer_for(model)
    watch = gwt.Watch(model, opt, run="torch-ddp", address=address)
    generator = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    totals, losses = {}, {}
    for step in range(1, 11):
        loss = train_step(model, opt, generator)
        totals[step] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        losses[step] = loss.item()
        watch.step(step, loss=loss)
        opt.zero_grad()
    out.put((rank, totals, losses, watch.monitor.flush(60)))
    watch.close(finished=False)
    dist.destroy_process_group()


class ShardedRadialTest(unittest.TestCase):
    def test_each_rank_of_a_sharded_model_sends_its_partial_inner_product(self) -> None:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_sharded_rank, args=(r, 2, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=60)
            self.assertEqual(p.exitcode, 0)
        for rank, logs, want in results:
            self.assertEqual([(s, squared) for s, _, squared in logs], [(1, True), (2, True), (3, True)])
            for step, metrics, _ in logs:
                for name, (dot, tolerance) in want[step].items():
                    self.assertIn(f"params/norm/{name}", metrics)  # the daemon divides by the merged norm
                    self.assertAlmostEqual(metrics[f"updates/radial/{name}"], dot, delta=tolerance,
                                           msg=f"rank {rank} {name} at step {step}")


class DistributedTest(unittest.TestCase):
    def setUp(self) -> None:
        self.daemon = Daemon()

    def tearDown(self) -> None:
        self.daemon.close()

    def test_ddp_on_two_processes_reports_the_model_once_and_averages_the_loss(self) -> None:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, self.daemon.address, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, totals, losses, flushed = out.get(timeout=120)
            self.assertTrue(flushed)
            results[rank] = (totals, losses)
        for p in procs:
            p.join(timeout=60)
            self.assertEqual(p.exitcode, 0)
        run = self.daemon.run("torch-ddp")
        self.assertEqual(run.info.world_size, 2)
        self.assertEqual(run.info.step_count, 10)
        self.assertEqual(run.info.partial_steps, 0)
        total = {p.step: p.value for p in self.daemon.points("torch-ddp", "grad/norm/total")}
        loss = {p.step: p.value for p in self.daemon.points("torch-ddp", "train/loss")}
        for step in range(1, 11):
            # DDP averages the gradients: both ranks hold the same; rank 0 reported them.
            self.assertAlmostEqual(results[0][0][step], results[1][0][step], places=5)
            self.assertAlmostEqual(total[step], results[0][0][step], delta=1e-5 * results[0][0][step])
            self.assertAlmostEqual(loss[step], (results[0][1][step] + results[1][1][step]) / 2, places=5)


class WatchStorageFaultTest(unittest.TestCase):
    """A Watch whose daemon's data directory is a small tmpfs, filled up until its journal fails to
    commit: the daemon refuses steps and events with the retryable ERROR_REASON_STORAGE_UNAVAILABLE
    until the filler file is deleted."""

    def setUp(self) -> None:
        torch.manual_seed(0)
        mnt = mount_tmpfs(self, 16)
        self.filler = os.path.join(mnt, "filler")
        self.daemon = Daemon(data_dir=os.path.join(mnt, "data"))
        self.addCleanup(self.daemon.close)  # before the unmount
        self.addCleanup(self.free)  # before the daemon stops, which writes its snapshots

    def free(self) -> None:
        if os.path.exists(self.filler):
            os.unlink(self.filler)

    def refusals(self, mon: gradwatch.Monitor) -> int:
        return mon.stats().errors_by_reason.get(STORAGE_UNAVAILABLE, 0)

    def test_close_confirms_every_step_only_once_the_disk_has_room_again(self) -> None:
        model = Tiny()
        opt = optimizer_for(model)
        watch = gwt.Watch(model, opt, run="torch-full", address=self.daemon.address, initial_backoff=0.05,
                          max_backoff=0.5)
        self.addCleanup(watch.close, finished=False, timeout=0)  # a no-op once the test closed it
        mon = watch.monitor
        wait_for(lambda: mon.stats().connected, 60, "the stream to be accepted")
        fill_until_refused(self.daemon.address, self.filler)
        generator = torch.Generator().manual_seed(1)
        losses = {}
        for step in range(1, 301):
            loss = train_step(model, opt, generator)
            losses[step] = loss.item()
            self.assertTrue(watch.step(step, loss=loss))
            opt.zero_grad()
            if step == 150:
                self.assertTrue(mon.event(step, "lr drop"))
        wait_for(lambda: fill(self.filler) or self.refusals(mon) > 0, 60,
                 "the daemon to refuse with STORAGE_UNAVAILABLE")
        fill(self.filler)
        self.assertFalse(mon.flush(2))
        stats = mon.stats()
        self.assertTrue(stats.storage_retrying)
        self.assertEqual((stats.dropped, stats.refused), (0, 0), stats)

        # close(finished=True) while the disk is full keeps everything and tries again, unconfirmed...
        before = self.refusals(mon)
        result = []
        closing = threading.Thread(target=lambda: result.append(watch.close(finished=True,
                                                                            timeout=120 * time_scale())))
        closing.start()
        wait_for(lambda: fill(self.filler) or self.refusals(mon) > before, 60, "the close's resends to be refused")
        self.assertTrue(closing.is_alive())
        self.assertEqual(result, [])
        self.assertNotEqual(self.daemon.run("torch-full").info.state, pb.RUN_STATE_FINISHED)
        # ...until the disk has room again: then every step and the event are delivered, once.
        self.free()
        closing.join(300 * time_scale())
        self.assertFalse(closing.is_alive())
        self.assertEqual(result, [True])
        stats = mon.stats()
        self.assertEqual((stats.acked_through_step, stats.dropped, stats.refused), (300, 0, 0), stats)
        self.assertTrue(stats.finished)
        self.assertEqual(set(stats.errors_by_reason), {STORAGE_UNAVAILABLE}, stats)

        run = self.daemon.run("torch-full")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.step_count, 300)
        points = self.daemon.points("torch-full", "train/loss")
        self.assertEqual([p.step for p in points], list(range(1, 301)))
        for p in points:
            self.assertAlmostEqual(p.value, losses[p.step], places=5)
        self.assertEqual([p.step for p in self.daemon.points("torch-full", "grad/norm/total")], list(range(1, 301)))
        self.assertEqual([(e.step, e.text) for e in run.events], [(150, "lr drop")])


if __name__ == "__main__":
    unittest.main()
