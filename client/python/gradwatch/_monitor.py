"""gradwatch.Monitor: a trainer rank's stream of per-step norms to gradwatchd.

The training loop calls log(), event() and update_params(), which only queue; a background thread
connects, sends, resends what the daemon has not acknowledged after a reconnect, and hands alerts to a
callback.

log() takes the JSONL keys (gradwatch._catalog lists them). updates/radial/<param>, the radial part of a
step's update r = ⟨Δw, w⟩/|w| (signed), goes into ParamStats.radial_update: as `radial`, or, under
log(..., squared=True), as `dot`, the rank's ⟨Δw_s, w_s⟩ over its shard.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence

import grpc

from gradwatch import _catalog
from gradwatch._version import __version__
from gradwatch.v1 import gradwatch_pb2 as pb
from gradwatch.v1 import gradwatch_pb2_grpc as pb_grpc

DEFAULT_ADDRESS = "127.0.0.1:7390"
CLIENT_NAME = f"gradwatch-python/{__version__}"

log = logging.getLogger("gradwatch")

_END = object()  # ends a connection's request iterator

# The client's warnings (logger "gradwatch", WARNING): each kind at most once per this many seconds per
# daemon (the unreachable daemon, the queue past half its capacity, steps dropped).
_WARN_INTERVAL = 60.0

# Seconds the daemon may stay unreachable, with steps or events to send, before the Monitor warns.
_UNREACHABLE_AFTER = 5.0

# close()'s default timeout, in seconds.
DEFAULT_CLOSE_TIMEOUT = 10.0

# The largest step the daemon keeps (2^63 - 1: its journal stores signed 64-bit integers).
MAX_STEP = (1 << 63) - 1


def _count(n: int, what: str) -> str:
    """"1 step", "2 steps"."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _step(step: Any, what: str) -> int:
    """`step` as an int in 0..MAX_STEP; ValueError naming `what` otherwise."""
    step = int(step)
    if step < 0:
        raise ValueError(f"{what}step {step} is negative")
    if step > MAX_STEP:
        raise ValueError(f"{what}step {step} is above the largest step the daemon keeps, {MAX_STEP} (2^63 - 1)")
    return step

# Errors after which the daemon asks for the message again: it took neither it nor any later one
# on the stream. The client keeps them all and resends them on a new stream after a back-off; any
# other Error naming a step, event or catalog update refuses that message for good.
_RETRYABLE = frozenset({pb.ERROR_REASON_STORAGE_UNAVAILABLE})


@dataclass
class MonitorStats:
    """What the Monitor has done so far, a copy taken by Monitor.stats() (with several daemons, see
    Monitor.stats() for how each field is merged; stats_by_daemon() has each daemon's).

    Counts are of messages (steps, events, catalog updates) since the Monitor was made; a step is
    one log() call.

    queued: steps, events and catalog updates (and the Goodbye of close()) waiting to be written
        on the stream: not sent yet, or to be sent again after a reconnect.
    unacked: those written on the current stream and not yet acknowledged (steps not yet durable,
        events and catalog updates not yet acked). queued + unacked is what would be lost now.
    sent: step messages written, resends after a reconnect included.
    events_sent: event messages written, resends included.
    catalog_updates_sent: CatalogUpdate messages (update_params()) written, resends included.
    acked_through_step: the last step the daemon acknowledged durable (None: none yet).
    dropped: steps log() did not take: the queue held queue_capacity steps already (each is
        reported to the daemon with the next step sent), or the Monitor was closing.
    refused: steps, events and catalog updates the daemon refused for good (a permanent Error:
        invalid, a regression, a conflict...): not kept, never durable. A retryable refusal
        (ERROR_REASON_STORAGE_UNAVAILABLE) is not counted here: those are kept and sent again.
    errors: Error messages from the daemon, retryable ones included.
    errors_by_reason: errors by the ErrorReason's name ("ERROR_REASON_STEP_CONFLICT": 2).
    reconnects: streams the daemon accepted after the first one.
    connected: a stream is open and accepted now.
    storage_retrying: the daemon cannot store now (ERROR_REASON_STORAGE_UNAVAILABLE since its last
        ack): what it refused is kept and sent again on a new stream after a back-off.
    rejected: the daemon refused this rank's Hello (errors_by_reason and last_error say why):
        nothing more is sent to it, nothing more becomes durable.
    finished: the daemon confirmed the Goodbye of close(finished=True).
    last_error: the last failure, as text: the daemon's Error ("REASON: message") or the stream's
        gRPC status ("UNAVAILABLE: ..."); empty while there has been none.
    """

    queued: int = 0
    unacked: int = 0
    sent: int = 0
    events_sent: int = 0
    catalog_updates_sent: int = 0
    acked_through_step: Optional[int] = None
    dropped: int = 0
    refused: int = 0
    errors: int = 0
    errors_by_reason: Dict[str, int] = field(default_factory=dict)
    reconnects: int = 0
    connected: bool = False
    storage_retrying: bool = False
    rejected: bool = False
    finished: bool = False
    last_error: str = ""


@dataclass
class _Item:
    kind: str  # "step", "event", "catalog" or "goodbye"
    seq: int
    step: int = 0  # a catalog update's from_step
    wall_time: float = 0.0
    values: Optional[Dict[str, float]] = None
    dropped_before: int = 0  # steps dropped before this one, reported with it
    text: str = ""
    squared: bool = False  # norms given as squared (partial) sums
    changes: Optional[List[pb.ParamChange]] = None  # a catalog update's
    # The catalog fields the update replaced, as they were, once it was first written: a refused
    # update puts them back.
    undo: Optional[List[pb.ParamChange]] = None


_CHANGE_FIELDS = ("weight_decay", "kind", "role", "group")
_MAX_LABEL_BYTES = 256  # a role's or group's length, as the daemon allows it


def _param_change(entry: Any, index: Mapping[str, int]) -> pb.ParamChange:
    """One update_params() entry as a ParamChange, checked as the daemon checks it."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"update_params: a change is a mapping with a name, not {type(entry).__name__}")
    unknown = set(entry) - {"name", *_CHANGE_FIELDS}
    if unknown:
        raise ValueError(f"update_params: {dict(entry)!r}: unknown fields {sorted(unknown)} "
                         f"(name, {', '.join(_CHANGE_FIELDS)})")
    name = entry.get("name")
    if not name:
        raise ValueError(f"update_params: {dict(entry)!r} has no name")
    if name not in index:
        raise ValueError(f"update_params: {name!r} is not in the catalog (log() or the params argument "
                         f"adds parameters; an update only changes them)")
    if not any(f in entry for f in _CHANGE_FIELDS):
        raise ValueError(f"update_params: {name!r}: no field to change ({', '.join(_CHANGE_FIELDS)})")
    change = pb.ParamChange(name=name)
    if "weight_decay" in entry:
        try:
            wd = float(entry["weight_decay"])
        except (TypeError, ValueError):
            raise ValueError(f"update_params: {name!r}: weight_decay {entry['weight_decay']!r} is not a number") \
                from None
        if not (math.isfinite(wd) and wd >= 0):
            raise ValueError(f"update_params: {name!r}: weight_decay must be finite and >= 0, not {wd!r}")
        change.weight_decay = wd
    if "kind" in entry:
        try:
            change.kind = _catalog.parse_kind(str(entry["kind"]))
        except ValueError as e:
            raise ValueError(f"update_params: {name!r}: {e}") from None
    for field_name in ("role", "group"):
        if field_name in entry:
            text = entry[field_name]
            if not isinstance(text, str):
                raise ValueError(f"update_params: {name!r}: {field_name} must be text, not {text!r}")
            if len(text.encode()) > _MAX_LABEL_BYTES:
                raise ValueError(f"update_params: {name!r}: {field_name} is over {_MAX_LABEL_BYTES} bytes")
            setattr(change, field_name, text)
    return change


def _param_changes(params: Sequence[Mapping[str, Any]], index: Mapping[str, int]) -> List[pb.ParamChange]:
    """update_params()'s entries as ParamChanges; ValueError or TypeError names what is wrong."""
    if isinstance(params, (str, bytes, Mapping)):
        raise TypeError("update_params: params is a sequence of mappings, one per parameter")
    changes = [_param_change(entry, index) for entry in params]
    if not changes:
        raise ValueError("update_params: no parameter to change")
    seen = set()
    for c in changes:
        if c.name in seen:
            raise ValueError(f"update_params: {c.name!r} is named twice")
        seen.add(c.name)
    return changes


def _check_radial_dots(values: Mapping[str, float]) -> None:
    """A squared step's radial updates are partial inner products, which the daemon divides by the
    merged parameter norm: each needs the rank's params/norm/<param> (the daemon refuses the step
    without it)."""
    for key in values:
        split = _catalog.split_key(key)
        if split is not None and split[0] == "radial" and _catalog.PARAM_PREFIX + split[1] not in values:
            raise ValueError(f"{key!r} with squared=True is this rank's ⟨Δw_s, w_s⟩, which the daemon divides by "
                             f"the merged parameter norm: log {_catalog.PARAM_PREFIX + split[1]!r} with it")


class _Stream:
    """Streams one rank of a run to one gradwatchd from a background thread (Monitor's per daemon).

    run: the run's id. address: the daemon's gRPC HOST:PORT. rank and world_size: this process's
    place in the job; the daemon completes a step once every rank sent it (with world_size > 1 each
    rank logs the squared sums of its shards' norms, log(..., squared=True), which the daemon
    adds up). labels: the run's labels. config: the run's config (hidden_size, z_loss_coef,
    optimizer, weight_decay, and any other key as extra text). params: the parameter catalog, as
    names, mappings with the JSONL header's fields, or gradwatch.Param; parameters that log() names
    and the catalog lacks are appended to it (kind inferred from the name, weight decay 0 for norm
    gains, else config's weight_decay). resume_from_step: the first step this process logs after
    resuming from a checkpoint (the daemon drops what it held from there on). on_alert: called with
    each gradwatch.v1.Alert the daemon sends this stream, on the Monitor's thread.

    Never blocks training: log(), event() and update_params() queue, up to queue_capacity steps
    held (queued or written and not yet durable); beyond it a step is dropped and counted, and the
    daemon is told with the next step sent. Events and catalog updates share event_capacity.
    """

    def __init__(
        self,
        run: str,
        address: str = DEFAULT_ADDRESS,
        rank: int = 0,
        world_size: int = 1,
        labels: Optional[Mapping[str, str]] = None,
        config: Optional[Mapping[str, Any]] = None,
        params: Optional[Iterable[Any]] = None,
        resume_from_step: Optional[int] = None,
        on_alert: Optional[Callable[[pb.Alert], None]] = None,
        on_error: Optional[Callable[[pb.Error], None]] = None,
        queue_capacity: int = 10_000,
        event_capacity: int = 1_000,
        max_unacked_steps: int = 1024,
        initial_backoff: float = 0.1,
        max_backoff: float = 10.0,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        token: Optional[str] = None,
        start: bool = True,
    ) -> None:
        if not run:
            raise ValueError("run: a run id is required")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
        self._run = run
        self._address = address
        self._rank = rank
        self._world_size = world_size
        self._labels = dict(labels or {})
        self._config = self._run_config(config or {})
        self._default_wd = self._config.weight_decay if self._config.HasField("weight_decay") else 0.0
        self._resume_from_step = resume_from_step
        self._on_alert = on_alert
        self._on_error = on_error
        self._queue_capacity = queue_capacity
        self._event_capacity = event_capacity
        self._max_unacked = max_unacked_steps
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff

        self._lock = threading.Condition()
        self._params: List[pb.ParamInfo] = []
        self._index: Dict[str, int] = {}
        for entry in params or []:
            self._add_param(_catalog.as_param(entry))
        self._catalog_sent = 0  # catalog entries the current stream's Hello carried
        self._seq = 0
        self._pending: Deque[_Item] = deque()  # to write on the current stream, in order
        self._inflight: List[_Item] = []  # written on it, not yet durable (steps) or acked (events)
        self._steps_held = 0
        self._events_held = 0
        self._dropped_unreported = 0
        self._last_logged_step: Optional[int] = None
        self._owed_through: Optional[int] = None  # steps an earlier process sent, received only
        self._stats = MonitorStats()
        self._outbox: Optional[queue.Queue] = None  # the current stream's requests
        self._accepted = False
        self._acks_events = False
        self._hello_seq = 0
        self._goodbye: Optional[_Item] = None
        self._stopping = False
        self._call = None
        self._backoff = initial_backoff  # the next reconnect's delay (before jitter)
        self._delay = 0.0  # the delay before the current (or next) stream
        # The current stream got a retryable Error: it is being ended, nothing more is written on it.
        self._ending = False
        # Streams opened so far (the current one's number), when the current one was opened, and the
        # number of the last one that ended: flush() and close() wait through a reconnect with them.
        self._opened = 0
        self._opened_at = 0.0
        self._ended = 0
        self._backing_off = False  # _run_loop waits before the next stream
        self._retry_now = False  # flush() or close() cut that wait short (the daemon was unreachable)
        # Warnings: when each kind was last logged; since when steps or events wait with no stream
        # accepted; whether that outage was warned of (its end is then logged too); the last stream's
        # gRPC failure; whether the queue passing half its capacity is to be warned of; the steps
        # dropped since the last warning about drops.
        self._warned_at: Dict[str, float] = {}
        self._down_since: Optional[float] = None
        self._outage_warned = False
        self._rpc_error = ""
        self._half_armed = True
        self._dropped_since_warning = 0
        self._thread: Optional[threading.Thread] = None
        self._channel = _channel(address, tls_ca, tls_cert, tls_key, tls_server_name)
        token = token or os.environ.get("GRADWATCH_TOKEN") or None
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.IngestStub(self._channel)
        if start:
            self.start()

    # ---- the training loop's side ---------------------------------------------------------------

    def start(self) -> None:
        """Starts the background thread (the constructor does, unless start=False)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run_loop, name=f"gradwatch-monitor-{self._address}",
                                            daemon=True)
            self._thread.start()

    def log(self, step: int, metrics: Mapping[str, Any], wall_time: Optional[float] = None,
            squared: bool = False) -> bool:
        """Queues one step's metrics for this daemon without blocking (Monitor.log says what they are
        and what it raises); False when it was dropped."""
        step = _step(step, "")
        values = {str(k): _catalog.to_float(str(k), v) for k, v in metrics.items()}
        if squared:
            _check_radial_dots(values)
        now = time.time() if wall_time is None else float(wall_time)
        with self._lock:
            if self._stopping:
                self._stats.dropped += 1
                return False
            for key in values:
                split = _catalog.split_key(key)
                if split is not None and split[1] not in self._index:
                    self._add_param(_catalog.Param(name=split[1]))
            if self._steps_held >= self._queue_capacity:
                self._stats.dropped += 1
                self._dropped_unreported += 1
                self._dropped_since_warning += 1
                self._check_locked()
                return False
            self._seq += 1
            item = _Item("step", self._seq, step=step, wall_time=now, values=values,
                         dropped_before=self._dropped_unreported, squared=squared)
            self._dropped_unreported = 0
            self._pending.append(item)
            self._steps_held += 1
            self._last_logged_step = step
            self._pump_locked()
            self._check_locked()
            return True

    def event(self, step: int, text: str) -> bool:
        """Queues an event (a change the run went through at `step`), in order with the steps."""
        if not text:
            raise ValueError("an event needs a text")
        step = _step(step, "event: ")
        with self._lock:
            if self._stopping or self._events_held >= self._event_capacity:
                return False
            self._seq += 1
            self._pending.append(_Item("event", self._seq, step=step, text=str(text)))
            self._events_held += 1
            self._pump_locked()
            self._check_locked()
            return True

    def update_params(self, step: int, params: Sequence[Mapping[str, Any]]) -> bool:
        """Queues a change of catalog entries from `step` on, in order with the steps (see
        Monitor.update_params for `params`); False when it was not queued (closing, or
        event_capacity events and updates held). Kept until the daemon acknowledges it (EventAck),
        sent again after a reconnect. Once written, the catalog this stream's Hellos carry holds the
        new values; an update the daemon refuses puts back the values it replaced. Raises
        ValueError or TypeError naming what is wrong; nothing is queued then."""
        step = _step(step, "update_params: ")
        with self._lock:
            changes = _param_changes(params, self._index)
            if self._stopping or self._events_held >= self._event_capacity:
                return False
            self._seq += 1
            self._pending.append(_Item("catalog", self._seq, step=step, changes=changes))
            self._events_held += 1
            self._pump_locked()
            self._check_locked()
            return True

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Waits until everything logged is durable at the daemon (acked), and the steps it said it
        had received are too; False on rejection, or once it gives up (logged as a warning with what
        is not acknowledged). timeout: seconds, None for no limit. It gives up at the timeout, except
        while the Monitor waits to reconnect after ERROR_REASON_STORAGE_UNAVAILABLE (a back-off
        longer than the timeout): then it waits for that reconnect and gives the new stream as long
        as the timeout, or as the back-off before it if longer, to get everything acknowledged,
        unless that stream ends first (refused again, the daemon unreachable). A daemon that could
        not be reached is tried again at once, not after the back-off."""
        with self._lock:
            return self._wait_locked(self._drained_locked, time.monotonic(), timeout, self._opened, "flush")

    def close(self, finished: bool = True, timeout: Optional[float] = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Flushes, then (finished=True) ends the run cleanly: the daemon records it as finished,
        resolves its alerts and will not page it as dead. finished=False leaves the run open (a
        rank that stops while others go on). Stops the thread. True when all of it was confirmed;
        False when it gave up after `timeout` seconds, as flush() does, with a warning saying what
        it leaves unsent (steps, their range, events): what is still held is lost.
        """
        start = time.monotonic()
        with self._lock:
            opened = self._opened
            ok = self._wait_locked(self._drained_locked, start, timeout, opened, "close")
            if ok and finished:
                self._seq += 1
                self._goodbye = _Item("goodbye", self._seq)
                self._pending.append(self._goodbye)
                self._pump_locked()
                ok = self._wait_locked(lambda: self._stats.finished, start, timeout, opened, "close")
        self._stop()
        return ok

    def stats(self) -> MonitorStats:
        with self._lock:
            s = MonitorStats(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self._stats).items()})
            s.queued = len(self._pending)
            s.unacked = len(self._inflight)
            return s

    # ---- internals ------------------------------------------------------------------------------

    @staticmethod
    def _run_config(config: Mapping[str, Any]) -> pb.RunConfig:
        c = pb.RunConfig()
        for key, value in config.items():
            if key == "hidden_size":
                c.hidden_size = int(value)
            elif key == "z_loss_coef":
                c.z_loss_coef = float(value)
            elif key == "optimizer":
                c.optimizer = str(value)
            elif key == "weight_decay":
                c.weight_decay = float(value)
            elif key == "warmup_steps":
                c.warmup_steps = int(value)
            elif key in ("total_steps", "train_steps", "max_steps", "train_iters"):
                c.total_steps = int(value)  # the run's length, under the names trainers give it
            else:
                c.extra[str(key)] = str(value)
        return c

    def _add_param(self, param: _catalog.Param) -> None:
        if param.name in self._index:
            raise ValueError(f"parameter {param.name!r} is in the catalog twice")
        self._index[param.name] = len(self._params)
        self._params.append(param.to_proto(self._default_wd))

    def _change_catalog_locked(self, changes: List[pb.ParamChange]) -> List[pb.ParamChange]:
        """Sets the fields `changes` carry in the catalog; returns the values they replaced."""
        undo = []
        for change in changes:
            info = self._params[self._index[change.name]]
            before = pb.ParamChange(name=change.name)
            for f in _CHANGE_FIELDS:
                if change.HasField(f):
                    setattr(before, f, getattr(info, f))
                    setattr(info, f, getattr(change, f))
            undo.append(before)
        return undo

    def _refused_catalog_locked(self, item: _Item) -> None:
        """Puts back what a refused update replaced, in the fields no later update changed since."""
        for change, before in zip(item.changes, item.undo):
            info = self._params[self._index[change.name]]
            for f in _CHANGE_FIELDS:
                if before.HasField(f) and getattr(info, f) == getattr(change, f):
                    setattr(info, f, getattr(before, f))

    def _hello_locked(self) -> pb.TrainerMessage:
        self._seq += 1
        self._hello_seq = self._seq
        hello = pb.Hello(run_id=self._run, rank=self._rank, world_size=self._world_size, labels=self._labels,
                         params=self._params, client=CLIENT_NAME, config=self._config)
        if self._resume_from_step is not None:
            hello.resume_from_step = self._resume_from_step
        self._catalog_sent = len(self._params)
        return pb.TrainerMessage(seq=self._seq, hello=hello)

    def _wait_locked(self, done: Callable[[], bool], start: float, timeout: Optional[float], opened: int,
                     what: str) -> bool:
        """Waits, holding the lock, until done(): True. False, logged with what is not acknowledged,
        when this rank was rejected, the Monitor is not running, or the wait gives up: at start +
        timeout, unless a reconnect is due (see _give_up_at_locked). `opened`: self._opened when the
        caller began to wait."""
        deadline = None if timeout is None else start + max(0.0, timeout)
        if not done() and self._backing_off and not self._stats.storage_retrying:
            # The last stream failed (the daemon unreachable, or gone): try again now rather than
            # wait out a back-off that may be longer than the timeout.
            self._retry_now = True
            self._lock.notify_all()
        while not done():
            if self._stopping:
                return False  # closed: the close said what it left
            if self._stats.rejected or self._thread is None or not self._thread.is_alive():
                self._gave_up_locked(what, start)
                return False
            self._check_locked()
            if deadline is None:
                self._lock.wait(1.0)
                continue
            give_up_at = self._give_up_at_locked(deadline, max(0.0, timeout), opened)
            now = time.monotonic()
            if give_up_at is not None and now >= give_up_at:
                self._gave_up_locked(what, start)
                return False
            # Woken by every answer and by each stream that opens or ends; the second is a safety net.
            self._lock.wait(1.0 if give_up_at is None else min(1.0, give_up_at - now))
        return True

    def _give_up_at_locked(self, deadline: float, timeout: float, opened: int) -> Optional[float]:
        """When a wait that began with `opened` streams opened gives up: at its deadline, but never
        before one reconnect was tried since it began. None while that reconnect is still due (the
        Monitor is backing off, or ending a stream the daemon asked to be reopened)."""
        if self._ended > opened:
            return deadline  # a stream opened during the wait has ended: the reconnect was tried
        if self._call is not None and not self._ending:
            # A stream is open, or opening: it has up to `timeout` from when it was opened, and one
            # opened during the wait as long as the back-off before it, if that is longer.
            allowance = timeout if self._opened <= opened else max(timeout, self._delay)
            return max(deadline, self._opened_at + allowance)
        return None

    def _gave_up_locked(self, what: str, start: float) -> None:
        acked = self._stats.acked_through_step
        steps = [i.step for i in itertools.chain(self._inflight, self._pending) if i.kind == "step"]
        held = ""
        if steps:
            first, last = min(steps), max(steps)
            held = f" (step {first})" if first == last else f" (steps {first} to {last})"
        owed = ""
        if self._owed_through is not None and (acked is None or acked < self._owed_through):
            owed = f", and steps through {self._owed_through} the daemon received are not durable yet"
        end = ""
        if self._goodbye is not None and not self._stats.finished:
            end = "; the end of the run is not confirmed"
        lost = ""
        if what == "close" and (steps or self._events_held):
            lost = "; close leaves them unsent: they are lost"
        if self._stats.dropped:
            lost += f"; {self._stats.dropped} steps were dropped before (stats().dropped)"
        error = f" (last error: {self._stats.last_error})" if self._stats.last_error else ""
        log.warning("gradwatch: %s gave up after %.1f s on run %s rank %d at %s: %d steps and %d events not "
                    "acknowledged%s%s%s%s%s", what, time.monotonic() - start, self._run, self._rank, self._address,
                    self._steps_held, self._events_held, held, owed, end, lost, error)

    def _warn_locked(self, kind: str, message: str, *args: Any) -> bool:
        """Logs a warning of `kind` unless one was logged less than _WARN_INTERVAL seconds ago."""
        now = time.monotonic()
        last = self._warned_at.get(kind)
        if last is not None and now - last < _WARN_INTERVAL:
            return False
        self._warned_at[kind] = now
        log.warning(message, *args)
        return True

    def _state_locked(self) -> str:
        """Why steps wait, for a warning."""
        if self._stats.storage_retrying:
            return f"the daemon cannot store now: {self._stats.last_error}"
        if not self._stats.connected:
            return f"not connected: {self._rpc_error or 'no answer yet'}"
        return "connected, the daemon acknowledges slower than steps are logged"

    def _check_locked(self) -> None:
        """Warns, at most once per _WARN_INTERVAL each, when the daemon stays unreachable, when the
        queue passes half its capacity and when it drops steps; quiet otherwise (and once closing, or
        rejected: the rejection said that nothing more is sent)."""
        if self._stopping or self._stats.rejected:
            return
        held = self._steps_held
        if self._down_since is None and not self._stats.connected and (held or self._events_held):
            self._down_since = time.monotonic()  # something waits for a stream to be accepted
        if (self._down_since is not None and not self._stats.connected and not self._stats.storage_retrying
                and self._thread is not None):
            down = time.monotonic() - self._down_since
            if down >= _UNREACHABLE_AFTER and self._warn_locked(
                    "unreachable", "gradwatch: cannot reach the daemon at %s for %.0f s (%s); run %s rank %d: %s "
                    "and %s queued (capacity %d steps), sent once it answers",
                    self._address, down, self._rpc_error or "no answer yet", self._run, self._rank,
                    _count(held, "step"), _count(self._events_held, "event"), self._queue_capacity):
                self._outage_warned = True
        if held * 2 > self._queue_capacity:
            if self._half_armed and self._warn_locked(
                    "half", "gradwatch: the queue for the daemon at %s is past half full: %d of %d steps held "
                    "(run %s rank %d; %s); once full, further steps are dropped (counted in stats().dropped)",
                    self._address, held, self._queue_capacity, self._run, self._rank, self._state_locked()):
                self._half_armed = False
        else:
            self._half_armed = True
        if self._dropped_since_warning:
            since = "the last warning" if "dropped" in self._warned_at else "the queue filled"
            if self._warn_locked(
                    "dropped", "gradwatch: the queue for the daemon at %s is full (%d steps; run %s rank %d; %s): "
                    "%s dropped since %s, %d in all (stats().dropped)", self._address, self._queue_capacity,
                    self._run, self._rank, self._state_locked(), _count(self._dropped_since_warning, "step"), since,
                    self._stats.dropped):
                self._dropped_since_warning = 0

    def _drained_locked(self) -> bool:
        if self._pending or self._inflight:
            return False
        if self._owed_through is not None:
            acked = self._stats.acked_through_step
            return acked is not None and acked >= self._owed_through
        return True

    def _message(self, item: _Item) -> pb.TrainerMessage:
        if item.kind == "event":
            return pb.TrainerMessage(seq=item.seq, event=pb.Event(step=item.step, text=item.text))
        if item.kind == "catalog":
            return pb.TrainerMessage(seq=item.seq,
                                     catalog_update=pb.CatalogUpdate(from_step=item.step, params=item.changes))
        if item.kind == "goodbye":
            return pb.TrainerMessage(seq=item.seq,
                                     goodbye=pb.Goodbye(reason=pb.GOODBYE_REASON_FINISHED))
        stats = pb.StepStats(step=item.step, wall_time=item.wall_time, client_dropped_steps=item.dropped_before)
        by_index: Dict[int, pb.ParamStats] = {}
        for key, value in item.values.items():
            split = _catalog.split_key(key)
            if split is None:
                if key == _catalog.TOTAL_GRAD and item.squared:
                    stats.total_grad.sq_sum = value
                else:
                    _catalog.set_scalar(stats, key, value)
                continue
            field_name, param = split
            index = self._index[param]
            p = by_index.get(index)
            if p is None:
                p = by_index[index] = pb.ParamStats(index=index)
            if field_name == "radial":  # signed: merged by summing, not as squares
                if item.squared:
                    p.radial_update.dot = value
                else:
                    p.radial_update.radial = value
            elif item.squared:
                getattr(p, field_name).sq_sum = value
            else:
                getattr(p, field_name).norm = value
        stats.params.extend(by_index[i] for i in sorted(by_index))
        return pb.TrainerMessage(seq=item.seq, step=stats)

    def _pump_locked(self) -> None:
        """Writes what the window allows on the current stream."""
        if self._outbox is None or not self._accepted or self._ending:
            return
        if len(self._params) > self._catalog_sent:
            self._outbox.put(self._hello_locked())  # extends the catalog on the same stream
        unacked_steps = sum(1 for i in self._inflight if i.kind == "step")
        while self._pending:
            item = self._pending[0]
            if item.kind == "step" and unacked_steps >= self._max_unacked:
                break
            if item.kind == "goodbye" and any(i.kind != "goodbye" for i in self._inflight):
                break  # sent once everything before it is durable
            self._pending.popleft()
            if item.kind == "catalog" and not self._acks_events:
                # A daemon that does not ack events predates CatalogUpdate: it would refuse it.
                self._events_held -= 1
                log.warning("gradwatch: the daemon at %s does not take catalog updates: the change of %s from "
                            "step %d is not sent", self._address, ", ".join(c.name for c in item.changes), item.step)
                continue
            # Built into a message on the stream's thread, not the trainer's: the catalog's indexes
            # never change once given, so reading them there needs no lock.
            self._outbox.put(item)
            if item.kind == "step":
                unacked_steps += 1
                self._stats.sent += 1
                self._inflight.append(item)
            elif item.kind == "goodbye":
                self._inflight.append(item)  # sent again on a new stream until Finished
            elif item.kind == "event":
                self._stats.events_sent += 1
                if self._acks_events:
                    self._inflight.append(item)
                else:
                    self._events_held -= 1
            elif item.kind == "catalog":
                if item.undo is None:  # first written: later Hellos carry the new values
                    item.undo = self._change_catalog_locked(item.changes)
                self._stats.catalog_updates_sent += 1
                self._inflight.append(item)

    def _requests(self, outbox: queue.Queue):
        while True:
            message = outbox.get()
            if message is _END:
                return
            yield self._message(message) if isinstance(message, _Item) else message

    def _run_loop(self) -> None:
        ever_accepted = False
        while True:
            with self._lock:
                if self._stopping:
                    return
                outbox: queue.Queue = queue.Queue()
                self._outbox = outbox
                self._accepted = False
                self._ending = False
                self._backing_off = False
                self._retry_now = False
                self._opened += 1
                self._opened_at = time.monotonic()
                # What the last stream did not get acknowledged is sent again, first (steps the
                # daemon says it received wait for their ack instead: see _handle's Accepted).
                self._pending.extendleft(reversed(self._inflight))
                self._inflight = []
                outbox.put(self._hello_locked())
                self._lock.notify_all()
            accepted = False
            try:
                call = self._stub.Stream(self._requests(outbox), metadata=self._metadata)
                with self._lock:
                    self._call = call
                    if self._stopping:
                        call.cancel()
                for message in call:
                    if self._handle(message, ever_accepted):
                        accepted = True
                        ever_accepted = True
            except grpc.RpcError as e:
                if not self._stopping:
                    with self._lock:
                        self._rpc_error = f"{e.code().name}: {e.details()}"
                        if not self._ending:  # a stream ended on purpose keeps the Error that ended it
                            self._stats.last_error = self._rpc_error
                    log.debug("gradwatch: stream to %s ended: %s", self._address, e)
            finally:
                outbox.put(_END)
                with self._lock:
                    self._outbox = None
                    self._call = None
                    self._ended = self._opened
                    self._stats.connected = False
                    if self._down_since is None and (self._steps_held or self._events_held):
                        self._down_since = time.monotonic()  # something waits for the next stream
                    self._lock.notify_all()
            with self._lock:
                if self._stopping or self._stats.rejected:
                    return
                # A daemon that cannot store keeps the back-off growing, accepted streams or not,
                # until it acknowledges something again.
                if accepted and not self._stats.storage_retrying:
                    self._backoff = self._initial_backoff
                delay = self._delay = self._backoff * random.uniform(0.8, 1.2)
                self._backoff = min(self._max_backoff, self._backoff * 2)
                log.debug("gradwatch: reconnecting to %s in %.3f s", self._address, delay)
                # Warnings are due meanwhile too (the trainer may not log); flush() and close() may
                # cut the wait short (_wait_locked).
                self._backing_off = True
                began = time.monotonic()
                while not (self._stopping or self._retry_now):
                    self._check_locked()
                    left = began + delay - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(min(left, 1.0))
                if self._retry_now:
                    self._delay = time.monotonic() - began  # the back-off the next stream had

    def _handle(self, message: pb.DaemonMessage, reconnect: bool) -> bool:
        """Handles one daemon message; True when it is the stream's Accepted."""
        which = message.WhichOneof("body")
        if which == "alert":
            if self._on_alert is not None:
                try:
                    self._on_alert(message.alert)
                except Exception:  # the callback's failure must not end the stream
                    log.exception("gradwatch: the on_alert callback raised")
            return False
        if which == "error" and self._on_error is not None:
            try:
                self._on_error(message.error)
            except Exception:
                log.exception("gradwatch: the on_error callback raised")
        cancel = None
        with self._lock:
            if which == "accepted":
                a = message.accepted
                self._accepted = True
                self._acks_events = a.acks_events
                self._stats.connected = True
                if reconnect:
                    self._stats.reconnects += 1
                # Sent until the daemon accepts a stream: a later reconnect must not rewind the
                # steps this process reported since.
                self._resume_from_step = None
                if a.has_durable_step:
                    self._ack_locked(a.last_durable_step, held=True)
                if self._outage_warned:
                    log.warning("gradwatch: reconnected to the daemon at %s after %.0f s (run %s rank %d); %s and %s "
                                "queued are being sent", self._address, time.monotonic() - self._down_since,
                                self._run, self._rank, _count(self._steps_held, "step"),
                                _count(self._events_held, "event"))
                self._down_since = None
                self._outage_warned = False
                if a.has_received_step:
                    # Received from this rank, maybe by an earlier process, and kept only once
                    # durable: flush() waits for it too.
                    owed = self._owed_through
                    self._owed_through = a.last_received_step if owed is None else max(owed, a.last_received_step)
                    # Held steps it received wait for their ack, unsent: sent again, any but the last
                    # would be a regression. The steps after it are sent again, in order.
                    received = a.last_received_step
                    waiting = [i for i in self._pending if i.kind == "step" and i.step <= received]
                    if waiting:
                        self._pending = deque(i for i in self._pending if not (i.kind == "step" and i.step <= received))
                        self._inflight.extend(waiting)
                self._pump_locked()
                self._lock.notify_all()
                return True
            if which == "ack":
                self._storage_ok_locked()
                self._ack_locked(message.ack.durable_step)
            elif which == "event_ack":
                self._storage_ok_locked()
                seq = message.event_ack.seq
                kept = [i for i in self._inflight if not (i.kind in ("event", "catalog") and i.seq == seq)]
                self._events_held -= len(self._inflight) - len(kept)
                self._inflight = kept
            elif which == "finished":
                self._stats.finished = True
                self._inflight = [i for i in self._inflight if i.kind != "goodbye"]
            elif which == "error":
                e = message.error
                reason = pb.ErrorReason.Name(e.reason) if e.reason in pb.ErrorReason.values() \
                    else f"ERROR_REASON_{e.reason}"
                self._stats.errors += 1
                self._stats.errors_by_reason[reason] = self._stats.errors_by_reason.get(reason, 0) + 1
                self._stats.last_error = f"{reason}: {e.message}"
                if e.reason in _RETRYABLE:
                    # The daemon took neither this message nor will it take any later one on this
                    # stream: keep them all (they stay held, in order), end the stream, and send them
                    # again on a new one after the back-off, which keeps growing until an ack.
                    if not self._stats.storage_retrying:
                        log.warning("gradwatch: the daemon at %s cannot store run %s rank %d now (%s); keeping "
                                    "%d steps and %d events and sending them again after a back-off",
                                    self._address, self._run, self._rank, self._stats.last_error,
                                    self._steps_held, self._events_held)
                    self._stats.storage_retrying = True
                    if not self._ending:
                        self._ending = True  # nothing more is written on this stream
                        cancel = self._call
                elif e.seq == self._hello_seq:
                    self._stats.rejected = True
                    log.error("gradwatch: the daemon at %s refused run %s rank %d (%s): this run's steps and events "
                              "are not sent to it (%s and %s held stay unsent)", self._address, self._run,
                              self._rank, self._stats.last_error, _count(self._steps_held, "step"),
                              _count(self._events_held, "event"))
                else:
                    # Refused for good: the step, event or catalog update is not kept, nor held for
                    # an ack.
                    kept = []
                    for i in self._inflight:
                        if i.seq != e.seq:
                            kept.append(i)
                            continue
                        if i.kind == "step":
                            self._steps_held -= 1
                        elif i.kind in ("event", "catalog"):
                            self._events_held -= 1
                        if i.kind != "goodbye":
                            self._stats.refused += 1
                        if i.kind == "catalog":
                            self._refused_catalog_locked(i)
                    self._inflight = kept
                    log.warning("gradwatch: %s", self._stats.last_error)
            self._pump_locked()
            self._lock.notify_all()
        if cancel is not None:
            cancel.cancel()  # _run_loop sees the stream end and reconnects after its back-off
        return False

    def _storage_ok_locked(self) -> None:
        """The daemon acknowledged something: it stores again."""
        if self._stats.storage_retrying:
            self._stats.storage_retrying = False
            log.info("gradwatch: the daemon at %s stores run %s rank %d again", self._address, self._run, self._rank)

    def _ack_locked(self, durable_step: int, held: bool = False) -> None:
        """Releases the written steps through durable_step; held: the queued ones too (a new
        stream's Accepted, after which the steps the last one left unacknowledged are queued)."""
        acked = self._stats.acked_through_step
        if acked is None or durable_step > acked:
            self._stats.acked_through_step = durable_step
        kept = []
        for item in self._inflight:
            if item.kind == "step" and item.step <= durable_step:
                self._steps_held -= 1
            else:
                kept.append(item)
        self._inflight = kept
        if held and any(i.kind == "step" and i.step <= durable_step for i in self._pending):
            pending = deque()
            for item in self._pending:
                if item.kind == "step" and item.step <= durable_step:
                    self._steps_held -= 1
                else:
                    pending.append(item)
            self._pending = pending

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
            if self._outbox is not None:
                self._outbox.put(_END)
            call = self._call
            self._lock.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2.0)
            if thread.is_alive() and call is not None:
                call.cancel()
                thread.join(timeout=5.0)
        self._channel.close()


def _read_pem(what: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the TLS {what} file {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {what} file {path} holds no PEM block (-----BEGIN ...)")
    return data


def _channel(address: str, ca: Optional[str], cert: Optional[str], key: Optional[str],
             server_name: Optional[str]) -> grpc.Channel:
    """A channel to the daemon: TLS when any TLS file is given (arguments first, then the environment:
    GRADWATCH_TLS_CA, GRADWATCH_TLS_CERT, GRADWATCH_TLS_KEY, GRADWATCH_TLS_SERVER_NAME), else plain."""
    ca = ca or os.environ.get("GRADWATCH_TLS_CA") or None
    cert = cert or os.environ.get("GRADWATCH_TLS_CERT") or None
    key = key or os.environ.get("GRADWATCH_TLS_KEY") or None
    server_name = server_name or os.environ.get("GRADWATCH_TLS_SERVER_NAME") or None
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    if not (ca or cert or key):
        return grpc.insecure_channel(address, options=options)
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together (mutual TLS)")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem("CA", ca) if ca else None,
        private_key=_read_pem("key", key) if key else None,
        certificate_chain=_read_pem("certificate", cert) if cert else None)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=options)


def _addresses(address: Any) -> List[str]:
    """"a:1,b:2" or ["a:1", "b:2"] → ["a:1", "b:2"]."""
    items = address.split(",") if isinstance(address, str) else list(address)
    out = [str(a).strip() for a in items if str(a).strip()]
    if not out:
        raise ValueError("address: give at least one daemon HOST:PORT")
    return out


class Monitor:
    """Streams one rank of a run to gradwatchd from background threads.

    run: the run's id. address: the daemon's gRPC HOST:PORT, or several (a list, or comma-separated):
    every step then goes to each daemon, on a stream of its own (replicas watching one run; a daemon
    that is down gets its steps queued, up to queue_capacity, and does not hold up the others).
    rank and world_size: this process's place in the job; the daemon completes a step once every rank
    sent it (with world_size > 1 each rank logs the squared sums of its shards' norms, log(...,
    squared=True), which the daemon adds up). labels: the run's labels. config: the run's config
    (hidden_size, z_loss_coef, optimizer, weight_decay, and any other key as extra text). params: the
    parameter catalog, as names, mappings with the JSONL header's fields, or gradwatch.Param;
    parameters that log() names and the catalog lacks are appended to it (kind inferred from the
    name, weight decay 0 for norm gains, else config's weight_decay). resume_from_step: the first step
    this process logs after resuming from a checkpoint (the daemon drops what it held from there on).
    on_alert: called with each gradwatch.v1.Alert a daemon sends this stream, on that stream's thread
    (with several daemons, each calls it with its own copy of an alert). tls_ca, tls_cert, tls_key,
    tls_server_name: TLS to a daemon that serves it (the CA of its certificate; for mutual TLS this
    client's certificate and key; the name its certificate carries when not the address's host), PEM
    files; unset, the environment's GRADWATCH_TLS_CA, GRADWATCH_TLS_CERT, GRADWATCH_TLS_KEY and
    GRADWATCH_TLS_SERVER_NAME; none of them: plain text. token: the bearer token for a daemon with
    security.tokens_file (unset: GRADWATCH_TOKEN).

    Never blocks training: log(), event() and update_params() queue, up to queue_capacity steps
    held per daemon (queued or written and not yet durable); beyond it a step is dropped and counted,
    and the daemon is told with the next step sent. Everything is held until the daemon
    acknowledges it durable. A daemon that cannot store now (ERROR_REASON_STORAGE_UNAVAILABLE: full
    disk, read-only journal) takes neither the message it names nor any later one on that stream:
    the Monitor keeps them all, ends the stream and sends them again, in order, on a new one after
    a back-off (initial_backoff doubling up to max_backoff, ±20% jitter), which keeps growing until
    the daemon acknowledges something. Other Errors naming a step, event or catalog update refuse
    it for good: it is dropped and counted (stats().refused).

    Quiet while all is well; warns on the logger "gradwatch" (each kind at most once a minute per
    daemon) when a daemon cannot be reached 5 s after a step or event began to wait for it (its
    address, the gRPC error, what is queued and the capacity), and then when it is reached again;
    when a daemon refuses the run's Hello (an error: its reason; nothing more is sent to it); when
    a daemon's queue passes half of queue_capacity; when steps are dropped (how many since the last
    such warning); and when flush() or close() give up (what is left unacknowledged).
    """

    def __init__(self, run: str, address: Any = DEFAULT_ADDRESS, **kwargs: Any) -> None:
        self._addresses = _addresses(address)
        self._streams = [_Stream(run, a, **kwargs) for a in self._addresses]

    @property
    def addresses(self) -> List[str]:
        return list(self._addresses)

    def start(self) -> None:
        """Starts the background threads (the constructor does, unless start=False)."""
        for s in self._streams:
            s.start()

    def log(self, step: int, metrics: Mapping[str, Any], wall_time: Optional[float] = None,
            squared: bool = False) -> bool:
        """Queues one step's metrics (the JSONL keys) without blocking; False when every daemon's
        queue dropped it.

        Values are anything float() takes. A key naming a parameter the catalog lacks adds it.
        updates/radial/<param> is the radial part of the step's update, r = ⟨Δw, w⟩/|w| (Δw = w(t+1) −
        w(t), w = w(t)), signed: no sign is checked. squared: the norms (grad/norm/..., params/norm/...,
        updates/norm/...) are this rank's squared partial sums, which the daemon adds up over the ranks,
        and updates/radial/<param> is this rank's ⟨Δw_s, w_s⟩ over its shard, which the daemon sums
        and divides by the merged parameter norm: it needs params/norm/<param> in the same call.
        Raises TypeError or ValueError for a value that is not a number, a negative step, or a
        squared radial update without its parameter norm.
        """
        if len(self._streams) == 1:
            return self._streams[0].log(step, metrics, wall_time, squared)
        if wall_time is None:
            wall_time = time.time()  # one wall time for every daemon
        taken = [s.log(step, metrics, wall_time, squared) for s in self._streams]
        return any(taken)

    def event(self, step: int, text: str) -> bool:
        """Queues an event (a change the run went through at `step`), in order with the steps."""
        return any([s.event(step, text) for s in self._streams])

    def update_params(self, step: int, params: Sequence[Mapping[str, Any]]) -> bool:
        """Queues a change of catalog entries from `step` on (a remediation moved a parameter into a
        param group with weight decay, a role or group was corrected), in order with the steps; False
        when no daemon's stream queued it (closing, or event_capacity events and updates held).

        params: one mapping per parameter, with its "name" (in the catalog) and the fields that
        change: "weight_decay" (a number, finite and >= 0), "kind" (a kind's name, as the catalog
        takes it: "norm_gain", "output", ...), "role", "group" (text, up to 256 bytes; an empty
        group means the kind's). Delivered as events are: kept until each daemon acknowledges it and
        sent again after a reconnect; each daemon records it as an event of the run (source
        "catalog"). Once written to a daemon, the catalog the Monitor's Hellos to it carry (on a
        reconnect, or when log() extends the catalog) holds the new values too. Raises ValueError
        (TypeError for what is not a mapping) naming the entry and what is wrong: an unknown field,
        a missing or unknown name, a name given twice, no field to change, a weight decay that is
        negative or not finite, an unknown kind, a role or group that is not text or too long;
        nothing is queued then.
        """
        return any([s.update_params(step, params) for s in self._streams])

    def flush(self, timeout: Optional[float] = 30.0) -> bool:
        """Waits until everything logged is durable (acknowledged) at every daemon; False on
        rejection or when it gives up, with a warning (logger "gradwatch") saying how many steps and
        events are not acknowledged. It gives up after `timeout` seconds (None: never), but not
        before a stream that is waiting to reconnect after the daemon answered
        ERROR_REASON_STORAGE_UNAVAILABLE has tried once: then the new stream gets as long as the
        timeout, or as the back-off if longer, unless it ends first. A daemon that could not be
        reached is tried again at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = True
        for s in self._streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = s.flush(left) and ok
        return ok

    def close(self, finished: bool = True, timeout: Optional[float] = DEFAULT_CLOSE_TIMEOUT) -> bool:
        """Flushes, then (finished=True) ends the run cleanly: the daemon records it as finished,
        resolves its alerts and will not page it as dead. finished=False leaves the run open (a
        rank that stops while others go on). Stops the threads. True when every daemon confirmed
        all of it; False when it gave up, as flush() does, after `timeout` seconds (10 by default;
        None: never), with a warning (logger "gradwatch") saying what it leaves unsent: the steps
        and events a daemon did not acknowledge, and the steps' range. Those are lost. The daemons
        are closed together: one that is down costs `timeout` once (a daemon refusing to store,
        ERROR_REASON_STORAGE_UNAVAILABLE, gets one back-off and reconnect, if longer).
        """
        results: List[bool] = [False] * len(self._streams)

        def close_one(i: int) -> None:
            results[i] = self._streams[i].close(finished=finished, timeout=timeout)

        if len(self._streams) == 1:
            close_one(0)
        else:
            threads = [threading.Thread(target=close_one, args=(i,)) for i in range(len(self._streams))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return all(results)

    def stats(self) -> MonitorStats:
        """What the Monitor has done. With several daemons: counts summed (sent, events_sent,
        catalog_updates_sent, errors, reconnects), the largest backlog (queued, unacked, dropped,
        refused), the step every daemon holds (acked_through_step: the lowest), connected and
        storage_retrying when any is, rejected and finished when all are; stats_by_daemon() has each."""
        each = [s.stats() for s in self._streams]
        if len(each) == 1:
            return each[0]
        out = MonitorStats()
        out.queued = max(e.queued for e in each)
        out.unacked = max(e.unacked for e in each)
        out.dropped = max(e.dropped for e in each)
        out.refused = max(e.refused for e in each)
        out.sent = sum(e.sent for e in each)
        out.events_sent = sum(e.events_sent for e in each)
        out.catalog_updates_sent = sum(e.catalog_updates_sent for e in each)
        out.errors = sum(e.errors for e in each)
        out.reconnects = sum(e.reconnects for e in each)
        for e in each:
            for reason, n in e.errors_by_reason.items():
                out.errors_by_reason[reason] = out.errors_by_reason.get(reason, 0) + n
        acked = [e.acked_through_step for e in each]
        out.acked_through_step = None if any(a is None for a in acked) else min(acked)
        out.connected = any(e.connected for e in each)
        out.storage_retrying = any(e.storage_retrying for e in each)
        out.rejected = all(e.rejected for e in each)
        out.finished = all(e.finished for e in each)
        out.last_error = next((e.last_error for e in each if e.last_error), "")
        return out

    def stats_by_daemon(self) -> Dict[str, MonitorStats]:
        return {a: s.stats() for a, s in zip(self._addresses, self._streams)}

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A loop that raised did not reach its end: the run is left open (it pages as dead if
        # nothing else reports), not recorded as finished.
        self.close(finished=exc_type is None)
