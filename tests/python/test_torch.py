"""gradwatch.torch.Watch on a small model, against the real gradwatchd."""

import os
import socket
import sys
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradwatch
import gradwatch.torch as gwt
from gradwatch._catalog import Param
from gradwatch.v1 import gradwatch_pb2 as pb
from support import Daemon

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
        self.updates = []
        self.events = []
        self.accept = True

    def log(self, step, metrics, squared=False) -> bool:
        return True

    def event(self, step, text) -> bool:
        self.events.append((step, text))
        return True

    def update_params(self, step, params) -> bool:
        self.updates.append((step, list(params)))
        return self.accept


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


if __name__ == "__main__":
    unittest.main()
