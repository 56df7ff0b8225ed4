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
param group, its kind guessed from its module names (infer_kinds: norm gains, output, embeddings,
routers, attention and MLP layers as the common model families name them; override with
kinds={name: kind}) and its norm when the Watch is made (its init norm: make the
Watch before training, or pass init_norms=False). The final norm (a norm gain named final_norm,
norm_f, ln_f, final_layernorm or model.norm, else the last norm gain before the output layer) gets
the role "final_norm". Each step also sends the optimizer's learning rate (its first param
group's), by which the daemon knows the warm-up: pages are held while it rises; and, for each
parameter in a group with another learning rate, that one (optim/learning_rate/<name>), which the
daemon's what-if projects the parameter with. Norms are computed on the parameters' device
with fused kernels where the installed torch has them (torch._foreach_norm) and copied to the host
once per step; on CUDA that copy is asynchronous (a pinned buffer, non_blocking=True) and the step
is sent at the next step(), so the training thread never waits for the device (Watch.step). A weight decay that changes in the optimizer's param groups (a parameter moved into
another group, as Remediation does, or a group's weight_decay set by hand) is seen at the next
step() and sent as a catalog update from that step (Monitor.update_params). radial_updates=True
adds each parameter's radial update (updates/radial/<param>): from the copy update_norms=True keeps,
or without one from the state of torch.optim.Adam and AdamW (see Watch).

Under torch.distributed every rank reports each step (its loss; the daemon averages it over the
ranks). A sharded model (FSDP, or sharded=True) sends each rank's squared sums of its own shards,
which the daemon adds up; a replicated one (DDP) has its norms sent by rank 0 only, as the daemon
asks of a parameter held whole on several ranks.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import threading
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from gradwatch._catalog import Param, parse_kind
from gradwatch._monitor import DEFAULT_CLOSE_TIMEOUT, Monitor


def _norms(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    if not tensors:
        return []
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        return list(foreach_norm(tensors))
    return [t.norm() for t in tensors]


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (the inner product of the radial update is the real one)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _dots_into(xs: List[torch.Tensor], ys: List[torch.Tensor]) -> List[torch.Tensor]:
    """⟨x, y⟩ of each pair, overwriting x (a temporary) with x·y: no new tensor, and each sum is
    torch's pairwise one (torch.dot, on a generic BLAS, adds up in float32 one element after another)."""
    if hasattr(torch, "_foreach_mul_"):
        torch._foreach_mul_(xs, ys)
    else:
        for x, y in zip(xs, ys):
            x.mul_(y)
    return [x.sum() for x in xs]


def _adam_directions(ms: List[torch.Tensor], vs: List[torch.Tensor], eps: List[float]) -> List[torch.Tensor]:
    """m / (sqrt(v) + eps) of each tensor, each in one new tensor (the only temporary)."""
    if hasattr(torch, "_foreach_reciprocal_"):
        qs = list(torch._foreach_sqrt(vs))
        torch._foreach_add_(qs, eps)
        torch._foreach_reciprocal_(qs)
        torch._foreach_mul_(qs, ms)
        return qs
    qs = []
    for m, v, e in zip(ms, vs, eps):
        q = v.sqrt().add_(e)
        qs.append(torch.div(m, q, out=q))
    return qs


# torch's own Adam and AdamW, whose update the radial update is reconstructed from: not their
# subclasses, which may change it.
_ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)
# Dtypes whose update is the one Adam computes: a half-precision weight gets it rounded to its dtype,
# which the state does not record.
_STATE_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)
# Elements of the tensors whose temporaries the radial updates keep alive at once (4 bytes each in
# float32): the work is batched over tensors up to this size, and a larger tensor is a batch alone.
_RADIAL_BATCH_ELEMENTS = 1 << 25


# ---- parameter kinds ------------------------------------------------------------------------------
# infer_kinds() reads a parameter's dotted name component by component (its modules, then its own
# name), lowercased; where a rule speaks of words, a component is cut into words at "_" and digits
# ("update_gate" is the words update and gate: neither the module "gate" nor "up_proj").

# Module names that are attention's projections wherever they are (unless inside an MLP module:
# T5's DenseReluDense.wo is its MLP's).
_ATTENTION_MODULES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv", "qkv_proj", "kv_proj", "c_attn", "query_key_value",
    "wq", "wk", "wv", "wo", "wqkv", "w_pack", "out_proj", "linear_qkv", "linear_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
# Module names that are an MLP's (or an MoE expert's) layers wherever they are (unless inside an
# attention module).
_MLP_MODULES = frozenset({
    "gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3", "fc1", "fc2", "c_fc", "fc_in", "fc_out",
    "dense_h_to_4h", "dense_4h_to_h", "linear_fc1", "linear_fc2", "wi", "wi_0", "wi_1"})
# Modules whose parameters (and their descendants') are an MLP's, besides names with mlp, ffn, expert
# or the word moe in them.
_MLP_CONTAINERS = frozenset({"feed_forward", "feedforward", "ff", "intermediate", "densereludense"})
_EMBEDDING_MODULES = frozenset({"wte", "wpe"})  # besides names with "embed" in them
_OUTPUT_MODULES = frozenset({"lm_head", "output_layer", "embed_out"})


def _words(component: str) -> List[str]:
    return [w for w in re.split(r"[_\d]+", component) if w]


def _is_norm_word(word: str) -> bool:
    """norm, layernorm, rmsnorm, norm1, normalization, ... and ln (ln_1, ln_f, ln_attn)."""
    return word == "ln" or word.startswith("norm") or word.endswith("norm")


def _is_norm_module(module: Optional[torch.nn.Module]) -> bool:
    """A normalization layer: LayerNorm, RMSNorm, GroupNorm, BatchNorm..., or a class of that name."""
    return module is not None and any("Norm" in c.__name__ for c in type(module).__mro__)


def _container(component: str, module: Optional[torch.nn.Module]) -> Optional[str]:
    """The kind of the parameters inside a module named `component` (lowercased), when its name says."""
    if "attn" in component or "attention" in component or isinstance(module, torch.nn.MultiheadAttention):
        return "attention"
    if ("mlp" in component or "ffn" in component or "expert" in component or component in _MLP_CONTAINERS
            or "moe" in _words(component)):
        return "mlp"
    return None


def _in_attention(components: Sequence[str]) -> bool:
    return any("attn" in c or "attention" in c for c in components)


# Wrappers' module names, which FSDP's named_parameters() leaves out of the parameters' names.
_WRAPPER_MODULES = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def infer_kinds(model: torch.nn.Module) -> Dict[str, str]:
    """The kind Watch gives each of `model`'s parameters when `kinds` does not: name (as in
    model.named_parameters()) -> "norm_gain", "router", "output", "embedding", "attention", "mlp" or
    "other". It reads the name's components, modules first (lowercased; a word is a part of a component
    between "_" and digits), and takes the first rule that holds:

    - norm_gain: a word norm…/…norm (norm, layernorm, rmsnorm, norm1, attention_norm, ffn_norm,
      input_layernorm, output_layernorm, final_layernorm) or ln (ln_1, ln_f), or a 1-D parameter
      (weight or bias) of a normalization layer (a class named …Norm…);
    - router: a word router (router, moe_router), or the module named exactly gate of an MoE (beside
      an experts module, or with a 2-D weight of fewer rows than columns, [num_experts, hidden]),
      outside attention: Mixtral's block_sparse_moe.gate, DeepSeek's mlp.gate;
    - output: a module lm_head, or a parameter of a module output_layer (Megatron) or embed_out;
    - embedding: a component with embed in it (embed_tokens, tok_embeddings, word_embeddings,
      embeddings, position_embeddings, pos_embed) or the module wte or wpe;
    - attention or mlp: the nearest module (from the parameter up) that names one: attn or attention
      in its name, or torch.nn.MultiheadAttention, is attention; mlp, ffn, expert in its name, the
      word moe, feed_forward, ff, intermediate or DenseReluDense is mlp. So GPT-2's attn.c_proj is
      attention and mlp.c_proj mlp; self_attention.dense and attention.self.query attention;
      mlp.experts.0.w1 and shared_experts.up_proj mlp;
    - outside those, the parameter's module's own name: q_proj, k_proj, v_proj, o_proj, qkv, qkv_proj,
      kv_proj, c_attn, query_key_value, wq, wk, wv, wo, Wqkv, W_pack, out_proj, linear_qkv,
      linear_proj (and DeepSeek's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj) are attention;
      gate_proj, up_proj, down_proj, gate_up_proj, w1, w2, w3, fc1, fc2, c_fc, fc_in, fc_out,
      dense_h_to_4h, dense_4h_to_h, linear_fc1, linear_fc2, wi are mlp; output (torchtitan's
      output.weight) is output; BERT's output.dense (the MLP's second layer) is mlp; a
      torch.nn.Embedding is embedding;
    - else other.

    A bias goes with its module's weight. Only whole components count: update_gate, upsample or
    downsample match nothing, gate_proj is not a router, output_layernorm is a norm gain."""
    params = dict(model.named_parameters())
    modules: Dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        modules.setdefault(name, module)
        modules.setdefault(".".join(c for c in name.split(".") if c not in _WRAPPER_MODULES), module)
    # Every module path the parameters' names hold: where the experts beside a gate are looked for.
    paths = {".".join(parts[:i]) for parts in (n.split(".") for n in params) for i in range(1, len(parts))}
    return {name: _infer_kind(name, p, params, modules, paths) for name, p in params.items()}


def _infer_kind(name: str, param: torch.Tensor, params: Mapping[str, torch.Tensor],
                modules: Mapping[str, torch.nn.Module], paths: Set[str]) -> str:
    parts = name.split(".")
    lowered = [c.lower() for c in parts]
    path = lowered[:-1]  # the modules'
    owner = path[-1] if path else ""
    module = modules.get(".".join(parts[:-1]))
    if any(_is_norm_word(w) for c in lowered for w in _words(c)) or (param.dim() <= 1 and _is_norm_module(module)):
        return "norm_gain"
    if any("router" in _words(c) for c in lowered):
        return "router"
    if owner == "gate" and not _in_attention(path):
        parent = parts[:-2]
        weight = params.get(".".join(parts[:-1] + ["weight"]))
        if (".".join(parent + ["experts"]) in paths
                or (weight is not None and weight.dim() == 2 and weight.shape[0] < weight.shape[1])):
            return "router"
    if "lm_head" in path or owner in _OUTPUT_MODULES:
        return "output"
    if any("embed" in c for c in lowered) or any(c in _EMBEDDING_MODULES for c in path):
        return "embedding"
    for i in range(len(parts) - 1, -1, -1):  # the parameter's own name, its module, ... up to the model's
        kind = _container(lowered[i], modules.get(".".join(parts[:i + 1])) if i < len(parts) - 1 else None)
        if kind is not None:
            return kind
    if owner in _ATTENTION_MODULES:
        return "attention"
    if owner in _MLP_MODULES:
        return "mlp"
    if owner == "output":
        return "output"
    if owner == "dense" and len(path) >= 2 and path[-2] == "output":
        return "mlp"
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return "embedding"
    return "other"


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
    watch.catalog is the catalog it built (a gradwatch.Param per watched parameter, its kind from
    `kinds` or else infer_kinds(model)).

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

    radial_updates=True also sends each parameter's updates/radial/<name>, the radial part of the
    step's update r = ⟨Δw, w⟩/|w| (Δw = w(t+1) − w(t), w = w(t), the weight before the step; signed,
    > 0 when the step grows the norm), from which the daemon's AdamW what-if reads the update's radial
    part. A sharded model's rank sends its shard's ⟨Δw_s, w_s⟩ instead, which the daemon sums and
    divides by the merged parameter norm. r comes:

    - with update_norms=True, from the copy it keeps, whatever the optimizer: ⟨p − copy, copy⟩/|copy|;
    - else, without a copy, from the state of torch.optim.Adam or AdamW (those classes, not their
      subclasses, which may change the update). After their step w(t+1) = c·w(t) − lr·m̂/(√v̂ + eps),
      with m̂ = exp_avg/(1 − beta1**step), v̂ = exp_avg_sq/(1 − beta2**step) (max_exp_avg_sq under
      amsgrad), c = 1 − lr·weight_decay for AdamW's decoupled decay and c = 1 for Adam (its weight
      decay is in the gradient): so w(t) = (w(t+1) + lr·m̂/(√v̂ + eps))/c. maximize, foreach and
      capturable (the step count on the device) change none of it. A parameter whose step count did
      not move since the previous step() was not stepped (it had no gradient, or GradScaler skipped
      the step): its r is 0, so step() must be called after every optimizer step (each call reads the
      counts). Not sent, and logged: a parameter without Adam state yet (until the optimizer steps
      it), outside the optimizer's param groups, in float16 or bfloat16 (Adam's update reaches it
      rounded to its dtype, which the state does not record), or whose lr·weight_decay is 1;
    - otherwise not at all.

    Which parameters get no radial update, and why, is logged once (warning, logger "gradwatch"). r
    is not sent at a step where w(t) = 0 (it has no direction), except as a shard's ⟨Δw_s, w_s⟩.

    Cost per tensor of n elements and sent step (tests/bench/radial_cost.py: AdamW on one CPU core,
    torch 1.13, freed memory kept for reuse as CUDA's caching allocator does; the median added to
    step(), as it ranged over 4 runs on a busy machine). From Adam's state: one temporary of n
    elements (the work is batched over tensors of up to 2**25 elements together, whose temporaries
    then live at once) and 7 kernels, ~14 passes over n elements: 0.04 ms at n = 4,096, 1.0-1.3 ms at 1M, 22-29 ms at 16M (1-1.7 ns per element). On top of
    update_norms' copy: no temporary beyond the difference update_norms makes, 3 kernels, 5 passes:
    0.014 ms, 0.35 ms, 8-13 ms. update_norms itself (the copy, kept between steps, and a temporary
    difference: 6 passes) adds 0.01 ms, 0.6-0.9 ms, 13-18 ms, so the copy method with the radial update
    costs about what the state does (0.025 ms, 0.9-1.3 ms, 22-29 ms): the state saves the copy's
    memory, not time. With glibc's malloc as it is, which gives a large temporary fresh pages at each
    step, the 16M figures double (50-56 ms from the state, 51-61 ms by the copy method).
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
        radial_updates: bool = False,
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
        self._name_of = {id(p): n for n, p in named}
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
                # A tensor initialised at zero (a LayerNorm's bias, a zero-init projection) has no init
                # norm to scale against: sent as unknown, which the daemon takes, not as 0, which it refuses.
                init = [float(v) ** 0.5 if 0.0 < v < math.inf else None for v in squares.cpu().tolist()]
        guessed = infer_kinds(model)
        catalog = [Param(name=n, numel=p.numel() * (self.world_size if self.sharded else 1),
                         kind=kinds[n] if n in kinds else guessed.get(n, "other"),
                         weight_decay=decay.get(id(p), 0.0), init_norm=i)
                   for n, p, i in zip(self.names, self.params, init)]
        final = _final_norm(catalog)
        if final is not None:
            final.role = "final_norm"
        self.catalog = catalog  # as built: the one a Monitor made here is given
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
        # Steps whose values are on their way from the device (CUDA): (step, host values, finish,
        # keys of device scalars, norm count, copy), oldest first; see step().
        self._copies: Optional[_HostCopies] = None
        self._copied: Deque[Tuple[int, Dict[str, Any], Any, List[str], int, Any]] = collections.deque()
        if update_norms:
            self._before = [p.detach().clone() for p in self.params]

        self.radial_updates = radial_updates
        self._radial_keys = [f"updates/radial/{n}" for n in self.names]
        self._radial_warned: Set[Tuple[str, str]] = set()  # (parameter, reason) logged as not sent
        # The parameters whose radial update comes from Adam's state, and their state's step counts as
        # the previous step() read them: a count that did not move says the optimizer left the weight.
        self._from_state: List[int] = []
        self._adam_steps: List[Optional[float]] = []
        if radial_updates and self._sends_norms and not update_norms:
            self._from_state = self._state_sources()
            self._adam_steps = self._step_counts()

    def step(self, step: int, loss: Any = None, metrics: Optional[Mapping[str, Any]] = None) -> bool:
        """Call after optimizer.step() and before zero_grad(). Applies the remediation due, reports
        weight decays that changed (see the class), then sends this step's norms (and `loss` and
        `metrics`, any JSONL keys) on steps that are multiples of `every`; False otherwise, or when
        the Monitor dropped it.

        On CUDA the training thread never waits for the device: the step's norms (and a loss or
        metric given as a device tensor) are copied with non_blocking=True into a pinned host buffer,
        and sent by a later step() once the copy is done, normally the next one: the daemon sees
        each step one step() late, and close() sends the last. True then says the copy started. On
        the CPU (or with every norm on the host) the values are read and sent at once."""
        self._send_copied(wait=False)
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
            if self._from_state:
                self._adam_steps = self._step_counts()
            return False
        out: Dict[str, Any] = {}
        on_device: Dict[str, torch.Tensor] = {}
        if loss is not None:
            if isinstance(loss, torch.Tensor) and loss.device.type != "cpu":
                on_device["train/loss"] = loss
            else:
                out["train/loss"] = float(loss)
        out.update(self._learning_rates())
        for key, value in (metrics or {}).items():
            if isinstance(value, torch.Tensor) and value.device.type != "cpu" and value.numel() == 1:
                on_device[key] = value
            else:
                out[key] = value
        tensors: List[torch.Tensor] = []
        finish: Optional[Callable[[List[float]], Dict[str, float]]] = None
        if self._sends_norms:
            flat, finish = self._norm_tensors()
            if flat is not None:
                tensors.append(flat)
        n_norms = sum(t.numel() for t in tensors)
        with torch.no_grad():
            tensors += [v.detach().reshape(1).double() for v in on_device.values()]
            values = torch.cat([t.to(tensors[0].device) for t in tensors]) if tensors else None
        copies = self._copies_for(values)
        if copies is None:
            host = values.cpu().tolist() if values is not None else []
            return self.monitor.log(step, self._assemble(out, finish, on_device, host, n_norms), squared=self._squared)
        self._copied.append((step, out, finish, list(on_device), n_norms, copies.start(values)))
        return True

    def _copies_for(self, values: Optional[torch.Tensor]) -> Optional["_HostCopies"]:
        """The asynchronous copies for values on a CUDA device (made at the first one), else None."""
        if self._copies is None and values is not None and values.device.type == "cuda":
            self._copies = _HostCopies.for_cuda()
        return self._copies if values is not None and self._copies is not None else None

    def _assemble(self, out: Dict[str, Any], finish: Optional[Callable[[List[float]], Dict[str, float]]],
                  device_keys: Sequence[str], host: List[float], n_norms: int) -> Dict[str, Any]:
        values: Dict[str, Any] = finish(host[:n_norms]) if finish is not None else {}
        values.update(out)
        values.update(zip(device_keys, host[n_norms:]))
        return values

    def _send_copied(self, wait: bool) -> None:
        """Sends the copied steps whose copy is done, in step order (all of them, waiting, with wait)."""
        while self._copied:
            step, out, finish, device_keys, n_norms, copy = self._copied[0]
            host = self._copies.values(copy, wait=wait)
            if host is None:
                return
            self._copied.popleft()
            self.monitor.log(step, self._assemble(out, finish, device_keys, host, n_norms), squared=self._squared)

    def _learning_rates(self) -> Dict[str, float]:
        """optim/learning_rate (the first param group's) and, for each watched parameter in a group
        whose learning rate differs, optim/learning_rate/<name>: the daemon's what-if projects that
        parameter with its own."""
        groups = self.optimizer.param_groups
        if not groups or "lr" not in groups[0]:
            return {}
        run_lr = float(groups[0]["lr"])
        out = {"optim/learning_rate": run_lr}
        for group in groups[1:]:
            lr = group.get("lr")
            if lr is None or float(lr) == run_lr:
                continue
            for p in group["params"]:
                name = self._name_of.get(id(p))
                if name is not None:
                    out[f"optim/learning_rate/{name}"] = float(lr)
        return out

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

    def _norm_tensors(self) -> Tuple[Optional[torch.Tensor], Callable[[List[float]], Dict[str, float]]]:
        """This step's norms as one float64 tensor on the parameters' device (every norm squared, then
        the radial updates' inner products), or None when there are none, and the function that
        turns its values, once on the host, into the step's keys and values."""
        # Under no_grad the norms track no autograd history: no detach() per tensor is needed.
        with torch.no_grad():
            have_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = _norms([self.params[i].grad for i in have_grad])
            weights = _norms(self.params)
            updates: List[torch.Tensor] = []
            radial = _RadialTerms()
            if self._before is not None:
                diffs = (list(torch._foreach_sub(self.params, self._before)) if hasattr(torch, "_foreach_sub") else
                         [p - b for p, b in zip(self.params, self._before)])
                updates = _norms(diffs)
                if self.radial_updates:
                    radial.add_copies(range(len(self.params)), _norms(self._before),
                                      _dots_into([_real(d) for d in diffs], [_real(b) for b in self._before]))
                for b, p in zip(self._before, self.params):
                    b.copy_(p)
            elif self._from_state:
                self._adam_radial_terms(radial)
            parts = grads + weights + updates + radial.norms
            values = [torch.stack(parts).double() ** 2] if parts else []
            if radial.dots:
                values.append(torch.stack(radial.dots).double())
            flat = torch.cat(values) if values else None
        n_norms = len(parts) - len(radial.norms)
        has_updates = bool(updates)

        def finish(host: List[float]) -> Dict[str, float]:
            squares, radial_values = host[:n_norms], host[n_norms:]
            n_weights = len(have_grad) + len(self.params)
            radial_out = radial.values(self._radial_keys, squares[len(have_grad):n_weights], radial_values,
                                       self._squared)
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
            if has_updates:
                out.update(zip(self._update_keys, squares[n_grads + len(self.params):]))
            out.update(radial_out)
            return out

        return flat, finish

    # ---- radial updates -------------------------------------------------------------------------

    def _radial_not_sent(self, indices: Sequence[int], reason: str) -> None:
        """Logs, once per parameter and reason, the parameters that get no radial update."""
        new = [self.names[i] for i in indices if (self.names[i], reason) not in self._radial_warned]
        if not new:
            return
        self._radial_warned.update((n, reason) for n in new)
        logging.getLogger("gradwatch").warning("gradwatch: no updates/radial/ for %d parameter%s (%s): %s",
                                               len(new), "" if len(new) == 1 else "s", ", ".join(new), reason)

    def _state_sources(self) -> List[int]:
        """The parameters whose radial update Adam's state gives; logs the others."""
        kind = type(self.optimizer)
        if kind not in _ADAM_TYPES:
            self._radial_not_sent(range(len(self.params)),
                                  f"{kind.__module__}.{kind.__qualname__} is not torch.optim.Adam or AdamW, whose "
                                  f"state gives it, and no copy of the parameters is kept to measure it from "
                                  f"(update_norms=True keeps one)")
            return []
        low: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(self.params):
            if p.dtype not in _STATE_DTYPES:
                low.setdefault(p.dtype, []).append(i)
        for dtype, indices in low.items():
            self._radial_not_sent(indices, f"a {dtype} weight gets Adam's update rounded to {dtype}, which the "
                                           f"optimizer's state does not record (update_norms=True measures it "
                                           f"from a copy)")
        return [i for i, p in enumerate(self.params) if p.dtype in _STATE_DTYPES]

    def _step_counts(self) -> List[Optional[float]]:
        """The Adam step count of each parameter in _from_state (None without one), read to the host
        with one copy per device that holds counts (capturable=True keeps them on the parameter's)."""
        counts: List[Optional[float]] = []
        on_device: Dict[torch.device, List[Tuple[int, torch.Tensor]]] = {}
        for k, i in enumerate(self._from_state):
            state = self.optimizer.state.get(self.params[i])
            step = state.get("step") if state else None
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                on_device.setdefault(step.device, []).append((k, step))
                counts.append(None)
            else:
                counts.append(None if step is None else float(step))
        for pairs in on_device.values():
            for (k, _), n in zip(pairs, torch.stack([t.reshape(()) for _, t in pairs]).tolist()):
                counts[k] = n
        return counts

    def _adam_radial_terms(self, radial: "_RadialTerms") -> None:
        """Adds the radial update of each parameter in _from_state that has one, from its Adam state.

        After torch's Adam/AdamW step (bias corrections bc1 = 1 − beta1**n, bc2 = 1 − beta2**n at step
        count n; v the second moment, or its running maximum under amsgrad), the new weight is
        w1 = c·w0 − s·q with q = m / (sqrt(v) + eps·sqrt(bc2)), s = lr·sqrt(bc2)/bc1 and c = 1 − lr·wd
        (AdamW's decoupled decay; c = 1 for Adam, whose decay is in the gradient). So
        w0 = (w1 + s·q)/c, and ⟨Δw, w0⟩ and |w0|² follow from |w1|², ⟨w1, q⟩ and |q|². maximize only
        flips the gradient the moments hold, and capturable only where the step count lives."""
        steps = self._step_counts()
        previous, self._adam_steps = self._adam_steps, steps
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        decoupled_type = type(self.optimizer) is torch.optim.AdamW
        no_group: List[int] = []
        no_state: List[int] = []
        zeroed: List[int] = []
        batch: Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[float]] = ([], [], [], [])
        batch_elements = 0
        for k, i in enumerate(self._from_state):
            p = self.params[i]
            group = group_of.get(id(p))
            if group is None:
                no_group.append(i)
                continue
            n = steps[k]
            state = self.optimizer.state.get(p)
            amsgrad = bool(group.get("amsgrad", False))
            second = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"
            if n is None or n < 1 or "exp_avg" not in state or second not in state:
                no_state.append(i)
                continue
            if n == previous[k]:
                radial.add_unmoved(i)  # no step since the last step() (no gradient, or a skipped step)
                continue
            lr = float(group["lr"])
            beta1, beta2 = (float(b) for b in group["betas"])
            decoupled = decoupled_type or bool(group.get("decoupled_weight_decay", False))
            c = 1.0 - lr * float(group.get("weight_decay", 0.0)) if decoupled else 1.0
            if c == 0.0:
                zeroed.append(i)
                continue
            if batch[0] and batch_elements + p.numel() > _RADIAL_BATCH_ELEMENTS:
                radial.add_adam_batch(*batch)
                batch, batch_elements = ([], [], [], []), 0
            root_bc2 = math.sqrt(1.0 - beta2 ** n)
            radial.add_adam(i, c, lr * root_bc2 / (1.0 - beta1 ** n))
            batch[0].append(_real(p))
            batch[1].append(_real(state["exp_avg"]))
            batch[2].append(_real(state[second]))
            batch[3].append(float(group["eps"]) * root_bc2)
            batch_elements += p.numel()
        if batch[0]:
            radial.add_adam_batch(*batch)
        if no_group:
            self._radial_not_sent(no_group, "not in the optimizer's param groups")
        if no_state:
            self._radial_not_sent(no_state, "no Adam state (exp_avg, exp_avg_sq, max_exp_avg_sq under amsgrad, and a "
                                            "step) yet: sent once the optimizer has stepped it")
        if zeroed:
            self._radial_not_sent(zeroed, "lr × weight_decay = 1: the step erased the weight before its update, "
                                          "which leaves nothing to recover it from")

    def close(self, finished: bool = True, timeout: Optional[float] = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Sends the steps whose copy from the device is still under way (waiting for it), then the
        Monitor's close(): see Monitor.close (10 s by default; False, with a warning saying what is
        left unsent, when it gives up)."""
        self._send_copied(wait=True)
        return self.monitor.close(finished=finished, timeout=timeout)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)


class _HostCopies:
    """Device-to-host copies that the training thread does not wait for: each one goes into a pinned
    host buffer with non_blocking=True and records an event after it on the current stream; its
    values are read once the event says the copy is done. Buffers are reused once read.

    The buffers and events come from the two factories: for CUDA, pinned memory and torch.cuda.Event
    (for_cuda); a test on the CPU gives plain buffers and events it completes itself, which runs the
    same bookkeeping (tests/python/test_torch.py)."""

    def __init__(self, make_buffer: Callable[[int], torch.Tensor], make_event: Callable[[], Any]) -> None:
        self._make_buffer = make_buffer
        self._make_event = make_event
        self._free: List[torch.Tensor] = []

    @classmethod
    def for_cuda(cls) -> "_HostCopies":
        return cls(lambda n: torch.empty(n, dtype=torch.float64, pin_memory=True), torch.cuda.Event)

    def start(self, values: torch.Tensor) -> Tuple[torch.Tensor, Any, int]:
        n = values.numel()
        fitting = [b for b in self._free if b.numel() >= n]
        buffer = fitting[0] if fitting else self._make_buffer(max(n, 1))
        if fitting:
            self._free.remove(buffer)
        buffer[:n].copy_(values, non_blocking=True)
        event = self._make_event()
        event.record()
        return buffer, event, n

    def values(self, copy: Tuple[torch.Tensor, Any, int], wait: bool) -> Optional[List[float]]:
        """The copied values, or None when the copy is not done and wait is False."""
        buffer, event, n = copy
        if not event.query():
            if not wait:
                return None
            event.synchronize()
        host = buffer[:n].tolist()
        self._free.append(buffer)
        return host


class _RadialTerms:
    """One step's radial updates while they are computed: the tensors for the one device-to-host copy
    (norms, to be squared, and inner products, in the order the terms use them) and, per parameter,
    how its value follows from them."""

    def __init__(self) -> None:
        self.norms: List[torch.Tensor] = []
        self.dots: List[torch.Tensor] = []
        # (parameter index, "copy" | "adam" | "unmoved", c, s): see values().
        self._terms: List[Tuple[int, str, float, float]] = []

    def add_copies(self, indices: Sequence[int], before_norms: List[torch.Tensor],
                   dots: List[torch.Tensor]) -> None:
        """Parameters measured from a copy: |w0| and ⟨Δw, w0⟩ of each."""
        self._terms.extend((i, "copy", 1.0, 0.0) for i in indices)
        self.norms.extend(before_norms)
        self.dots.extend(dots)

    def add_unmoved(self, i: int) -> None:
        """A parameter the optimizer did not step: Δw = 0."""
        self._terms.append((i, "unmoved", 1.0, 0.0))

    def add_adam(self, i: int, c: float, s: float) -> None:
        """A parameter with w1 = c·w0 − s·q, whose q comes with the next add_adam_batch."""
        self._terms.append((i, "adam", c, s))

    def add_adam_batch(self, weights: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                       second_moments: List[torch.Tensor], eps: List[float]) -> None:
        """|q| and ⟨w1, q⟩ of the add_adam() parameters since the last batch, in their order."""
        qs = _adam_directions(exp_avgs, second_moments, eps)
        self.norms.extend(_norms(qs))
        self.dots.extend(_dots_into(qs, weights))

    def values(self, keys: List[str], weight_squares: List[float], squares_and_dots: List[float],
               squared: bool) -> Dict[str, float]:
        """updates/radial/<param> of each parameter: ⟨Δw, w0⟩ when squared (a shard's part), else
        ⟨Δw, w0⟩/|w0|, not sent when w0 = 0 (no direction). squares_and_dots: the squared norms, then
        the inner products, as copied from the device; weight_squares: each parameter's |w1|²."""
        sq, dots = squares_and_dots[:len(self.norms)], squares_and_dots[len(self.norms):]
        out: Dict[str, float] = {}
        k = 0
        for i, how, c, s in self._terms:
            w1_sq = weight_squares[i]
            if how == "unmoved":
                dot, w0_sq = 0.0, w1_sq
            elif how == "copy":
                dot, w0_sq = dots[k], sq[k]
                k += 1
            else:
                # w0 = (w1 + s·q)/c and Δw = ((c − 1)·w1 − s·q)/c, with a = ⟨w1, q⟩ and b = |q|².
                a, b = dots[k], sq[k]
                k += 1
                dot = ((c - 1.0) * w1_sq + (c - 2.0) * s * a - s * s * b) / (c * c)
                w0_sq = (w1_sq + 2.0 * s * a + s * s * b) / (c * c)
            if squared:
                out[keys[i]] = dot
            elif not w0_sq <= 0.0:  # NaN and Inf are sent as they are
                out[keys[i]] = dot / math.sqrt(w0_sq)
        return out


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
