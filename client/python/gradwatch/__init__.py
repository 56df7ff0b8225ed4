"""gradwatch: stream a training run's gradient and parameter norms to gradwatchd.

    import gradwatch
    with gradwatch.Monitor("my-run", params=[...]) as mon:
        for step in range(steps):
            ...
            mon.log(step, {"train/loss": loss, "grad/norm/total": total, ...})
"""

from gradwatch._catalog import Param, infer_kind, parse_kind
from gradwatch._monitor import CLIENT_NAME, DEFAULT_ADDRESS, Monitor, MonitorStats
from gradwatch._version import __version__

__all__ = ["Monitor", "MonitorStats", "Param", "infer_kind", "parse_kind", "DEFAULT_ADDRESS", "CLIENT_NAME",
           "__version__"]
