"""Where a search's studies live, and the records each trial keeps there.

One Optuna study per flow, named `<search>/<flow>`, in one storage: a journal file (default; several
processes on one host) or an RDB URL (PostgreSQL for several hosts). Every study carries the
search's config (`user_attrs["search"]`), so workers and `--resume` read it back from the storage
alone. A trial's record (params, figures, timings, its eval folder) is its `user_attrs["record"]`.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from sparsetune.errors import SparsetuneError
from sparsetune.tuning.config import SearchConfig, flow_key, masked_url, storage_scheme

optuna.logging.set_verbosity(logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def is_rdb(url: str) -> bool:
    """A database URL (postgresql, sqlite), not a journal file path; another URL is refused."""
    return storage_scheme(url) is not None


def _driver_url(url: str) -> str:
    """`postgresql://` with psycopg 3 (what the `search` extra installs) unless a driver is named."""
    if url.startswith("postgresql://"):
        if importlib.util.find_spec("psycopg") is not None:
            return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def open_storage(url: str, *, create: bool = True) -> BaseStorage:
    """The storage at `url` (an RDB URL, or a journal file path); `create`: its file (a journal's or
    SQLite's) may be made, else it must exist (`search worker` and `search show` join or read a
    search, and leave no file behind for a mistyped path); unreachable: one line, the password masked."""
    shown, scheme = masked_url(url), storage_scheme(url)
    file = Path(url) if scheme is None else Path(url.partition(":///")[2].split("?")[0]) if scheme == "sqlite" else None
    if not create and file is not None and not file.is_file():
        raise SparsetuneError(f"--storage {shown}: no {'journal' if scheme is None else 'database'} file there; pass "
                              "a search's storage (runs/<study>/study.journal by default), or start the search first")
    if scheme is not None:
        try:
            return RDBStorage(_driver_url(url), engine_kwargs={"pool_pre_ping": True})
        except ImportError as e:
            raise SparsetuneError(f"--storage {shown}: its database driver is missing ({e.name}); "
                                  "pip install 'psycopg[binary]'") from None
        except Exception as e:  # sqlalchemy's OperationalError and friends
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SparsetuneError(f"--storage {shown}: cannot open it ({masked_url(url, first)}); check the URL "
                                  "and that the server runs") from None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(file)))
    except OSError as e:
        raise SparsetuneError(f"--storage {url}: cannot write a journal file there ({e.strerror})") from None


def study_name(search: str, flow: str) -> str:
    return f"{search}/{flow_key(flow)}"


def stored_config(storage: BaseStorage, search: str) -> SearchConfig | None:
    """The config a search stored with its studies (None: no such search in the storage)."""
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if summary.study_name.startswith(f"{search}/") and "search" in summary.user_attrs:
            return SearchConfig.model_validate(summary.user_attrs["search"])
    return None


def record_of(t: FrozenTrial) -> dict[str, Any] | None:
    return t.user_attrs.get("record")


def trial_count(studies: dict[str, optuna.Study], running: bool = True) -> int:
    """Trials that count against `--trials`: finished ones, failed ones and (`running`) those
    running now; a trial enqueued again (interrupted, or expired with its worker) counts once, as
    its retry."""
    states = (TrialState.COMPLETE, TrialState.FAIL) + ((TrialState.RUNNING,) if running else ())
    return sum(1 for s in studies.values() for t in s.get_trials(deepcopy=False, states=states)
               if not t.user_attrs.get("retried"))
