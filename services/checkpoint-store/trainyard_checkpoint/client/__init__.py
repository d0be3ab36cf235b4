"""Trainyard's checkpoint library for training scripts: DCP-compatible, checksummed, committed through the
checkpoint-store, with async saves in a separate process and verified loads that fall back to the
previous checkpoint when one is damaged. See client.py for the API and README for an example."""

from .async_save import SaveHandle
from .client import CheckpointClient, async_save, default_client, load_latest, save
from .env import ClientSettings, Retention
from .errors import CheckpointError, ConfigError, NoUsableCheckpoint, ShardCorrupt
from .loading import LoadOutcome, Skipped
from .reader import TrainyardReader
from .service import CheckpointInfo, ShardRecord
from .writer import TrainyardWriter

__all__ = [
    "CheckpointClient",
    "CheckpointError",
    "CheckpointInfo",
    "ClientSettings",
    "ConfigError",
    "LoadOutcome",
    "NoUsableCheckpoint",
    "Retention",
    "SaveHandle",
    "ShardCorrupt",
    "ShardRecord",
    "Skipped",
    "TrainyardReader",
    "TrainyardWriter",
    "async_save",
    "default_client",
    "load_latest",
    "save",
]
