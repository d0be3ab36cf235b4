"""Where checkpoint files live: the storage interface (`api.py`) and its backends (`posix.py`)."""

from .api import CheckpointStorage
from .posix import PosixStorage

__all__ = ["CheckpointStorage", "PosixStorage"]
