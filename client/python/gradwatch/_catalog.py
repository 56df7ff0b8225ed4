"""The parameter catalog and the metric keys, as gradwatch's JSONL replay reads them.

Keys: ``grad/norm/total`` (the total gradient norm), ``grad/norm/<param>``, ``params/norm/<param>``,
``updates/norm/<param>`` (a parameter's gradient, weight and optimizer-update norms),
``updates/radial/<param>`` (the radial part of the step's update, r = ⟨Δw, w⟩/|w| with Δw = w(t+1) − w(t)
and w = w(t), the weight before the step; signed, > 0 when the step grows the norm), ``train/loss``,
``train/z_loss``, ``optim/learning_rate``, ``train/tokens``; any other numeric key is kept as an extra
series under its own name.

A rank that holds a shard of its parameters logs with squared=True: its norms are then the squared
partial sums of its shards, and ``updates/radial/<param>`` is its shard's partial inner product
⟨Δw_s, w_s⟩, which the daemon sums over the ranks and divides by the merged parameter norm (so the rank
logs ``params/norm/<param>`` with it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gradwatch.v1 import gradwatch_pb2 as pb

TOTAL_GRAD = "grad/norm/total"
GRAD_PREFIX = "grad/norm/"
PARAM_PREFIX = "params/norm/"
UPDATE_PREFIX = "updates/norm/"
RADIAL_PREFIX = "updates/radial/"

KINDS = {
    "norm_gain": pb.PARAM_KIND_NORM_GAIN,
    "output": pb.PARAM_KIND_OUTPUT,
    "embedding": pb.PARAM_KIND_EMBEDDING,
    "router": pb.PARAM_KIND_ROUTER,
    "attention": pb.PARAM_KIND_ATTENTION,
    "mlp": pb.PARAM_KIND_MLP,
    "other": pb.PARAM_KIND_OTHER,
}
_ALIASES = {"norm": "norm_gain", "lm_head": "output", "embed": "embedding"}


def parse_kind(name: str) -> int:
    """A kind's name ("norm_gain", "output", ..., or the aliases "norm", "lm_head", "embed")."""
    n = name.lower()
    if n.startswith("param_kind_"):
        n = n[len("param_kind_"):]
    n = _ALIASES.get(n, n)
    if n not in KINDS:
        raise ValueError(f"unknown parameter kind {name!r} (one of {', '.join(KINDS)})")
    return KINDS[n]


def infer_kind(name: str) -> int:
    """The kind a parameter's name suggests: the rules of `gradwatch replay`."""
    n = name.lower()
    if "norm" in n or "ln_f" in n or "ln_" in n:
        return pb.PARAM_KIND_NORM_GAIN
    if "lm_head" in n:
        return pb.PARAM_KIND_OUTPUT
    if "embed" in n:
        return pb.PARAM_KIND_EMBEDDING
    # Attention and MLP before "gate" and "output": mlp.gate_proj is not a router and
    # attention.output.dense is not the lm_head.
    if "attn" in n or "attention" in n:
        return pb.PARAM_KIND_ATTENTION
    if any(s in n for s in ("mlp", "expert", "ffn", "gate_proj", "up_proj", "down_proj")):
        return pb.PARAM_KIND_MLP
    if "router" in n or "gate" in n:
        return pb.PARAM_KIND_ROUTER
    if "output" in n:
        return pb.PARAM_KIND_OUTPUT
    return pb.PARAM_KIND_OTHER


@dataclass
class Param:
    """One parameter tensor of the catalog."""

    name: str
    numel: int = 0
    kind: Optional[str] = None  # inferred from the name when None
    weight_decay: Optional[float] = None  # 0 for norm gains, else the run's default, when None
    init_norm: Optional[float] = None
    role: str = ""
    group: str = ""

    def to_proto(self, default_weight_decay: float) -> pb.ParamInfo:
        kind = parse_kind(self.kind) if self.kind is not None else infer_kind(self.name)
        if self.weight_decay is not None:
            wd = float(self.weight_decay)
        else:
            wd = 0.0 if kind == pb.PARAM_KIND_NORM_GAIN else default_weight_decay
        info = pb.ParamInfo(name=self.name, numel=int(self.numel), kind=kind, weight_decay=wd,
                            role=self.role, group=self.group)
        if self.init_norm is not None:
            info.init_norm = float(self.init_norm)
        return info


def as_param(entry: Any) -> Param:
    """A Param from a Param, a name, or a mapping with the JSONL header's fields."""
    if isinstance(entry, Param):
        return entry
    if isinstance(entry, str):
        return Param(name=entry)
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"name", "numel", "kind", "weight_decay", "init_norm", "role", "group"}
        if unknown:
            raise ValueError(f"parameter entry {dict(entry)!r}: unknown fields {sorted(unknown)}")
        if "name" not in entry:
            raise ValueError(f"parameter entry {dict(entry)!r} has no name")
        return Param(**entry)
    raise TypeError(f"a parameter is a name, a mapping or a gradwatch.Param, not {type(entry).__name__}")


def to_float(key: str, value: Any) -> float:
    """Anything float() takes: Python and numpy numbers, 0-d tensors and arrays, JAX scalars."""
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {key!r}: {value!r} is not a number ({e})") from None


@functools.lru_cache(maxsize=1 << 16)
def split_key(key: str):
    """(field, param) for a per-parameter key, else None; field is "grad", "param" or "update" (a norm:
    ParamStats' NormValue of that name) or "radial" (ParamStats.radial_update). Cached: a trainer sends
    the same keys every step."""
    if key == TOTAL_GRAD:
        return None
    for prefix, field in ((GRAD_PREFIX, "grad"), (PARAM_PREFIX, "param"), (UPDATE_PREFIX, "update"),
                          (RADIAL_PREFIX, "radial")):
        if key.startswith(prefix) and len(key) > len(prefix):
            return field, key[len(prefix):]
    return None


def set_scalar(stats: pb.StepStats, key: str, value: float) -> None:
    """Puts a key that is not a per-parameter key (split_key) into the step."""
    if key == TOTAL_GRAD:
        stats.total_grad.norm = value
    elif key == "train/loss":
        stats.loss = value
    elif key == "train/z_loss":
        stats.z_loss = value
    elif key == "optim/learning_rate":
        stats.learning_rate = value
    elif key == "train/tokens":
        if not (math.isfinite(value) and value >= 0 and value == int(value)):
            raise ValueError(f"'train/tokens' must be a non-negative count, not {value!r}")
        stats.tokens = int(value)
    else:
        stats.extra[key] = value
