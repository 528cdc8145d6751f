"""The model versions one server runs: the pool that answers new requests (``serving``), a reload's pool warming up
beside it (``incoming``), and pools switched from that still finish the requests they began (``retiring``).

A server resolves its model reference once, when it starts; every process of a pool, and every restart of one,
loads that exact model (``workers.WorkerPlan``). Only a reload resolves the reference again (SIGHUP, ``POST
/reload``): where it names another model now, a new pool loads it beside the serving one, and once all of its
processes are warm the switch is one assignment in the event loop's thread. Requests not yet begun then go to the
new pool; a request already begun ends on the pool it began on (``batcher.Request.pool``), so no answer mixes two
versions, and the old pool is stopped when nothing it began is left. A reload whose model cannot be resolved or
cannot run leaves the serving pool as it was, with one line in the log and in ``/info``'s ``last_reload``.

Everything here runs in the event loop's thread, but ``resolve`` (a registry lookup, maybe a download), which runs
in a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from elmo_core.runtime.reference import ModelRef
from elmo_core.serve.workers import Worker, WorkerPlan, WorkerPool

log = logging.getLogger(__name__)


class Versions:
    """The pools of one server, and its reloads. ``plan(model)`` makes a pool's plan for a model; ``start_pool(plan,
    generation, on_fatal)`` makes a pool (the batcher's events, the event loop's ``call``)."""

    def __init__(
        self,
        reference: str,
        resolve: Callable[[], ModelRef],
        plan: Callable[[ModelRef], WorkerPlan],
        make_pool: Callable[[WorkerPlan, int, Callable[[str], None] | None], WorkerPool],
    ) -> None:
        self.reference, self.resolve, self.plan, self.make_pool = reference, resolve, plan, make_pool
        self.serving: WorkerPool | None = None
        self.incoming: WorkerPool | None = None
        self.retiring: list[WorkerPool] = []
        self.reloading: dict[str, Any] | None = None  # a reload under way: from, to, since
        self.last_reload: dict[str, Any] | None = None  # how the last one ended
        self._resolving = False

    @property
    def pools(self) -> list[WorkerPool]:
        return [p for p in (self.serving, self.incoming, *self.retiring) if p is not None]

    def start(self, model: ModelRef) -> WorkerPool:
        """The first pool, of the model resolved at start (pinned with its content hash)."""
        self.serving = self.make_pool(self.plan(model), 1, None)
        self.serving.start()
        return self.serving

    # --- a reload ----------------------------------------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """Resolve the reference again; where it names another model now, start its pool beside the serving one.
        What happened, as ``POST /reload`` answers it (``reloading``: a new pool is warming up)."""
        if self.serving is None:
            return {"reloading": False, "why": "the model is still loading"}
        if self._resolving or self.reloading is not None:
            return {"reloading": True, **(self.reloading or {}), "why": "a reload is already under way"}
        current = self.serving.model
        self._resolving = True
        try:
            model = (await asyncio.to_thread(self.resolve)).pinned()
        except Exception as exc:  # the store is away, the name is gone: the serving pool goes on
            why = str(exc).splitlines()[0] if str(exc) else repr(exc)
            log.error("reload: %s cannot be resolved (%s); still serving %s", self.reference, why, current.name)
            self.last_reload = {"ok": False, "why": why, "time": time.time()}
            return {"reloading": False, "model": current.name, "why": f"cannot be resolved: {why}"}
        finally:
            self._resolving = False
        if (model.exact, model.digest) == (current.exact, current.digest):
            why = f"{self.reference} still names {current.name} (id {current.digest})"
            log.info("reload: %s; nothing to do", why)
            return {"reloading": False, "model": current.name, "why": why}
        self.reloading = {"from": current.name, "to": model.name, "to_id": model.digest, "since": time.time()}
        log.info(
            "reload: %s now names %s (id %s); loading it in new model processes beside %s",
            *(self.reference, model.name, model.digest, current.name),
        )
        self.incoming = self.make_pool(self.plan(model), self.serving.generation + 1, self._failed)
        self.incoming.start()
        return {"reloading": True, **self.reloading}

    def warm(self, worker: Worker) -> bool:
        """A model process is warm: where it completes the incoming pool, switch to that pool. True if switched."""
        incoming = self.incoming
        if incoming is None or worker.pool is not incoming or not incoming.all_ready:
            return False
        old, self.serving, self.incoming = self.serving, incoming, None
        if old is not None:
            self.retiring.append(old)
        self.reloading = None
        self.last_reload = {"ok": True, "from": old.model.name if old else None, "to": incoming.model.name}
        self.last_reload["time"] = time.time()
        log.info(
            "reload: switched to %s (id %s); %s finishes what it began",
            *(incoming.model.name, incoming.model.digest, old.model.name if old else "nothing"),
        )
        return True

    def _failed(self, message: str) -> None:
        """The incoming pool cannot run its model: stopped, and the serving pool goes on as it was."""
        pool, target = self.incoming, (self.reloading or {}).get("to")
        log.error("reload: %s cannot run (%s); still serving %s", target, message, self.serving.model.name)  # type: ignore[union-attr]
        self.incoming, self.reloading = None, None
        self.last_reload = {"ok": False, "to": target, "why": message, "time": time.time()}
        if pool is not None:
            _stop_soon(pool)

    def retire(self, needed: Callable[[WorkerPool], bool]) -> None:
        """Stop the pools switched from that nothing needs now (no batch computing, and ``needed`` false: no
        sentence waiting of a request they began)."""
        for pool in list(self.retiring):
            if not pool.busy and not needed(pool):
                self.retiring.remove(pool)
                _stop_soon(pool)


def _stop_soon(pool: WorkerPool) -> None:
    """Stop ``pool`` off the event loop (stopping joins its processes); its processes' ends are no deaths."""
    pool.closing = True
    asyncio.ensure_future(asyncio.to_thread(pool.stop))
