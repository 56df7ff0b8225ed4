"""deploy/examples/tiny_trainer.py, run small and fast against the real gradwatchd."""

import contextlib
import io
import os
import signal
import sys
import tempfile
import unittest

import torch

from gradwatch.v1 import gradwatch_pb2 as pb
from support import Daemon, wait_for

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "examples"))
import tiny_trainer  # noqa: E402

SMALL = ["--layers", "1", "--dim", "16", "--heads", "2", "--vocab", "32", "--seq", "8", "--batch", "4"]

# A tiny run's own bounds: its final norm, given a learning rate that makes it drift, grows about 2x by step 40
# while the lm_head carries 60-80% of the squared grad norm and the total climbs past 1.8. Its 80 steps are all
# "first steps" by the default alerts.min_steps_before_page: the page is not held here.
LOW_CONTINGENCY = """
alerts:
  default_rules: false
  rule_files: [{rules}]
  min_steps_before_page: 0
"""
RULES = """
groups:
  - name: test
    rules:
      - alert: GradNormContingency
        kind: threshold
        series: grad/norm/total
        op: ">="
        value: 1.8
        for_steps: 2
        labels: {severity: page}
        annotations:
          summary: "Total grad norm {{ value }} at step {{ step }}"
          recommendation: "{{ recommendation }}"
      - alert: NormGainGrowing
        kind: growth_without_decay
        param_kind: norm_gain
        min_amplification: 1.5
        labels: {severity: warning}
      - alert: LmHeadShare
        kind: share
        param_kind: output
        min_share: 0.5
        labels: {severity: warning}
"""


class TinyTrainerTest(unittest.TestCase):
    def tearDown(self) -> None:
        self.daemon.close()

    def test_catalog_values_a_daemon_restart_and_a_clean_finish(self) -> None:
        self.daemon = Daemon()
        expected = {}

        def hook(step, model, loss, optimizer):
            grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
            expected[step] = {
                "total": torch.linalg.vector_norm(torch.tensor(list(grads.values()), dtype=torch.float64)).item(),
                "final_norm": model.final_norm.weight.detach().norm().item(),
                "lm_head_grad": grads["lm_head.weight"],
                "loss": loss.item(),
            }
            if step == 15:
                self.daemon.restart(signal.SIGKILL)  # mid-run: the trainer keeps going

        args = tiny_trainer.parse_args(["--run", "tiny", "--address", self.daemon.address, "--steps", "40"] + SMALL)
        self.assertEqual(tiny_trainer.train(args, hook), 0)
        run = self.daemon.run("tiny")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.step_count, 40)
        params = {p.name: p for p in run.params}
        self.assertEqual(params["final_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["final_norm.weight"].weight_decay, 0.0)
        self.assertEqual(params["blocks.0.attn_norm.weight"].kind, pb.PARAM_KIND_NORM_GAIN)
        self.assertEqual(params["lm_head.weight"].kind, pb.PARAM_KIND_OUTPUT)
        self.assertAlmostEqual(params["lm_head.weight"].weight_decay, 0.1)
        self.assertAlmostEqual(params["final_norm.weight"].init_norm, 4.0, places=5)  # ones(16)

        def series(key):
            return {p.step: p.value for p in self.daemon.points("tiny", key)}

        total, norm, head, loss = (series(k) for k in ("grad/norm/total", "params/norm/final_norm.weight",
                                                         "grad/norm/lm_head.weight", "train/loss"))
        self.assertEqual(sorted(total), list(range(1, 41)))  # nothing lost across the restart
        for step, e in expected.items():
            self.assertAlmostEqual(total[step], e["total"], delta=1e-5 * e["total"])
            self.assertAlmostEqual(norm[step], e["final_norm"], delta=1e-5 * e["final_norm"])
            self.assertAlmostEqual(head[step], e["lm_head_grad"], delta=1e-5 * e["lm_head_grad"])
            self.assertAlmostEqual(loss[step], e["loss"], places=5)

    def test_a_crash_and_a_resume_from_the_checkpoint_rewind_the_run(self) -> None:
        self.daemon = Daemon()
        with tempfile.TemporaryDirectory() as ckpt:
            common = ["--run", "tiny-resume", "--address", self.daemon.address, "--steps", "40",
                      "--checkpoint-dir", ckpt, "--checkpoint-every", "10"] + SMALL
            self.assertEqual(tiny_trainer.train(tiny_trainer.parse_args(common + ["--stop-at", "25"])), 0)
            self.assertEqual(self.daemon.run("tiny-resume").info.last_step, 25)
            losses = {}
            self.assertEqual(tiny_trainer.train(tiny_trainer.parse_args(common + ["--resume"]),
                                                lambda step, model, loss, opt: losses.__setitem__(step, loss.item())), 0)
        self.assertEqual(min(losses), 21)  # resumed from the checkpoint of step 20
        run = self.daemon.run("tiny-resume")
        self.assertEqual(run.info.state, pb.RUN_STATE_FINISHED)
        self.assertEqual(run.info.last_step, 40)
        self.assertEqual(run.info.step_count, 40)
        kept = {p.step: p.value for p in self.daemon.points("tiny-resume", "train/loss")}
        self.assertEqual(sorted(kept), list(range(1, 41)))
        for step in range(21, 41):  # the resumed process's values replaced the first one's
            self.assertAlmostEqual(kept[step], losses[step], places=5)

    def test_remediation_gives_the_final_norm_weight_decay_when_the_contingency_fires(self) -> None:
        rules_dir = tempfile.mkdtemp(prefix="gradwatch-rules-")
        rules = os.path.join(rules_dir, "rules.yaml")
        with open(rules, "w") as f:
            f.write(RULES)
        self.daemon = Daemon("log: {level: info}\n" + LOW_CONTINGENCY.format(rules=rules))
        args = tiny_trainer.parse_args(["--run", "tiny-fix", "--address", self.daemon.address, "--steps", "80",
                                        "--final-norm-lr", "0.1", "--remediate"] + SMALL)
        seen = {}

        def hook(step, model, loss, optimizer):
            seen["model"], seen["optimizer"] = model, optimizer
            if step == 70:
                # The page fired near step 40 on the daemon, with the evidence (the final norm grown without
                # decay, the lm_head's share) and so a supported remedy; it reaches the trainer's stream when it
                # does (later under a sanitizer): wait for it, so that a later step applies it.
                remedy = seen["watch"].remediation
                wait_for(lambda: bool(remedy.pending or remedy.applied), 60, "the contingency alert at the trainer")

        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            self.assertEqual(tiny_trainer.train(args, hook, on_watch=lambda w: seen.update(watch=w)), 0)
        opt, model = seen["optimizer"], seen["model"]
        # What the trainer printed: the page with its what-if, the catalog change, the daemon's check.
        text = printed.getvalue()
        self.assertIn("gradwatch alert: GradNormContingency firing at step", text)
        self.assertIn("With weight decay 0.1 from step", text)
        self.assertIn("(its learning rate 0.1;", text)  # the final norm's own param group's
        self.assertRegex(text, r"catalog change at step \d+: weight decay 0.1 on final_norm.weight")
        self.assertRegex(text, r"remediation check: final_norm.weight weight decay 0 -> 0.1 at step \d+: "
                               r"(too early|working|faster than projected|slower than projected|not working) "
                               r"\(norm [0-9.]+ then")
        # The final norm's weight now sits alone in a group with the run's decay.
        final = model.final_norm.weight
        owning = [g for g in opt.param_groups if any(p is final for p in g["params"])]
        self.assertEqual(len(owning), 1)
        self.assertEqual(len(owning[0]["params"]), 1)
        self.assertAlmostEqual(owning[0]["weight_decay"], 0.1)
        self.assertEqual(len(opt.param_groups), 4)  # its own group (lr 0.1) left empty
        run = self.daemon.run("tiny-fix")
        events = [e for e in run.events if e.source == "trainer"]
        self.assertEqual(len(events), 1)
        self.assertIn("weight decay 0.1 on final_norm.weight (was 0)", events[0].text)
        # The Watch saw the move and updated the run's catalog from the same step.
        self.assertEqual([e.step for e in run.events if e.source == "catalog"], [events[0].step])
        self.assertAlmostEqual({p.name: p for p in run.params}["final_norm.weight"].weight_decay, 0.1)
        # Other norm gains keep no decay.
        attn_norm = model.blocks[0].attn_norm.weight
        self.assertTrue(any(any(p is attn_norm for p in g["params"]) and g["weight_decay"] == 0.0
                            for g in opt.param_groups))


if __name__ == "__main__":
    unittest.main()
