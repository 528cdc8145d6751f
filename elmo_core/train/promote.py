"""Promotion by evidence: a registered version becomes what an alias (``champion`` by default) names only where it
is better than the version the alias names now, measured the same way on the same heldout data.

    promote("models:/elmo/4")           # after a training: better than models:/elmo@champion by the margin? then moved
    promote("models:/elmo/4", force=True)   # moved without a comparison, and the tags say so

The evidence is heldout perplexity with the full softmax (``evaluate``, state carried across windows, as bilm-tf
scores), both models scored now by this code on the heldout split the new version's training logged
(``lineage``: its folder and digest). Where the two trainings logged heldout data of different digests, or none,
there is no comparison and no promotion, and the line says so. The first version of a name with no champion is
promoted. The decision and its evidence (both perplexities, the digest, the margin, why) are tags on the new version
(``elmo.promotion.*``), whether or not it moved the alias, so the MLflow UI shows why each version is or is not the
champion.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo_core import tracking
from elmo_core.errors import InputError
from elmo_core.runtime import Runtime, pin_reference
from elmo_core.train.evaluate import evaluate

log = logging.getLogger(__name__)

VERSION = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)$")


@dataclass(frozen=True)
class Promotion:
    """What ``promote`` decided, and its evidence."""

    model: str  # models:/NAME/N
    alias: str
    promoted: bool
    why: str
    perplexity: float | None = None
    champion: str | None = None  # the version the alias named before
    champion_perplexity: float | None = None
    digest: str | None = None  # the heldout data's
    margin: float = 0.0

    def line(self) -> str:
        verb = f"promoted to @{self.alias}" if self.promoted else f"not promoted to @{self.alias}"
        return f"{self.model}: {verb}: {self.why}"

    def record(self) -> dict[str, Any]:
        """The decision as data: what a training's result carries and the promotion event's payload holds."""
        return {**dataclasses.asdict(self), "line": self.line()}

    def tags(self) -> dict[str, str]:
        """The decision and its evidence, as the version's tags."""
        found = {
            "decision": "promoted" if self.promoted else "not promoted",
            "alias": self.alias,
            "why": self.why,
            "heldout_perplexity": f"{self.perplexity:.4f}" if self.perplexity is not None else "",
            "champion": self.champion or "",
            "champion_heldout_perplexity": f"{self.champion_perplexity:.4f}" if self.champion_perplexity else "",
            "heldout_digest": self.digest or "",
            "margin": f"{self.margin:g}",
        }
        return {f"elmo.promotion.{key}": value for key, value in found.items()}


def promote(
    reference: str, alias: str = "champion", margin: float = 0.0, force: bool = False, tracking_uri: str | None = None
) -> Promotion:
    """Decide whether ``reference`` (a registered version; ``latest`` is pinned first) becomes ``alias``; tag the
    version with the decision and move the alias where it is promoted (module docstring). ``tracking_uri``: the
    store (default: ``tracking.resolve_tracking_uri``'s)."""
    if tracking_uri is not None:
        tracking.use_store(tracking_uri)
    exact = pin_reference(reference)
    match = VERSION.match(exact)
    if match is None:
        raise InputError(f"{reference}: promote takes a registered version, models:/NAME/N or models:/NAME/latest")
    name, version = match["name"], match["version"]
    facts = tracking.registered_version(name, version, None)
    before = tracking.alias_version(name, alias)
    champion = f"models:/{name}/{before}" if before else None
    decision = _decide(exact, facts.get("run_id") or "", champion, alias, margin, force)
    tracking.set_alias(name, alias if decision.promoted else "", version, decision.tags())
    log.info("%s", decision.line())
    return decision


def _decide(exact: str, run_id: str, champion: str | None, alias: str, margin: float, force: bool) -> Promotion:
    if champion == exact:
        return Promotion(exact, alias, True, f"@{alias} names it already", champion=champion, margin=margin)
    if force:
        why = f"--force: moved without a comparison (@{alias} named {champion or 'nothing'})"
        return Promotion(exact, alias, True, why, champion=champion, margin=margin)
    heldout = tracking.run_datasets(run_id).get("heldout") if run_id else None
    if champion is None:
        score = _score(exact, heldout["source"]) if heldout else None
        why = f"the first version with @{alias} unset"
        return Promotion(exact, alias, True, why, score, None, None, heldout["digest"] if heldout else None, margin)
    old_run = tracking.registered_version(*champion.removeprefix("models:/").split("/"), None).get("run_id")
    old = tracking.run_datasets(old_run).get("heldout") if old_run else None
    if heldout is None or old is None or heldout["digest"] != old["digest"]:
        digests = f"{heldout['digest'] if heldout else 'none logged'} against {old['digest'] if old else 'none logged'}"
        why = f"no comparison with {champion}: their heldout data differ (digest {digests}); --force moves it anyway"
        return Promotion(exact, alias, False, why, champion=champion, margin=margin)
    new_score, old_score = _score(exact, heldout["source"]), _score(champion, heldout["source"])
    better = new_score is not None and old_score is not None and new_score < old_score * (1.0 - margin)
    if new_score is None or old_score is None:
        why = f"no comparison with {champion}: one of them has no softmax or another vocabulary than the data's"
    else:
        relation = "below" if better else "not below"
        why = (
            f"heldout perplexity {new_score:.2f} is {relation} {champion}'s {old_score:.2f} less the margin "
            f"{margin:g} (digest {heldout['digest'][:12]})"
        )
    return Promotion(exact, alias, better, why, new_score, champion, old_score, heldout["digest"], margin)


def _score(reference: str, heldout: str) -> float | None:
    """Heldout perplexity (full softmax) of the model ``reference`` on the token ids in ``heldout``; None where it
    has no softmax, or a vocabulary other than the one the ids were made with (``<data>/vocab.txt``)."""
    bilm = Runtime.open(reference).bilm
    vocab_file = Path(heldout).parent.parent / "vocab.txt"
    words = vocab_file.read_text(encoding="utf-8").splitlines() if vocab_file.exists() else None
    if bilm.softmax is None or bilm.vocab is None or (words is not None and bilm.vocab != words):
        return None
    return evaluate(bilm, heldout)["perplexity"]
