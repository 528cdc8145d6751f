"""What the pipeline tells its orchestrator: a promotion, as the Prefect event ``elmo.model.promoted`` that the
refresh deployment's trigger follows (``prefect.yaml``). Prefect sits behind this one function as MLflow sits behind
``tracking``: the library imports without it, and where nobody could receive the event it is not sent.

Sent from wherever a version becomes the alias's: a training in a flow, ``elmo train --promote-to``, ``elmo
promote``. A command run with no Prefect API configured sends nothing (Prefect would start a throwaway server to
receive it, seconds of work for an event nobody follows) and says so at debug level.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PROMOTED = "elmo.model.promoted"  # the event; its resource is ``elmo.model.NAME``


def moved_alias(promotion: dict[str, Any] | None) -> bool:
    """Whether this decision moved the alias (a promotion of the version the alias already named moves nothing)."""
    if not promotion or not promotion.get("promoted"):
        return False
    return not str(promotion.get("why", "")).startswith(f"@{promotion.get('alias')} names it")


def announce_promotion(promotion: dict[str, Any] | None, tracking_uri: str | None) -> bool:
    """Send ``elmo.model.promoted`` where ``promotion`` (``Promotion.record()``) moved the alias and a Prefect API is
    there to receive it (configured, or the one of the flow run this is part of). Payload: the decision and its
    evidence, and the tracking store, so that a deployment it triggers reads the same registry. Returns whether it
    was sent."""
    if not moved_alias(promotion):
        return False
    try:
        from prefect.context import FlowRunContext
        from prefect.events import emit_event
        from prefect.settings import PREFECT_API_URL
    except ImportError:  # the library without the orchestration extras
        return False
    if not PREFECT_API_URL.value() and FlowRunContext.get() is None:
        log.debug("no Prefect API configured: %s not sent", PROMOTED)
        return False
    assert promotion is not None
    name = str(promotion["model"]).removeprefix("models:/").split("/")[0]
    payload = {key: value for key, value in promotion.items() if key != "line"}
    sent = emit_event(
        event=PROMOTED,
        resource={"prefect.resource.id": f"elmo.model.{name}", "prefect.resource.name": name},
        payload={**payload, "tracking_uri": tracking_uri or ""},
    )
    if sent is not None:
        log.info("sent %s for %s (@%s)", PROMOTED, promotion["model"], promotion["alias"])
    return sent is not None
