#!/usr/bin/python3
"""What gradwatch.torch.Watch(radial_updates=True) adds to a training step, on CPU.

For one AdamW-trained tensor of 4,096, 1M and 16M elements, times Watch.step after optimizer.step()
in four set-ups, interleaved in rounds: plain (grad and param norms), radial_updates=True (the radial
update from AdamW's state, no copy), update_norms=True (a copy of the weights, the update norm) and
update_norms=True with radial_updates=True (the radial update from that copy). Prints, per size, the
median time each adds to the plain Watch.step, per tensor and per element: the cost of the radial
update from the state, of the copy method (keeping the copy included) and of the radial update on top
of an existing copy.

glibc's malloc returns a large freed block to the system, so a temporary of a step may be fresh
pages, which its first kernel faults in (~1.5 ns per element here): whether it does depends on the
heap's history, which swings the figures between runs. The script makes malloc keep freed memory
(mallopt), as CUDA's caching allocator does, unless --system-allocator; either way it also prints what
a fresh temporary costs (a kernel writing a new tensor, less the same kernel writing an existing one).

No daemon: the Watch's monitor takes the metrics and drops them. --json prints the figures as JSON
instead. Takes well under a minute.

    /usr/bin/python3 tests/bench/radial_cost.py [--json] [--rounds N] [--system-allocator]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Mapping

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.append(os.path.join(ROOT, "build", "python"))  # after PYTHONPATH: a build of one's choice first

import gradwatch.torch as gwt  # noqa: E402

SIZES = [4096, 1 << 20, 1 << 24]
# Rounds per size at --rounds 1.0: a 16M-element AdamW step takes ~0.1 s on one core.
ROUNDS = {4096: 200, 1 << 20: 40, 1 << 24: 8}
SETUPS = {
    "plain": {},
    "radial_from_state": {"radial_updates": True},
    "copy": {"update_norms": True},
    "radial_from_copy": {"update_norms": True, "radial_updates": True},
}


class NullMonitor:
    """What Watch needs of a Monitor: every call is taken, and nothing is kept."""

    def log(self, step: int, metrics: Mapping[str, Any], squared: bool = False) -> bool:
        return True

    def event(self, step: int, text: str) -> bool:
        return True

    def update_params(self, step: int, params: Any) -> bool:
        return True


class One(torch.nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(numel) * 0.02)


def keep_freed_memory() -> bool:
    """Makes glibc's malloc serve every block from its heap and keep what is freed (up to 2 GiB at the
    heap's top) rather than give it back to the system; False where that is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2 ** 31 - 1))


def measure(numel: int, rounds: int) -> Dict[str, float]:
    """Median seconds of Watch.step per set-up, and of a kernel writing a new and an existing tensor."""
    torch.manual_seed(0)
    runs = {}
    for name, options in SETUPS.items():
        model = One(numel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        watch = gwt.Watch(model, optimizer, monitor=NullMonitor(), init_norms=False, **options)
        runs[name] = (model, optimizer, watch, [])
    grad = torch.randn(numel)
    existing = torch.empty(numel)
    new_times: List[float] = []
    existing_times: List[float] = []
    for step in range(1, rounds + 2):
        for model, optimizer, watch, times in runs.values():
            model.weight.grad = grad
            optimizer.step()
            started = time.perf_counter()
            watch.step(step)
            if step > 1:  # the first step allocates the optimizer's state and warms up
                times.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.abs(grad)
        between = time.perf_counter()
        torch.abs(grad, out=existing)
        if step > 1:
            new_times.append(between - started)
            existing_times.append(time.perf_counter() - between)
    medians = {name: statistics.median(times) for name, (_, _, _, times) in runs.items()}
    medians["new_tensor"] = statistics.median(new_times)
    medians["existing_tensor"] = statistics.median(existing_times)
    return medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--rounds", type=float, default=1.0, help="scale the rounds per size (default 1)")
    ap.add_argument("--system-allocator", action="store_true",
                    help="leave glibc's malloc as it is (temporaries may be fresh pages at each step)")
    args = ap.parse_args()
    allocator = "glibc malloc as it is"
    if not args.system_allocator:
        allocator = "malloc keeping freed memory" if keep_freed_memory() else "the system's malloc (not glibc)"
    results: List[Dict[str, Any]] = []
    for numel in SIZES:
        t = measure(numel, max(3, int(ROUNDS[numel] * args.rounds)))
        added = {
            "radial_from_state": t["radial_from_state"] - t["plain"],
            "copy_method": t["radial_from_copy"] - t["plain"],
            "radial_on_existing_copy": t["radial_from_copy"] - t["copy"],
            "update_norms_copy": t["copy"] - t["plain"],
            "fresh_temporary": t["new_tensor"] - t["existing_tensor"],
        }
        results.append({"numel": numel,
                        "watch_step_ms": {k: v * 1e3 for k, v in t.items() if k in SETUPS},
                        "added_ms": {k: v * 1e3 for k, v in added.items()},
                        "added_ns_per_element": {k: v * 1e9 / numel for k, v in added.items()}})
    if args.json:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "allocator": allocator,
                   "results": results}, sys.stdout, indent=2)
        print()
        return 0
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s), {allocator}; AdamW, one tensor; "
          f"median Watch.step added to the plain one")
    columns = {"radial_from_state": "radial from state", "copy_method": "copy method (all)",
               "radial_on_existing_copy": "radial on a copy", "update_norms_copy": "update_norms copy",
               "fresh_temporary": "(a fresh temporary)"}
    print(f"{'elements':>10}  {'plain':>9}  " + "  ".join(f"{title:>21}" for title in columns.values()))
    for r in results:
        cells = [f"{r['added_ms'][k]:8.3f} ms {r['added_ns_per_element'][k]:6.2f} ns/el" for k in columns]
        print(f"{r['numel']:>10,}  {r['watch_step_ms']['plain']:6.3f} ms  " + "  ".join(f"{c:>21}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
