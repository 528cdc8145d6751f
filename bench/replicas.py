"""``elmo serve`` replicas behind the shipped HAProxy configuration (``deploy/haproxy.cfg``) on this machine's
loopback, clients that retry as OpenAI's client does, and an operator's day: a rolling restart and a ``kill -9``.
``tests/test_deploy.py`` runs it with the fixture model and checks that no request was lost;
``bench/serve_load.py --replicas N`` measures it with a bigger model.

- ``Replica``: one ``elmo serve`` process group on a fixed loopback port (started again on the same port, as a pod
  comes back behind the same Service, or a machine behind the same ``server`` line).
- ``Balancer``: ``haproxy`` running ``deploy/haproxy.cfg`` as shipped, only its ``server`` lines replaced by the
  replicas' addresses; its stats page says which servers it holds up and how often it retried.
- ``Load``: closed-loop clients (each sends its next request when the last is answered) in a thread of their own. A
  request answered 429 or 503 is sent again after OpenAI's client's delay (the ``Retry-After`` header when it gives
  one of at most 60 s, else 0.5 s doubling up to 8 s, less up to a quarter at random), at most ``max_retries`` times
  (OpenAI's default: 2). Anything else that is not a 200 (a 502, a reset connection, a timeout) is lost: OpenAI's
  client would retry those too, but here they count against the balancer.
- ``roll_and_kill``: SIGTERM each replica in turn (the main process only, as Kubernetes and ``docker stop`` send it),
  wait for it to exit, start it again and wait until the balancer holds it up; then stop one replica's model process
  until a request waits in it and ``kill -9`` its whole process group (a container killed), and start it again.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
BACKEND = "elmo"  # the backend section of deploy/haproxy.cfg

# OpenAI's Python client: which answers it sends again and how long it waits first (openai/_base_client.py)
RETRIED_STATUSES = (429, 503)
INITIAL_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 8.0
OPENAI_MAX_RETRIES = 2


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_config(servers: Sequence[tuple[str, str]], shipped: str | None = None) -> str:
    """The shipped configuration with its ``server`` lines (one block of them) replaced by one line per (name,
    address): everything else as shipped."""
    lines = (HAPROXY_CFG.read_text() if shipped is None else shipped).splitlines()
    at = [i for i, line in enumerate(lines) if line.split()[:1] == ["server"]]
    if not at or at != list(range(at[0], at[-1] + 1)):
        raise ValueError(f"{HAPROXY_CFG}: expected one block of `server` lines, found them at lines {at}")
    block = [f"    server {name} {address}" for name, address in servers]
    return "\n".join([*lines[: at[0]], *block, *lines[at[-1] + 1 :]]) + "\n"


def core_shares(replicas: int) -> list[set[int] | None]:
    """This process's cores split evenly between ``replicas`` (none pinned where there are fewer cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < replicas:
        return [None] * replicas
    share = len(cores) // replicas
    return [set(cores[i * share : (i + 1) * share]) for i in range(replicas)]


def _wait(condition: Callable[[], bool], what: str, timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Replica:
    """One ``elmo serve MODEL --port PORT FLAGS`` in a session of its own, its output appended to ``log``; on
    ``cores`` alone where given (as on a machine of its own: the server sizes its threads by its affinity)."""

    def __init__(
        self, name: str, model: Path, log: Path, flags: Sequence[str] = (), cores: set[int] | None = None
    ) -> None:
        self.name, self.model, self.log, self.flags, self.cores = name, model, log, list(flags), cores
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [sys.executable, "-m", "elmo_core.cli", "serve", str(self.model), "--port", str(self.port)]
        with self.log.open("a") as sink:
            self.process = subprocess.Popen(
                [*command, *self.flags], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        if self.cores:  # set at once, while Python starts: before the server reads it (not preexec_fn: threads run)
            os.sched_setaffinity(self.process.pid, self.cores)

    def ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"replica {self.name} is not running: {self.log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 120) -> None:
        _wait(self.ready, f"{self.name}'s /ready", timeout)

    def terminate(self) -> None:
        """SIGTERM to the main process, as Kubernetes and ``docker stop`` send it (its model processes ignore it)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL to every process of the replica at once, as a container is killed."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def model_pids(self) -> list[int]:
        return [w["pid"] for w in httpx.get(f"{self.url}/info", timeout=5).json()["workers"] if w["pid"]]

    def queue_tokens(self) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("elmo_queue_tokens "):
                return float(line.split()[1])
        raise RuntimeError(f"elmo_queue_tokens not in {self.name}'s /metrics")

    def close(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass


class Balancer:
    """``haproxy -db`` (in the foreground) on the shipped configuration, the replicas as its servers."""

    def __init__(self, replicas: Sequence[Replica], folder: Path, shipped: str | None = None) -> None:
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = folder / "haproxy.cfg"
        self.config.write_text(haproxy_config([(r.name, r.address) for r in replicas], shipped))
        self.log = folder / "haproxy.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin") or "haproxy"
        env = {
            **os.environ,
            "ELMO_LB_BIND": f"127.0.0.1:{self.port}",
            "ELMO_LB_STATS_BIND": f"127.0.0.1:{self.stats_port}",
        }
        with self.log.open("a") as sink:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(self.config)], env=env, stdout=sink, stderr=subprocess.STDOUT
            )
        _wait(self._answers, "haproxy's stats page", 30)

    def _answers(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"haproxy is not running: {self.log.read_text()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict[str, dict[str, str]]:
        """The backend's rows of HAProxy's stats, by server name (and ``BACKEND``)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text.lstrip("# ")
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == BACKEND}

    def wait_state(self, server: str, state: str, timeout: float = 60) -> None:
        _wait(lambda: self.stats()[server]["status"] == state, f"haproxy to hold {server} {state}", timeout, 0.2)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@dataclass
class Outcome:
    """One request as its client saw it: the last answer's status (or the exception that ended it), the answer's
    JSON when it was 200, and how many times it was sent."""

    index: int
    status: int | str
    attempts: int
    started: float
    ended: float
    answer: dict | None = None


def retry_delay(retries_done: int, retry_after: str | None) -> float:
    """OpenAI's client's wait before a retry: the server's Retry-After where it gives 0-60 s, else backoff."""
    try:
        seconds = float(retry_after) if retry_after is not None else -1.0
    except ValueError:
        seconds = -1.0
    if 0 < seconds <= 60:
        return seconds
    return min(INITIAL_RETRY_DELAY_S * 2**retries_done, MAX_RETRY_DELAY_S) * (1 - 0.25 * random.random())


@dataclass
class Load:
    """``clients`` closed-loop clients POSTing ``bodies`` (request n sends ``bodies[n % len(bodies)]``) to ``url``
    from a thread of their own, from ``start()`` until ``stop()``; a request under way when ``stop()`` comes is
    finished, retries included. ``marks`` holds (time, label) of what happened meanwhile."""

    url: str
    bodies: Sequence[dict]
    clients: int = 8
    max_retries: int = OPENAI_MAX_RETRIES
    timeout: float = 60.0
    keep_answers: bool = True
    outcomes: list[Outcome] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._counter = 0

    def start(self) -> Load:
        self.marks.append((time.monotonic(), "load starts"))
        self._thread.start()
        return self

    def mark(self, label: str) -> None:
        self.marks.append((time.monotonic(), label))

    def wait_answers(self, n: int, timeout: float = 60) -> None:
        """Until ``n`` more requests have ended (whatever their outcome)."""
        target = len(self.outcomes) + n
        _wait(lambda: len(self.outcomes) >= target, f"{n} more answers", timeout, 0.05)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(timeout=self.timeout * (self.max_retries + 2))
        self.marks.append((time.monotonic(), "load stops"))
        return self.outcomes

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.clients, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(limits=limits, timeout=self.timeout) as client:
            await asyncio.gather(*(self._client(client) for _ in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            index, self._counter = self._counter, self._counter + 1
            self.outcomes.append(await self._request(client, index))

    async def _request(self, client: httpx.AsyncClient, index: int) -> Outcome:
        body = self.bodies[index % len(self.bodies)]
        started = time.monotonic()
        headers = {"x-request-id": f"load-{index}"}
        for attempt in range(1, self.max_retries + 2):
            try:
                answer = await client.post(self.url, json=body, headers=headers)
            except httpx.HTTPError as exc:
                return Outcome(index, type(exc).__name__, attempt, started, time.monotonic())
            if answer.status_code == 200:
                kept = answer.json() if self.keep_answers else None
                return Outcome(index, 200, attempt, started, time.monotonic(), kept)
            if answer.status_code not in RETRIED_STATUSES or attempt > self.max_retries:
                return Outcome(index, answer.status_code, attempt, started, time.monotonic())
            await asyncio.sleep(retry_delay(attempt - 1, answer.headers.get("retry-after")))
        raise AssertionError("unreachable")


def roll_and_kill(
    replicas: Sequence[Replica], balancer: Balancer, load: Load, say: Callable[[str], None] = print
) -> list[int]:
    """The rolling restart, then the kill; returns each SIGTERMed replica's exit status."""
    statuses = []
    for replica in replicas:
        load.mark(f"SIGTERM {replica.name}")
        replica.terminate()
        statuses.append(replica.wait_exit())
        load.mark(f"{replica.name} exited ({statuses[-1]})")
        replica.start()
        replica.wait_ready()
        balancer.wait_state(replica.name, "UP")
        load.mark(f"{replica.name} back")
        say(f"rolled {replica.name}: exit status {statuses[-1]}, up again behind the balancer")
    victim = replicas[0]
    pids = victim.model_pids()  # stopped, so that the kill surely finds requests waiting in the replica
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    _wait(lambda: victim.queue_tokens() > 0, f"a request waiting in {victim.name}", 30, 0.02)
    load.mark(f"kill -9 {victim.name}")
    victim.kill()
    victim.start()
    victim.wait_ready()
    balancer.wait_state(victim.name, "UP")
    load.mark(f"{victim.name} back")
    say(f"killed {victim.name} with requests waiting in it; up again behind the balancer")
    return statuses
