"""``serve(config)``: what ``elmo serve`` runs. The port is bound before anything heavy is imported (a client that
connects early waits in the backlog instead of being refused), then the app starts on uvicorn: /health answers at
once, the model processes load behind it, /ready turns 200 when one is warm.

SIGTERM: /ready answers 503 at once and requests are still served for ``drain_delay`` seconds (load balancers
learn that this replica is going); then uvicorn stops accepting and waits up to ``drain_seconds`` for the requests
in flight, which the model processes still answer; then the processes are told to stop and ``serve`` returns.
Ctrl-C skips the delay.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from elmo_core.errors import ConfigError, ElmoError
from elmo_core.options import ServeConfig

log = logging.getLogger(__name__)

# An idle client connection stays open longer than load balancers keep theirs (60 s on AWS's ALB and in nginx's
# upstream keep-alive): the side that closes first races the other reusing the connection, and a POST lost that way
# is not retried. With uvicorn's 5 s, closed-loop clients 7 s apart met ServerDisconnectedError (bench/serve_load.py,
# 256 clients, batching off).
KEEP_ALIVE_SECONDS = 75

API_KEY_ENV = "ELMO_API_KEY"


class ServeError(ElmoError):
    """Serving stopped because the model cannot run here (one line, from the model process)."""


@dataclass
class Served:
    url: str
    fatal: list[str] = field(default_factory=list)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, before anything else happens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(4096)  # the kernel caps it at net.core.somaxconn
    sock.set_inheritable(False)
    return sock


def allow_open_files() -> None:
    """Every connection is a file: a burst of clients must meet 429s, not a process out of descriptors."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_model(config: ServeConfig) -> None:
    """A local model that is not there fails now, in one line, before the port is taken (the runtime's resolver; an
    MLflow URI is fetched once the server runs)."""
    from elmo_core import tracking
    from elmo_core.runtime.reference import resolve_model

    if not tracking.is_model_uri(config.model):
        resolve_model(config.model, config.weight_file)


def place_model(config: ServeConfig) -> tuple[ServeConfig, str]:
    """The device and precision decided once, by the runtime, before the port is taken: a precision this machine
    refuses (bf16 that the CPU would emulate, int8 on a GPU) fails here in one line, and every model process, and
    every reload's, runs what was decided (``auto`` resolved, with its reason). In a short process of its own, since
    this one never imports torch."""
    import json
    import subprocess
    import sys

    if config.model.endswith(".onnx"):  # ONNX Runtime's CPU provider in float32: nothing to decide, no torch
        if config.device not in ("auto", "cpu") or config.precision not in ("auto", "fp32"):
            raise ConfigError(f"{config.model}: an ONNX file is served on the CPU in fp32 (ONNX Runtime)")
        return config.model_copy(update={"device": "cpu", "precision": "fp32"}), "an ONNX file, run in fp32"
    done = subprocess.run(
        [sys.executable, "-m", "elmo_core.runtime.placement", config.device, config.precision],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise ConfigError(lines[-1] if lines else f"device {config.device}, precision {config.precision}: refused")
    placed = json.loads(done.stdout.strip().splitlines()[-1])
    return config.model_copy(update={"device": placed["device"], "precision": placed["precision"]}), placed["why"]


def _uvicorn(app: Any, config: ServeConfig) -> Any:
    """uvicorn's server, with SIGTERM's drain delay: /ready answers 503 at once (``Server.draining``), requests are
    still served for ``--drain-delay`` seconds, the time a Kubernetes endpoint update takes to reach the load
    balancers that would otherwise route requests to a closed port; then uvicorn's own drain (the listener closed,
    requests in flight answered within ``--drain-seconds``). Ctrl-C, or a second SIGTERM, skips the delay."""
    import uvicorn

    class Draining(uvicorn.Server):
        drain_until: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.server.draining = True
            if sig == signal.SIGTERM and self.drain_until is None and config.drain_delay > 0 and not self.should_exit:
                self._captured_signals.append(sig)  # raised again once uvicorn is done, as it does itself
                self.drain_until = time.monotonic() + config.drain_delay
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_until is not None and not self.should_exit and time.monotonic() >= self.drain_until:
                log.info("drain delay over: the listener closes, requests in flight are answered")
                self.should_exit = True
            return await super().on_tick(counter)

    return Draining(
        uvicorn.Config(
            app,
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(config.drain_seconds),
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            lifespan="on",
        )
    )


def serve(config: ServeConfig) -> Served:
    """Serve until SIGTERM or Ctrl-C; raises ``ServeError`` where the model cannot run."""
    if config.api_key is None and os.environ.get(API_KEY_ENV):
        config = config.model_copy(update={"api_key": os.environ[API_KEY_ENV]})
    check_model(config)
    config, precision_why = place_model(config)
    allow_open_files()
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    served = Served(f"http://{host if ':' not in host else f'[{host}]'}:{port}")
    print(f"elmo serve: listening on {served.url} (/ready turns 200 once the model is warm)", flush=True)
    if not _loopback(config.host) and config.api_key is None:
        log.warning("listening on %s without an API key: anyone who reaches this port can use it", config.host)

    import uvicorn  # the heavy part, after the port is bound (torch only in the model processes)

    from elmo_core.serve.app import create_app

    def model() -> Any:
        from elmo_core.runtime.reference import resolve_model

        return resolve_model(config.model, config.weight_file)

    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        served.fatal.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(config, model, on_fatal, precision_why)
    server = _uvicorn(app, config)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handler it found: a quiet one here
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if served.fatal:
        raise ServeError(served.fatal[0])
    return served
