"""What the processes of `thunder-batch serve` share, in shared memory: no helper process to lose.

- per inference worker: its pid, whether its engine is ready, consecutive failed steps, whether it
  lost LitServe's request queue, and its running / waiting counts (for /health and /metrics);
- per HTTP process: its pid and the requests (choices) it accepted and has not finished (backpressure,
  drain); the count of a process that died is not counted;
- per worker: its engine counters as JSON (what /stats shows, without a round trip to a busy worker);
- whether the server is draining;
- a semaphore each HTTP process releases once per request it puts in LitServe's queue, so an idle
  worker sleeps in the kernel until one arrives instead of polling the queue's manager process.
Made in the main process before any child starts: the spawned workers receive it pickled with the
LitAPI, the forked HTTP processes inherit it. Each row has one writer, so no lock is needed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

UNHEALTHY_AFTER_FAILED_STEPS = 3
# A worker sends its messages for one HTTP process as one batch under this uid (one round trip through
# LitServe's queue per step, not one per token); the HTTP process hands each to its request.
MESSAGES_UID = "thunder-batch:messages"
_FIELDS = (
    "pid",
    "ready",
    "failed_steps",
    "queue_lost",
    "running",
    "waiting",
    "beat_ms",
    "slots",
    "kv_tokens",
    "kv_capacity",
)
HEARTBEAT_S = 1.0  # a ready worker's event loop writes beat_ms this often
_STATS_BYTES = 1 << 16  # room for one worker's counters as JSON


@dataclass(frozen=True)
class WorkerStatus:
    index: int
    pid: int
    ready: bool
    failed_steps: int
    queue_lost: bool
    running: int
    waiting: int
    beat_ms: int = 0  # time.monotonic() in ms of its event loop's last heartbeat
    slots: int = 0  # its engine's batch size
    kv_tokens: int = 0  # KV-cache entries its running requests hold
    kv_capacity: int = 0  # KV-cache entries of all its slots

    @property
    def alive(self) -> bool:
        return self.pid > 0 and process_alive(self.pid)

    def silent_s(self) -> float:
        """Seconds since a ready worker's last heartbeat (0 before it is ready)."""
        return max(time.monotonic() - self.beat_ms / 1000, 0.0) if self.ready and self.beat_ms else 0.0

    def problem(self, stuck_after_s: float | None = None) -> str | None:
        """Why this worker cannot serve now, or None. stuck_after_s: heartbeat silence that makes it stuck."""
        if not self.ready or not self.alive:
            return f"worker {self.index} is starting (or restarting after it stopped)"
        if stuck_after_s is not None and self.silent_s() > stuck_after_s:
            return f"worker {self.index} is stuck: no heartbeat for {self.silent_s():.0f} s (it is being restarted)"
        if self.failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"worker {self.index}: its last {self.failed_steps} steps failed"
        if self.queue_lost:
            return f"worker {self.index} lost LitServe's request queue (its manager process is gone)"
        return None


class SharedState:
    def __init__(self, workers: int, http_processes: int, worker_timeout: float | None = None) -> None:
        """worker_timeout: heartbeat silence (seconds) after which a ready worker counts as stuck (None: never)."""
        self.workers, self.http_processes, self.worker_timeout = workers, http_processes, worker_timeout
        self._rows = mp.RawArray("q", workers * len(_FIELDS))
        self._in_flight = mp.RawArray("q", http_processes)
        self._http_pids = mp.RawArray("q", http_processes)  # the process counting in each row
        self._draining = mp.RawValue("b", 0)
        self._stopping = mp.RawValue("b", 0)
        self._stats = mp.RawArray("c", workers * _STATS_BYTES)
        self._stats_seq = mp.RawArray("q", workers)  # odd while its writer is writing
        # one release per request put in the queue; spawn-made, so the spawned workers can receive it
        self._arrivals = mp.get_context("spawn").Semaphore(0)

    # -- workers (each writes its own row) -------------------------------------------------------
    def set_worker(self, index: int, **fields) -> None:
        for name, value in fields.items():
            self._rows[index * len(_FIELDS) + _FIELDS.index(name)] = int(value)

    def worker(self, index: int) -> WorkerStatus:
        row = self._rows[index * len(_FIELDS) : (index + 1) * len(_FIELDS)]
        values = dict(zip(_FIELDS, row))
        return WorkerStatus(
            index,
            values["pid"],
            bool(values["ready"]),
            values["failed_steps"],
            bool(values["queue_lost"]),
            values["running"],
            values["waiting"],
            values["beat_ms"],
            values["slots"],
            values["kv_tokens"],
            values["kv_capacity"],
        )

    def beat(self, index: int) -> None:
        self._rows[index * len(_FIELDS) + _FIELDS.index("beat_ms")] = int(time.monotonic() * 1000)

    def all_workers(self) -> list[WorkerStatus]:
        return [self.worker(i) for i in range(self.workers)]

    def publish(self, index: int, stats: dict) -> None:
        data = json.dumps(stats, default=str).encode()
        if len(data) > _STATS_BYTES - 8:
            data = json.dumps({"error": f"stats of {len(data)} bytes do not fit"}).encode()
        base, seq = index * _STATS_BYTES, self._stats_seq[index]
        seq += 1 - seq % 2  # odd while writing (still odd if a dead writer left it so)
        self._stats_seq[index] = seq
        self._stats[base : base + 8] = len(data).to_bytes(8, "little")
        self._stats[base + 8 : base + 8 + len(data)] = data
        self._stats_seq[index] = seq + 1

    def published(self, index: int) -> dict:
        """The counters worker `index` published last ({} before its first)."""
        base = index * _STATS_BYTES
        for _ in range(10_000):  # a seqlock: retry a read that overlapped a write
            seq = self._stats_seq[index]
            size = int.from_bytes(self._stats[base : base + 8], "little")
            data = self._stats[base + 8 : base + 8 + size]
            if seq % 2 == 0 and self._stats_seq[index] == seq:
                return json.loads(data) if size else {}
        return {}  # its writer died mid-write

    # -- HTTP processes (each writes its own count) ----------------------------------------------
    def add_in_flight(self, http_index: int, n: int) -> None:
        pid = os.getpid()
        if self._http_pids[http_index] != pid:  # a new process in this row: what a dead one left is not ours
            self._http_pids[http_index], self._in_flight[http_index] = pid, 0
        self._in_flight[http_index] += n

    def in_flight(self) -> int:
        """Choices accepted by every live HTTP process and not yet finished (a dead one's count is gone with it)."""
        rows = zip(self._in_flight, self._http_pids)
        return sum(count for count, pid in rows if count and (pid == os.getpid() or process_alive(pid)))

    # -- arrivals: a wake-up call per request, not a claim on it (the queue still decides who takes it) --
    def announce_request(self) -> None:
        self._arrivals.release()

    def wait_for_request(self, timeout_s: float) -> bool:
        """Sleep until a request was announced (True) or timeout_s passed (False). A worker that dies
        after waking leaves the request in the queue: another takes it at its next look."""
        return self._arrivals.acquire(timeout=max(timeout_s, 0.0))

    # -- draining (the main process writes it) ---------------------------------------------------
    @property
    def draining(self) -> bool:
        return bool(self._draining.value)

    def start_draining(self) -> None:
        self._draining.value = 1

    # -- stopping: after the drain; until then every child ignores SIGTERM (the main process drains) --
    @property
    def stopping(self) -> bool:
        return bool(self._stopping.value)

    def start_stopping(self) -> None:
        self._stopping.value = 1


def process_alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc: existence is all we can tell
