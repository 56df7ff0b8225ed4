#!/usr/bin/python3
"""What gradwatch.torch.Watch.step costs a training step, on the example trainer's model.

Trains deploy/examples/tiny_trainer.py's TinyLM on CPU for --steps steps three times, interleaved
in rounds (the same seed and batches): without a Watch, with one (grad and param norms of every
parameter plus the total, one host copy), and with update norms too. Each Watch streams to a real
gradwatchd. Prints the median time of Watch.step alone and of a whole training step, per model
size, and --json writes them.

    PYTHONPATH=build/python GRADWATCHD_PATH=build/server/gradwatchd \\
        /usr/bin/python3 tests/bench/torch_watch_bench.py [--steps 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import support  # noqa: E402  (tests/python: starts a real gradwatchd)
import gradwatch.torch as gwt  # noqa: E402


def load_trainer():
    spec = importlib.util.spec_from_file_location("tiny_trainer", os.path.join(ROOT, "deploy", "examples",
                                                                                "tiny_trainer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(trainer, size: dict, steps: int, mode: str, address: str, run_id: str) -> tuple[list[float], list[float]]:
    """Per-step seconds of Watch.step and of the whole step."""
    torch.manual_seed(0)
    model = trainer.TinyLM(size["vocab"], size["dim"], size["layers"], size["heads"])
    optimizer = trainer.make_optimizer(model, 3e-3, 0.1)
    args = argparse.Namespace(vocab=size["vocab"], seq=size["seq"], batch=size["batch"], seed=0)
    watch = None
    if mode != "none":
        watch = gwt.Watch(model, optimizer, run=run_id, address=address, update_norms=mode == "update")
    watch_times, step_times = [], []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        tokens = trainer.batch(step, args)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, size["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        if watch is not None:
            before = time.perf_counter()
            watch.step(step, loss=loss)
            watch_times.append(time.perf_counter() - before)
        optimizer.zero_grad()
        step_times.append(time.perf_counter() - started)
    if watch is not None and not watch.close(finished=True):
        raise SystemExit(f"{run_id}: the daemon did not acknowledge every step")
    return watch_times, step_times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three modes")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trainer = load_trainer()
    sizes = [
        # The example trainer's defaults: 22 tensors.
        {"name": "example (2 layers, dim 32)", "layers": 2, "dim": 32, "heads": 4, "vocab": 64, "seq": 16, "batch": 8},
        # Many small tensors: what the Watch pays per tensor.
        {"name": "24 layers, dim 16", "layers": 24, "dim": 16, "heads": 4, "vocab": 64, "seq": 16, "batch": 8},
    ]
    daemon = support.Daemon()
    results = []
    try:
        for size in sizes:
            torch.manual_seed(0)
            model = trainer.TinyLM(size["vocab"], size["dim"], size["layers"], size["heads"])
            tensors = sum(1 for _ in model.parameters())
            weights = sum(p.numel() for p in model.parameters())
            times = {"none": ([], []), "watch": ([], []), "update": ([], [])}
            for r in range(args.rounds):
                for mode in times:
                    w, s = run(trainer, size, args.steps, mode, daemon.address, f"bench-{mode}-{len(results)}-{r}")
                    times[mode][0].extend(w[10:])  # the first steps warm caches and the stream
                    times[mode][1].extend(s[10:])
            row = {
                "model": size["name"],
                "tensors": tensors,
                "weights": weights,
                "train_step_ms": statistics.median(times["none"][1]) * 1e3,
                "watch_step_us": statistics.median(times["watch"][0]) * 1e6,
                "watch_update_step_us": statistics.median(times["update"][0]) * 1e6,
                "train_step_with_watch_ms": statistics.median(times["watch"][1]) * 1e3,
            }
            row["watch_share"] = row["watch_step_us"] / 1e3 / row["train_step_ms"]
            results.append(row)
            print(f"{row['model']}: {tensors} tensors, {weights:,} weights; training step {row['train_step_ms']:.2f} ms "
                  f"({row['train_step_with_watch_ms']:.2f} ms with the Watch); Watch.step {row['watch_step_us']:.0f} µs "
                  f"({100 * row['watch_share']:.1f}% of a step), {row['watch_update_step_us']:.0f} µs with update norms",
                  flush=True)
    finally:
        daemon.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "steps": args.steps, "rounds": args.rounds, "results": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
