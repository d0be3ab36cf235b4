"""The start-up check of a service's etcd settings: one authenticated read of its prefix and one write check,
so a wrong password, a certificate etcd does not trust, a CA that does not sign etcd's certificate, a
plaintext client of a TLS etcd or a role without the prefix stops the service at once with a message naming
the setting to fix and what etcd said — not a service that starts and then fails every call.
"""

from __future__ import annotations

from ..errors import PermissionDenied, Unavailable
from ..settings import SettingsError
from .api import Compare, Put
from .etcd import EtcdStore
from .etcd_client import LoginRefused, explain_connect_failure
from .etcd_options import file_problems

PROBE = ".access-check"


class StartupCheckFailed(SettingsError):
    """The etcd settings do not work; the message names the setting and what etcd said. A service exits 2
    on it, as on any other settings error."""


async def check_access(store: EtcdStore, prefix: str) -> None:
    """Raise StartupCheckFailed unless the store's credential may read and write keys under `prefix`.
    Writes nothing: the write check is a transaction whose compare never holds (etcd checks the permission
    of every operation of a transaction, taken or not). An etcd that is down raises Unavailable as any call."""
    base = prefix.rstrip("/")
    probe = f"{base}/{PROBE}"
    options = store.options
    problem = file_problems(options)
    if problem:
        raise StartupCheckFailed(problem)
    try:
        await store.range(base + "/", limit=1)
        await store.txn([Compare(probe, "create", "<", 0)], [Put(probe, b"")])
    except LoginRefused as exc:
        raise StartupCheckFailed(f"etcd_user/etcd_password: {exc.message}") from exc
    except PermissionDenied as exc:
        raise StartupCheckFailed(f"etcd_prefix {prefix}: {exc.message}") from exc
    except Unavailable as exc:
        why = explain_connect_failure(exc, options, store.endpoint)
        if why:
            raise StartupCheckFailed(why) from exc
        raise
