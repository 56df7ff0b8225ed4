"""gradwatch.torch: a PyTorch model's norms sent to gradwatchd after every optimizer step.

    watch = gradwatch.torch.Watch(model, optimizer, run="my-run")
    for step, batch in enumerate(loader):
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
        watch.step(step, loss=loss)      # before zero_grad: it reads the gradients
        optimizer.zero_grad()
    watch.close()

The catalog comes from the model: each parameter's numel, its weight decay from the optimizer's
param group, its kind guessed from its name (norm gains, lm_head/output, embeddings, routers;
override with kinds={name: kind}) and its norm when the Watch is made (its init norm: make the
Watch before training, or pass init_norms=False). The final norm (a norm gain named final_norm,
norm_f, ln_f, final_layernorm or model.norm, else the last norm gain before the output layer) gets
the role "final_norm". Each step also sends the optimizer's learning rate (its first param
group's), by which the daemon knows the warm-up: pages are held while it rises. Norms are computed on the parameters' device
with fused kernels where the installed torch has them (torch._foreach_norm) and copied to the host
once per step. A weight decay that changes in the optimizer's param groups (a parameter moved into
another group, as Remediation does, or a group's weight_decay set by hand) is seen at the next
step() and sent as a catalog update from that step (Monitor.update_params).

Under torch.distributed every rank reports each step (its loss; the daemon averages it over the
ranks). A sharded model (FSDP, or sharded=True) sends each rank's squared sums of its own shards,
which the daemon adds up; a replicated one (DDP) has its norms sent by rank 0 only, as the daemon
asks of a parameter held whole on several ranks.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from gradwatch._catalog import Param, parse_kind
from gradwatch._monitor import Monitor


def _norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    if not tensors:
        return []
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        return list(foreach_norm(tensors))
    return [t.norm() for t in tensors]


_FINAL_NORM_NAME = re.compile(r"(?:^|\.)(?:final_norm|norm_f|ln_f|final_layernorm|final_layer_norm|model\.norm)"
                              r"(?:\.(?:weight|scale|gamma))?$")


def _final_norm(catalog: List[Param]) -> Optional[Param]:
    """The norm gain feeding the output layer: named like a final norm, else the last norm gain
    before the first output parameter (in the model's order), else none."""
    from gradwatch._catalog import infer_kind
    from gradwatch.v1 import gradwatch_pb2 as pb

    def kind(p: Param) -> int:
        return parse_kind(p.kind) if p.kind is not None else infer_kind(p.name)

    gains = [p for p in catalog if kind(p) == pb.PARAM_KIND_NORM_GAIN]
    for p in gains:
        if _FINAL_NORM_NAME.search(p.name):
            return p
    last = None
    for p in catalog:
        k = kind(p)
        if k == pb.PARAM_KIND_OUTPUT:
            return last
        if k == pb.PARAM_KIND_NORM_GAIN:
            last = p
    return None


def _decay_by_param(optimizer: torch.optim.Optimizer) -> Dict[int, float]:
    """id(parameter) -> the weight decay of its param group (0 when the group has none)."""
    return {id(p): float(group.get("weight_decay", 0.0)) for group in optimizer.param_groups for p in group["params"]}


def _group_signature(optimizer: torch.optim.Optimizer) -> tuple:
    """What changes when a parameter's weight decay does: each group's identity, weight decay and size."""
    return tuple((id(g), g.get("weight_decay", 0.0), len(g["params"])) for g in optimizer.param_groups)


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # absent, or (Debian's torch 1.13 on Python 3.11) failing to import
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class Watch:
    """Sends `model`'s grad norms, param norms (update norms with update_norms=True) and the total
    grad norm after each optimizer step (every `every` steps) through a gradwatch.Monitor: the one
    given, or one made with monitor_kwargs (run, address, labels, config, on_alert, ...).

    Each step() (sent or not) also reports the watched parameters whose weight decay changed in
    optimizer.param_groups since the previous one: a parameter moved into another group (as
    Remediation does) or a group's weight_decay set. It compares each group's identity, weight
    decay and size, and reads the parameters' weight decays again only when they changed (a swap
    of two parameters between groups of the same size goes unseen); the changed parameters go to
    Monitor.update_params with their new weight decay, from the step being reported. A change the
    Monitor did not queue (a full queue) is tried again at the next step. Every rank reports it:
    each rank's Monitor sends the catalog in its Hellos. A given monitor must have the watched
    parameters in its catalog; a change it cannot take (a parameter it lacks, a weight decay
    below 0) is logged and not sent.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        run: Optional[str] = None,
        monitor: Optional[Monitor] = None,
        every: int = 1,
        update_norms: bool = False,
        kinds: Optional[Mapping[str, str]] = None,
        init_norms: bool = True,
        sharded: Optional[bool] = None,
        remediation: Optional["Remediation"] = None,
        **monitor_kwargs: Any,
    ) -> None:
        if every < 1:
            raise ValueError(f"every={every}: must be at least 1")
        self.every = every
        self.optimizer = optimizer
        self.update_norms = update_norms
        self.remediation = remediation
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self._grad_keys = [f"grad/norm/{n}" for n in self.names]
        self._param_keys = [f"params/norm/{n}" for n in self.names]
        self._update_keys = [f"updates/norm/{n}" for n in self.names]
        self.params = [p for _, p in named]
        decay = _decay_by_param(optimizer)
        kinds = dict(kinds or {})
        unknown = set(kinds) - set(self.names)
        if unknown:
            raise ValueError(f"kinds names parameters the model does not have: {sorted(unknown)}")

        self.distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_size = torch.distributed.get_world_size() if self.distributed else 1
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.sharded = _is_fsdp(model) if sharded is None else sharded
        # Norms as squared partial sums (sharded over ranks), or whole from rank 0 only.
        self._squared = self.sharded and self.world_size > 1
        self._sends_norms = self._squared or self.rank == 0

        init: List[Optional[float]] = [None] * len(self.params)
        if init_norms:
            with torch.no_grad():
                squares = torch.stack([n * n for n in _norms([p.detach() for p in self.params])]) \
                    if self.params else torch.zeros(0)
                if self.distributed and self.sharded:
                    torch.distributed.all_reduce(squares)
                init = [float(v) ** 0.5 for v in squares.cpu().tolist()]
        catalog = [Param(name=n, numel=p.numel() * (self.world_size if self.sharded else 1), kind=kinds.get(n),
                         weight_decay=decay.get(id(p), 0.0), init_norm=i)
                   for n, p, i in zip(self.names, self.params, init)]
        final = _final_norm(catalog)
        if final is not None:
            final.role = "final_norm"
        if monitor is None:
            if run is None:
                raise ValueError("run: a run id is required when no monitor is given")
            monitor_kwargs.setdefault("rank", self.rank)
            monitor_kwargs.setdefault("world_size", self.world_size)
            monitor = Monitor(run, params=catalog, **monitor_kwargs)
        self.monitor = monitor
        # The param groups and weight decays as last reported (the catalog's, at first).
        self._signature = _group_signature(optimizer)
        self._decays = [decay.get(id(p), 0.0) for p in self.params]
        self._before: Optional[List[torch.Tensor]] = None
        if update_norms:
            self._before = [p.detach().clone() for p in self.params]

    def step(self, step: int, loss: Any = None, metrics: Optional[Mapping[str, Any]] = None) -> bool:
        """Call after optimizer.step() and before zero_grad(). Applies the remediation due, reports
        weight decays that changed (see the class), then sends this step's norms (and `loss` and
        `metrics`, any JSONL keys) on steps that are multiples of `every`; False otherwise, or when
        the Monitor dropped it."""
        if self.remediation is not None:
            for text in self.remediation.apply():
                self.monitor.event(step, text)
        self._report_weight_decay(step)
        send = step % self.every == 0
        if not send:
            if self._before is not None:
                with torch.no_grad():
                    for b, p in zip(self._before, self.params):
                        b.copy_(p.detach())
            return False
        out: Dict[str, Any] = {}
        if self._sends_norms:
            out.update(self._norm_metrics())
        if loss is not None:
            out["train/loss"] = float(loss)
        if self.optimizer.param_groups and "lr" in self.optimizer.param_groups[0]:
            out["optim/learning_rate"] = float(self.optimizer.param_groups[0]["lr"])
        if metrics:
            out.update(metrics)
        return self.monitor.log(step, out, squared=self._squared)

    def _report_weight_decay(self, step: int) -> None:
        """Sends the watched parameters' weight decays that changed since the last report, if the
        param groups did."""
        signature = _group_signature(self.optimizer)
        if signature == self._signature:
            return
        decay = _decay_by_param(self.optimizer)
        decays = [decay.get(id(p), 0.0) for p in self.params]
        changes = [{"name": n, "weight_decay": wd} for n, wd, was in zip(self.names, decays, self._decays) if wd != was]
        if changes:
            try:
                if not self.monitor.update_params(step, changes):
                    return  # not queued: the next step tries again
            except ValueError as e:
                logging.getLogger("gradwatch").warning("gradwatch: the weight-decay change at step %d is not "
                                                       "reported: %s", step, e)
        self._signature, self._decays = signature, decays

    def _norm_metrics(self) -> Dict[str, float]:
        # Under no_grad the norms track no autograd history: no detach() per tensor is needed.
        with torch.no_grad():
            have_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = _norms([self.params[i].grad for i in have_grad])
            weights = _norms(self.params)
            updates: List[torch.Tensor] = []
            if self._before is not None:
                updates = _norms(torch._foreach_sub(self.params, self._before)
                                 if hasattr(torch, "_foreach_sub") else
                                 [p - b for p, b in zip(self.params, self._before)])
                for b, p in zip(self._before, self.params):
                    b.copy_(p)
            parts = grads + weights + updates
            # One device-to-host copy: every norm, squared, in one tensor.
            squares = (torch.stack(parts).double() ** 2).cpu().tolist() if parts else []
        total = sum(squares[: len(have_grad)])
        if not self._squared:
            squares = [sq ** 0.5 for sq in squares]
            total = total ** 0.5
        n_grads = len(have_grad)
        if n_grads == len(self.params):
            out: Dict[str, float] = dict(zip(self._grad_keys, squares))
        else:
            out = {self._grad_keys[i]: squares[k] for k, i in enumerate(have_grad)}
        if have_grad:
            out["grad/norm/total"] = total
        out.update(zip(self._param_keys, squares[n_grads:n_grads + len(self.params)]))
        if updates:
            out.update(zip(self._update_keys, squares[n_grads + len(self.params):]))
        return out

    def close(self, finished: bool = True, timeout: float = 30.0) -> bool:
        return self.monitor.close(finished=finished, timeout=timeout)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)


class Remediation:
    """Opt-in: an alert callback that acts on the grad-norm contingency's diagnosis.

    When a `GradNormContingency` alert fires, its structured fields say what the run's evidence
    supports: the annotations remediation_param (the parameter), remediation_weight_decay (the
    run's decayed parameters' value) and remediation_supported ("true" only when the daemon's
    diagnosis found the cause: a norm gain without weight decay that has grown while the output
    layer carries most of the squared grad norm). Only then is that parameter moved into a param
    group of its own with that weight decay (or `weight_decay` when given), once, and the change
    reported to the daemon as an event of the run (and, by Watch.step, as a catalog update: the
    run's catalog then carries the new weight decay); otherwise the reason (remediation_why) is
    logged and nothing changes. The alert arrives on the Monitor's thread while training runs on
    another: the move is applied by apply(), which the training loop calls between steps
    (Watch.step does).

        remedy = gradwatch.torch.Remediation(model, optimizer)
        watch = gradwatch.torch.Watch(model, optimizer, run="r", on_alert=remedy, remediation=remedy)
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 alert: str = "GradNormContingency", weight_decay: Optional[float] = None,
                 on_applied: Optional[Callable[[str, float], None]] = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.alert = alert
        self.weight_decay = weight_decay
        self.on_applied = on_applied
        self.applied: Dict[str, float] = {}  # parameter name -> weight decay it was given
        self._due: Dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, alert: Any) -> None:
        """The Monitor's on_alert: notes what a firing contingency recommends."""
        from gradwatch.v1 import gradwatch_pb2 as pb
        if alert.name != self.alert or alert.state != pb.ALERT_STATE_FIRING:
            return
        log = logging.getLogger("gradwatch")
        fields = alert.annotations
        name = fields.get("remediation_param", "")
        if fields.get("remediation_supported") != "true":
            log.warning("gradwatch: %s fired at step %d; the evidence does not support a weight-decay change (%s): "
                        "nothing applied", alert.name, alert.step, fields.get("remediation_why", "no diagnosis"))
            return
        if not name:
            log.warning("gradwatch: %s fired without a parameter to act on: nothing applied", alert.name)
            return
        suggested = fields.get("remediation_weight_decay", "")
        if self.weight_decay is None and (not suggested or float(suggested) <= 0):
            log.warning("gradwatch: %s recommends weight decay on %s without a value, and Remediation was given none",
                        alert.name, name)
            return
        wd = self.weight_decay if self.weight_decay is not None else float(suggested)
        log.info("gradwatch: %s: weight decay %g on %s is due (%s)", alert.name, wd, name,
                 fields.get("remediation_why", ""))
        with self._lock:
            if name not in self.applied:
                self._due[name] = wd

    @property
    def pending(self) -> Dict[str, float]:
        """Parameters a fired alert named, not yet moved (apply() moves them): name -> weight decay."""
        with self._lock:
            return dict(self._due)

    def apply(self) -> List[str]:
        """Moves the parameters due into their own param group; returns the events to report."""
        with self._lock:
            due, self._due = self._due, {}
        events = []
        params = dict(self.model.named_parameters())
        for name, wd in due.items():
            p = params.get(name)
            if p is None:
                logging.getLogger("gradwatch").warning("gradwatch: the recommendation names %s, which the model "
                                                       "does not have", name)
                continue
            for group in self.optimizer.param_groups:
                kept = [q for q in group["params"] if q is not p]
                if len(kept) != len(group["params"]):
                    moved_from = group
                    group["params"] = kept
                    break
            else:
                continue
            new_group = {k: v for k, v in moved_from.items() if k != "params"}
            new_group["weight_decay"] = wd
            new_group["params"] = [p]
            self.optimizer.add_param_group(new_group)
            self.applied[name] = wd
            events.append(f"gradwatch remediation: weight decay {wd:g} on {name} (was "
                          f"{moved_from.get('weight_decay', 0.0):g})")
            if self.on_applied is not None:
                self.on_applied(name, wd)
        return events
