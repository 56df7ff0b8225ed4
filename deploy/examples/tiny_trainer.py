#!/usr/bin/python3
"""A tiny decoder-only transformer trained on CPU with synthetic data, streaming to gradwatchd.

RMSNorm before attention and MLP in each block and a final norm before the lm_head; AdamW with
weight decay on the matrices and none on norm gains, biases and embeddings' neighbours. Every step
sends every parameter's grad and param norm and the total grad norm (gradwatch.torch.Watch).

    PYTHONPATH=build/python /usr/bin/python3 deploy/examples/tiny_trainer.py --run tiny --steps 200
    ... --checkpoint-dir ckpt --checkpoint-every 50       # checkpoints
    ... --checkpoint-dir ckpt --resume                    # resumes from the latest (a rewind)
    ... --remediate                                       # acts on GradNormContingency

With --remediate the trainer prints each alert that reaches it (the contingency with its
recommendation: the weight decay and what it projects), the catalog change it makes, and at the end
the daemon's check of that change against the projection (analysis.remediations).

Exit codes: 0 trained and the run recorded as finished, 1 the daemon did not confirm everything,
2 usage.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from typing import Callable, Optional

import grpc
import torch

import gradwatch
import gradwatch.torch as gwt
from gradwatch.v1 import gradwatch_pb2 as pb
from gradwatch.v1 import gradwatch_pb2_grpc as pb_grpc


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.mlp_up = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_down = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_down(torch.relu(self.mlp_up(self.mlp_norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.final_norm = RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   final_norm_lr: Optional[float] = None) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and none on norm gains and biases; the final norm's gain in a group
    of its own (no weight decay) with final_norm_lr when given."""
    decay, no_decay = [], []
    final = model.final_norm.weight
    for name, p in model.named_parameters():
        if p is final and final_norm_lr is not None:
            continue
        (no_decay if "norm" in name or p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if final_norm_lr is not None:
        groups.append({"params": [final], "weight_decay": 0.0, "lr": final_norm_lr})
    return torch.optim.AdamW(groups, lr=lr)


def batch(step: int, args) -> torch.Tensor:
    """The step's synthetic batch: the same for a step whichever process trains it (resumes)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    # A learnable pattern: each token is the previous one plus a small random stride.
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, 3, (args.batch, args.seq), generator=g)
    return (start + stride.cumsum(1)) % args.vocab


def latest_checkpoint(directory: str) -> Optional[str]:
    files = sorted(glob.glob(os.path.join(directory, "step-*.pt")))
    return files[-1] if files else None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the run's id")
    ap.add_argument("--address", default=os.environ.get("GRADWATCH_ADDR", gradwatch.DEFAULT_ADDRESS),
                    help="gradwatchd's gRPC HOST:PORT (default $GRADWATCH_ADDR or %(default)s)")
    ap.add_argument("--steps", type=int, default=200, help="train through this step")
    ap.add_argument("--every", type=int, default=1, help="send the norms every N steps")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--final-norm-lr", type=float,
                    help="the final norm gain's learning rate (default --lr): a larger one makes it drift up, as a norm "
                         "gain without weight decay does over a long run (with 0.1 it grows about 3x in 80 steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", help="save checkpoints here")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint")
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop after this step without finishing the run (a crash, for trying resumes)")
    ap.add_argument("--remediate", action="store_true",
                    help="on GradNormContingency, give the recommended parameter the recommended weight decay")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        ap.error("--resume needs --checkpoint-dir")
    return args


def alert_printer(remedy: gwt.Remediation) -> Callable[[pb.Alert], None]:
    """An on_alert callback that prints the alert (a firing page with its recommendation) and hands
    it to the remediation."""
    def on_alert(alert: pb.Alert) -> None:
        state = pb.AlertState.Name(alert.state).replace("ALERT_STATE_", "").lower()
        summary = alert.annotations.get("summary", "")
        print(f"gradwatch alert: {alert.name} {state} at step {alert.step}" + (f": {summary}" if summary else ""),
              file=sys.stderr)
        recommendation = alert.annotations.get("recommendation", "")
        if alert.state == pb.ALERT_STATE_FIRING and recommendation:
            print(f"  {recommendation}", file=sys.stderr)
        remedy(alert)
    return on_alert


def print_remediation_checks(address: str, run: str) -> None:
    """The daemon's check of each catalog change that raised a weight decay, as `gradwatch show` has it."""
    with grpc.insecure_channel(address) as channel:
        summary = pb_grpc.QueryStub(channel).GetRun(pb.GetRunRequest(run_id=run), timeout=30)
    for r in summary.analysis.remediations:
        print(f"remediation check: {r.param} weight decay {r.previous_weight_decay:g} -> {r.weight_decay:g} at step "
              f"{r.step}: {r.verdict} (norm {r.norm_at_step:.4g} then, {r.actual_norm:.4g} at step {r.at_step}, "
              f"projected ~{r.projected_norm:.4g}, ~{r.unchanged_norm:.4g} without the change; time constant "
              f"~{r.time_constant_steps:.0f} steps)", file=sys.stderr)


def train(args, hook: Optional[Callable[..., None]] = None, on_watch: Optional[Callable[..., None]] = None) -> int:
    """Trains; `hook(step, model, loss, optimizer)` runs after each optimizer step, before zero_grad;
    `on_watch(watch)` is handed the gradwatch Watch once it is made."""
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads)
    optimizer = make_optimizer(model, args.lr, args.weight_decay, args.final_norm_lr)
    first = 1
    if args.resume:
        path = latest_checkpoint(args.checkpoint_dir)
        if path is not None:
            state = torch.load(path)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            first = state["step"] + 1
            print(f"resumed from {path} at step {first}", file=sys.stderr)
    remedy = gwt.Remediation(model, optimizer) if args.remediate else None
    watch = gwt.Watch(model, optimizer, run=args.run, address=args.address, every=args.every,
                      init_norms=first == 1, remediation=remedy, on_alert=alert_printer(remedy) if remedy else None,
                      config={"weight_decay": args.weight_decay, "optimizer": "adamw", "hidden_size": args.dim},
                      resume_from_step=first if args.resume else None)
    if on_watch is not None:
        on_watch(watch)
    for step in range(first, args.steps + 1):
        tokens = batch(step, args)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        applied = dict(remedy.applied) if remedy else {}
        watch.step(step, loss=loss)
        for name, wd in (remedy.applied.items() if remedy else ()):
            if name not in applied:
                print(f"catalog change at step {step}: weight decay {wd:g} on {name} (its own param group), sent to "
                      f"the daemon", file=sys.stderr)
        if hook is not None:
            hook(step, model, loss, optimizer)
        optimizer.zero_grad()
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       os.path.join(args.checkpoint_dir, f"step-{step:09d}.pt"))
        if args.stop_at and step == args.stop_at:
            ok = watch.monitor.flush(60)
            watch.close(finished=False)
            return 0 if ok else 1
    ok = watch.close(finished=True)
    stats = watch.monitor.stats()
    print(f"trained through step {args.steps}; dropped {stats.dropped}, reconnects {stats.reconnects}"
          + (f", remediation {remedy.applied}" if remedy else ""), file=sys.stderr)
    if remedy and remedy.applied:
        print_remediation_checks(args.address, args.run)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(train(parse_args()))
