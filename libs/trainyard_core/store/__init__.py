"""The control plane's durable state: a small compare-and-swap key-value interface (`api.Store`), its
etcd implementation (the real one) and an in-memory twin for pure-logic tests. One contract test suite
runs against both."""

from .api import (
    Compare,
    Delete,
    KeyValue,
    Put,
    RangeResult,
    Store,
    TxnResult,
    WatchEvent,
    absent,
    exists,
    mod_revision_is,
    value_is,
)

__all__ = [
    "Compare", "Delete", "KeyValue", "Put", "RangeResult", "Store", "TxnResult", "WatchEvent",
    "absent", "exists", "mod_revision_is", "value_is",
]
