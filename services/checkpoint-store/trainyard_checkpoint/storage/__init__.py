"""Where checkpoint files live: the storage interface (`api.py`) and its backends (`posix.py`, `s3.py`)."""

from __future__ import annotations

from ..settings import CheckpointSettings
from .api import CheckpointStorage
from .posix import PosixStorage


def open_storage(settings: CheckpointSettings) -> CheckpointStorage:
    """The backend the storage URL names. Not checked yet: call `check()` before serving."""
    url = settings.storage
    if url.scheme == "s3":
        from .s3 import S3Storage  # s3fs and botocore load only when S3 is used

        key, secret, token = settings.s3_credentials()
        return S3Storage(url.bucket, url.prefix, endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
                         access_key_id=key, secret_access_key=secret, session_token=token,
                         conditional_writes=settings.s3_conditional_writes)
    assert url.path is not None
    return PosixStorage(url.path, settings.owners())


__all__ = ["CheckpointStorage", "PosixStorage", "open_storage"]
