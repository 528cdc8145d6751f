"""The flows' one retry policy (``flows.common.RETRIED``) tells passing trouble from a user's error, on the errors
real calls raise: an MLflow server that does not answer is retried (with backoff), a version that does not exist
and a corpus that is not there are not."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from elmo_core.errors import StoreUnreachable
from elmo_core.options import RefreshConfig
from elmo_core.vectors.tables import plan_refresh
from flows.common import RETRIED, retry_unless_user_error


def _raised(monkeypatch, store: str, **config) -> BaseException:  # noqa: ANN003
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    with pytest.raises(Exception) as caught:
        plan_refresh(RefreshConfig(**{"input": "corpus", "table": "table", **config}))
    return caught.value


def _retried(error: BaseException) -> bool:
    return retry_unless_user_error(None, None, Failed(data=error))


def test_a_store_away_is_retried_with_backoff_and_a_bad_parameter_is_not(monkeypatch, tmp_path):
    away = _raised(monkeypatch, "http://127.0.0.1:9", model="models:/elmo@champion")  # nothing listens there
    assert isinstance(away, StoreUnreachable) and _retried(away)
    delays = RETRIED["retry_delay_seconds"](RETRIED["retries"])  # what Prefect waits before each retry
    assert RETRIED["retries"] == len(delays) and delays == sorted(delays) and delays[0] < delays[-1]

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    missing = _raised(monkeypatch, store, model="models:/nobody/7")
    assert "models:/nobody/7" in str(missing) and not _retried(missing)
    no_model = _raised(monkeypatch, store, model=str(tmp_path / "no-such-model"))
    assert not _retried(no_model)


def test_a_full_disk_is_not_retried_and_a_busy_one_is(tmp_path):
    """A full disk fails the task at once (its units stay, the rerun continues): as the kernel reports it, as
    Arrow's writer wraps it, and as the flows' boundary names it; another passing OS error is retried."""
    import errno

    from elmo_core.errors import DiskFullError

    raw = OSError(errno.ENOSPC, "No space left on device")
    arrow = OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
    named = DiskFullError(str(tmp_path), "0 B", "its 2 finished part files are kept")
    assert not any(_retried(error) for error in (raw, arrow, named))
    assert _retried(OSError(errno.EBUSY, "Device or resource busy"))
