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
Watch before training, or pass init_norms=False). Norms are computed on the parameters' device
with fused kernels where the installed torch has them (torch._foreach_norm) and copied to the host
once per step.

Under torch.distributed every rank reports each step (its loss; the daemon averages it over the
ranks). A sharded model (FSDP, or sharded=True) sends each rank's squared sums of its own shards,
which the daemon adds up; a replicated one (DDP) has its norms sent by rank 0 only, as the daemon
asks of a parameter held whole on several ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch

from gradwatch._catalog import Param
from gradwatch._monitor import Monitor


def _norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    if not tensors:
        return []
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        return list(foreach_norm(tensors))
    return [t.norm() for t in tensors]


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # absent, or (Debian's torch 1.13 on Python 3.11) failing to import
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class Watch:
    """Sends `model`'s grad norms, param norms (update norms with update_norms=True) and the total
    grad norm after each optimizer step (every `every` steps) through a gradwatch.Monitor: the one
    given, or one made with monitor_kwargs (run, address, labels, config, on_alert, ...)."""

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
        **monitor_kwargs: Any,
    ) -> None:
        if every < 1:
            raise ValueError(f"every={every}: must be at least 1")
        self.every = every
        self.update_norms = update_norms
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        decay: Dict[int, float] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                decay[id(p)] = float(group.get("weight_decay", 0.0))
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
        if monitor is None:
            if run is None:
                raise ValueError("run: a run id is required when no monitor is given")
            monitor_kwargs.setdefault("rank", self.rank)
            monitor_kwargs.setdefault("world_size", self.world_size)
            monitor = Monitor(run, params=catalog, **monitor_kwargs)
        self.monitor = monitor
        self._before: Optional[List[torch.Tensor]] = None
        if update_norms:
            self._before = [p.detach().clone() for p in self.params]

    def step(self, step: int, loss: Any = None, metrics: Optional[Mapping[str, Any]] = None) -> bool:
        """Call after optimizer.step() and before zero_grad(). Sends this step's norms (and `loss`
        and `metrics`, any JSONL keys) on steps that are multiples of `every`; False otherwise, or
        when the Monitor dropped it."""
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
        if metrics:
            out.update(metrics)
        return self.monitor.log(step, out, squared=self._squared)

    def _norm_metrics(self) -> Dict[str, float]:
        with torch.no_grad():
            have_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = _norms([self.params[i].grad.detach() for i in have_grad])
            weights = _norms([p.detach() for p in self.params])
            updates: List[torch.Tensor] = []
            if self._before is not None:
                updates = _norms([p.detach() - b for p, b in zip(self.params, self._before)])
                for b, p in zip(self._before, self.params):
                    b.copy_(p.detach())
            parts = grads + weights + updates
            # One device-to-host copy: every norm, squared, in one tensor.
            squares = (torch.stack(parts).double() ** 2).cpu().tolist() if parts else []
        value = (lambda sq: sq) if self._squared else (lambda sq: sq ** 0.5)
        out: Dict[str, float] = {}
        for k, i in enumerate(have_grad):
            out[f"grad/norm/{self.names[i]}"] = value(squares[k])
        if have_grad:
            out["grad/norm/total"] = value(sum(squares[: len(have_grad)]))
        base = len(have_grad)
        for i, name in enumerate(self.names):
            out[f"params/norm/{name}"] = value(squares[base + i])
        base += len(self.names)
        for i in range(len(updates)):
            out[f"updates/norm/{self.names[i]}"] = value(squares[base + i])
        return out

    def close(self, finished: bool = True, timeout: float = 30.0) -> bool:
        return self.monitor.close(finished=finished, timeout=timeout)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)
