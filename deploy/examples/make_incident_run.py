#!/usr/bin/python3
"""Write a W&B-history-style JSONL run shaped like the final_norm incident in DESIGN.md.

Line 1 is a header (run id, labels, config, parameter catalog). Every other line is either one
reported step ({"_step": N, "_timestamp": ..., "grad/norm/total": ..., ...}) or an event
({"_step": 81716, "event": "switched to near-dropless EP routing"}), in step order.

The shape, with steps on the x-axis:
  * grad/norm/total is 0.28 at step 58,000 and rises 5e-6 per step, then 1.0e-5 per step after the
    routing switch at step 81,716; 3% lognormal noise and a one-step x1.5 spike every few thousand
    steps on top.
  * lm_head.weight carries 90-95% of the squared total; the per-parameter grad norms are chosen so
    that their squares sum to the squared total.
  * params/norm/final_norm.weight (a norm gain without weight decay) rises 1.0 per 1k steps to ~340
    at the switch and 2.5 per 1k steps after it.
  * train/loss falls slowly from ~2.1 to ~1.9, train/z_loss is a few 1e-4, the learning rate follows
    a cosine decay.

Every value at a step depends only on --seed and the step, so a finer --every gives a superset of
the same samples. Uses the Python standard library only.

--remedy-weight-decay WD writes the run remedied from --from-step instead: a catalog change line
({"_step": FROM, "params": [{"name": "final_norm.weight", "weight_decay": WD}]}) first, then steps
where the final norm follows AdamW's norm map with decoupled decay WD at the run's learning rate,
its update's radial part per unit learning rate the one that made it grow 2.5 per 1k steps at the
change (an Adam update scales with the learning rate), and the lm_head's gradient (and so the
total) scales with it, the incident's mechanism.
"""

import argparse
import json
import math
import os
import random
import sys

RUN_ID = "moe-incident-demo"
HIDDEN_SIZE = 6144
VOCAB_SIZE = 128256
NUM_EXPERTS = 64
EXPERT_FFN = 1536

EVENT_STEP = 81716
EVENT_TEXT = "switched to near-dropless EP routing"

# Wall time of step 0 (2026-11-02T00:00:00Z) and seconds per step.
T0_SECONDS = 1793577600.0
SECONDS_PER_STEP = 1.7

# grad/norm/total: value at the anchor step and slopes per step before/after the event.
GRAD_ANCHOR_STEP = 58000
GRAD_AT_ANCHOR = 0.28
GRAD_SLOPE_BEFORE = 5e-6
GRAD_SLOPE_AFTER = 1.0e-5
GRAD_NOISE_SIGMA = 0.03           # lognormal sigma, i.e. ~3%
SPIKE_FACTOR = 1.5
SPIKE_BLOCK_STEPS = 4000          # at most one spike per block, at a seeded position

# params/norm/final_norm.weight: value at the event and slopes per 1,000 steps.
FINAL_NORM_AT_EVENT = 340.0
FINAL_NORM_SLOPE_BEFORE_PER_KSTEP = 1.0
FINAL_NORM_SLOPE_AFTER_PER_KSTEP = 2.5

# Share of the squared total grad norm carried by lm_head: 0.905 at step 50k rising to 0.945 at 110k
# (it follows the growing final_norm gain), with +-0.004 jitter, so always within 90-95%.
LM_HEAD_SHARE_START = 0.905
LM_HEAD_SHARE_END = 0.945
LM_HEAD_SHARE_JITTER = 0.004
SHAPE_FIRST_STEP = 50000
SHAPE_LAST_STEP = 110000

# Cosine learning-rate schedule.
LR_PEAK = 3.0e-4
LR_MIN = 3.0e-5
LR_WARMUP_STEPS = 2000
LR_DECAY_STEPS = 150000


def _param(name, numel, kind, weight_decay, role=None):
    entry = {"name": name, "numel": numel, "kind": kind, "weight_decay": weight_decay}
    if role:
        entry["role"] = role
    return entry


PARAMS = [
    _param("final_norm.weight", HIDDEN_SIZE, "norm_gain", 0.0, role="final_norm"),
    _param("lm_head.weight", HIDDEN_SIZE * VOCAB_SIZE, "output", 0.1),
    _param("embed.weight", HIDDEN_SIZE * VOCAB_SIZE, "embedding", 0.1),
    _param("layers.0.qkv.weight", HIDDEN_SIZE * (HIDDEN_SIZE + 2 * 1024), "attention", 0.1),
    _param("layers.0.router.weight", NUM_EXPERTS * HIDDEN_SIZE, "router", 0.1),
    _param("layers.0.w13.weight", NUM_EXPERTS * 2 * HIDDEN_SIZE * EXPERT_FFN, "mlp", 0.1),
    _param("layers.0.norm.weight", HIDDEN_SIZE, "norm_gain", 0.0),
]

# Relative weights of the squared grad norm left over after lm_head (they are normalised).
OTHER_GRAD_WEIGHTS = {
    "final_norm.weight": 0.06,
    "embed.weight": 0.22,
    "layers.0.qkv.weight": 0.30,
    "layers.0.router.weight": 0.05,
    "layers.0.w13.weight": 0.34,
    "layers.0.norm.weight": 0.03,
}

# params/norm/<p> for the other parameters: value at step 50k and drift per 1,000 steps.
PARAM_NORM_LINES = {
    "lm_head.weight": (561.0, 0.05),
    "embed.weight": (598.0, -0.10),
    "layers.0.qkv.weight": (181.0, 0.04),
    "layers.0.router.weight": (12.4, 0.01),
    "layers.0.w13.weight": (902.0, 0.20),
    "layers.0.norm.weight": (96.0, 0.30),
}

# updates/norm/<p> is reported for these only: ~ lr * sqrt(numel) * factor (AdamW updates scale
# with the learning rate, not with the gradient).
UPDATE_FACTORS = {
    "final_norm.weight": 0.45,
    "lm_head.weight": 0.12,
    "layers.0.router.weight": 0.30,
}


def _sig(value, digits=6):
    """Round to `digits` significant digits so the file stays small; keeps NaN/Inf."""
    if not math.isfinite(value) or value == 0.0:
        return value
    return float(f"{value:.{digits}g}")


def grad_total_trend(step):
    # Flat before the shape's first step so the extrapolation never goes near zero.
    step = max(step, SHAPE_FIRST_STEP)
    if step <= EVENT_STEP:
        return GRAD_AT_ANCHOR + GRAD_SLOPE_BEFORE * (step - GRAD_ANCHOR_STEP)
    at_event = GRAD_AT_ANCHOR + GRAD_SLOPE_BEFORE * (EVENT_STEP - GRAD_ANCHOR_STEP)
    return at_event + GRAD_SLOPE_AFTER * (step - EVENT_STEP)


def final_norm_trend(step):
    if step < SHAPE_FIRST_STEP:
        # Straight from the ones-initialised gain (sqrt(hidden_size) ~ 78.4) to the shape's first step.
        start = math.sqrt(HIDDEN_SIZE)
        return start + (final_norm_trend(SHAPE_FIRST_STEP) - start) * step / SHAPE_FIRST_STEP
    slope = FINAL_NORM_SLOPE_BEFORE_PER_KSTEP if step <= EVENT_STEP else FINAL_NORM_SLOPE_AFTER_PER_KSTEP
    return FINAL_NORM_AT_EVENT + slope * (step - EVENT_STEP) / 1000.0


def learning_rate(step):
    if step < LR_WARMUP_STEPS:
        return LR_PEAK * (step + 1) / LR_WARMUP_STEPS
    progress = min(1.0, (step - LR_WARMUP_STEPS) / (LR_DECAY_STEPS - LR_WARMUP_STEPS))
    return LR_MIN + 0.5 * (LR_PEAK - LR_MIN) * (1.0 + math.cos(math.pi * progress))


def _shape_fraction(step):
    span = SHAPE_LAST_STEP - SHAPE_FIRST_STEP
    return min(1.0, max(0.0, (step - SHAPE_FIRST_STEP) / span))


def spike_steps(seed, first, last, every):
    """One spike per SPIKE_BLOCK_STEPS block, at a seeded offset snapped to the reporting grid."""
    spikes = set()
    block = (first // SPIKE_BLOCK_STEPS) * SPIKE_BLOCK_STEPS
    while block <= last:
        rng = random.Random(f"{seed}:spike:{block}")
        offset = rng.randrange(SPIKE_BLOCK_STEPS // 8, SPIKE_BLOCK_STEPS - SPIKE_BLOCK_STEPS // 8)
        step = block + offset
        step -= (step - first) % every
        if first <= step <= last:
            spikes.add(step)
        block += SPIKE_BLOCK_STEPS
    return spikes


def step_record(step, seed, spike, nan):
    rng = random.Random(f"{seed}:step:{step}")
    frac = _shape_fraction(step)

    total = grad_total_trend(step) * math.exp(rng.gauss(0.0, GRAD_NOISE_SIGMA))
    if spike:
        total *= SPIKE_FACTOR

    lm_share = LM_HEAD_SHARE_START + (LM_HEAD_SHARE_END - LM_HEAD_SHARE_START) * frac
    lm_share += rng.uniform(-LM_HEAD_SHARE_JITTER, LM_HEAD_SHARE_JITTER)
    jittered = {name: w * math.exp(rng.gauss(0.0, 0.1)) for name, w in OTHER_GRAD_WEIGHTS.items()}
    jitter_sum = sum(jittered.values())
    shares = {"lm_head.weight": lm_share}
    for name, w in jittered.items():
        shares[name] = (1.0 - lm_share) * w / jitter_sum

    record = {"_step": step, "_timestamp": round(T0_SECONDS + step * SECONDS_PER_STEP, 3)}
    record["grad/norm/total"] = float("nan") if nan else _sig(total, 5)
    for p in PARAMS:
        name = p["name"]
        value = float("nan") if nan and name == "lm_head.weight" else _sig(total * math.sqrt(shares[name]), 5)
        record[f"grad/norm/{name}"] = value

    kstep = (step - SHAPE_FIRST_STEP) / 1000.0
    for p in PARAMS:
        name = p["name"]
        if name == "final_norm.weight":
            value = final_norm_trend(step)
        else:
            start, per_kstep = PARAM_NORM_LINES[name]
            value = start + per_kstep * kstep
        record[f"params/norm/{name}"] = _sig(value * (1.0 + rng.gauss(0.0, 2e-5)), 5)

    lr = learning_rate(step)
    for p in PARAMS:
        factor = UPDATE_FACTORS.get(p["name"])
        if factor is not None:
            value = lr * math.sqrt(p["numel"]) * factor * math.exp(rng.gauss(0.0, 0.02))
            record[f"updates/norm/{p['name']}"] = _sig(value, 4)

    loss = 2.1 - 0.2 * frac ** 0.8 + rng.gauss(0.0, 0.006) + (0.03 if spike else 0.0)
    gain_ratio = final_norm_trend(step) / FINAL_NORM_AT_EVENT
    z_loss = 1e-4 * (2.0 + 1.5 * gain_ratio ** 2) * math.exp(rng.gauss(0.0, 0.05))
    record["train/loss"] = _sig(loss, 5)
    record["train/z_loss"] = _sig(z_loss, 4)
    record["optim/learning_rate"] = _sig(lr, 4)
    return record


def header():
    return {
        "run": RUN_ID,
        "labels": {"job": "moe-pretrain-6b", "cluster": "demo-cluster", "user": "demo"},
        "config": {"hidden_size": HIDDEN_SIZE, "z_loss_coef": 1e-4, "optimizer": "adamw", "weight_decay": 0.1},
        "params": PARAMS,
    }


class Remedy:
    """The final norm from a weight-decay change at `first` on: n ← (1 − ηλ)·n + η·ρ, step by step."""

    def __init__(self, first, weight_decay):
        self.step = first
        self.weight_decay = weight_decay
        self.norm = final_norm_trend(first)
        # ρ: the growth a step without decay at the change, per unit learning rate.
        self.radial = (final_norm_trend(first) - final_norm_trend(first - 1)) / learning_rate(first)

    def advance_to(self, step):
        while self.step < step:
            self.step += 1
            lr = learning_rate(self.step)
            self.norm = (1.0 - lr * self.weight_decay) * self.norm + lr * self.radial
        return self.norm

    def apply(self, record):
        """The untreated record at its step, with the remedied final norm and what it drives."""
        step = record["_step"]
        k = self.advance_to(step) / final_norm_trend(step)
        lm_sq = record["grad/norm/lm_head.weight"] ** 2
        total_sq = record["grad/norm/total"] ** 2
        record["grad/norm/lm_head.weight"] = _sig(math.sqrt(lm_sq) * k, 5)
        record["grad/norm/total"] = _sig(math.sqrt(total_sq - lm_sq + lm_sq * k * k), 5)
        record["params/norm/final_norm.weight"] = _sig(record["params/norm/final_norm.weight"] * k, 5)
        return record


def generate(out, first, last, every, seed, nan_steps, remedy_weight_decay=None):
    dumps = lambda obj: json.dumps(obj, allow_nan=True, separators=(",", ":"))
    out.write(dumps(header()) + "\n")
    remedy = None
    if remedy_weight_decay is not None:
        remedy = Remedy(first, remedy_weight_decay)
        out.write(dumps({"_step": first, "params": [{"name": "final_norm.weight",
                                                     "weight_decay": remedy_weight_decay}]}) + "\n")
    spikes = spike_steps(seed, first, last, every)
    event_written = not (first <= EVENT_STEP <= last)
    for step in range(first, last + 1, every):
        if not event_written and step > EVENT_STEP:
            out.write(dumps({"_step": EVENT_STEP, "event": EVENT_TEXT}) + "\n")
            event_written = True
        record = step_record(step, seed, step in spikes, step in nan_steps)
        out.write(dumps(remedy.apply(record) if remedy else record) + "\n")
        if not event_written and step == EVENT_STEP:
            out.write(dumps({"_step": EVENT_STEP, "event": EVENT_TEXT}) + "\n")
            event_written = True
    if not event_written:
        out.write(dumps({"_step": EVENT_STEP, "event": EVENT_TEXT}) + "\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Write a JSONL training run shaped like the final_norm / lm_head grad-norm incident "
                    "(header line, one line per reported step, an event line at step %d)." % EVENT_STEP)
    parser.add_argument("--out", metavar="FILE", default="-", help="output file ('-' or absent: stdout)")
    parser.add_argument("--from-step", type=int, default=50000, metavar="STEP", help="first reported step (default 50000)")
    parser.add_argument("--to-step", type=int, default=110000, metavar="STEP", help="last reported step, inclusive (default 110000)")
    parser.add_argument("--every", type=int, default=50, metavar="N", help="report every N steps (default 50)")
    parser.add_argument("--seed", type=int, default=20261120, metavar="N", help="random seed (default 20261120)")
    parser.add_argument("--nan-step", type=int, action="append", default=[], metavar="STEP",
                        help="write NaN for grad/norm/total and lm_head's grad norm at this reported step "
                             "(repeatable; default none)")
    parser.add_argument("--remedy-weight-decay", type=float, metavar="WD",
                        help="the run remedied from --from-step: weight decay WD on final_norm.weight (a params "
                             "line), its norm following AdamW's norm map")
    args = parser.parse_args(argv)
    if args.remedy_weight_decay is not None and not args.remedy_weight_decay > 0:
        parser.error("--remedy-weight-decay must be above 0")
    if args.every < 1:
        parser.error("--every must be at least 1")
    if args.from_step < 0 or args.to_step < args.from_step:
        parser.error("need 0 <= --from-step <= --to-step")
    return args


def main(argv):
    args = parse_args(argv)
    nan_steps = set(args.nan_step)
    if args.out == "-":
        try:
            generate(sys.stdout, args.from_step, args.to_step, args.every, args.seed, nan_steps,
                     args.remedy_weight_decay)
            sys.stdout.flush()
        except BrokenPipeError:
            # A reader such as `head` went away: stop quietly, like other Unix filters.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    else:
        with open(args.out, "w", encoding="utf-8") as out:
            generate(out, args.from_step, args.to_step, args.every, args.seed, nan_steps, args.remedy_weight_decay)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
