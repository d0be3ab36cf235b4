"""Checkpoint-store settings: storage URLs are checked at start-up with messages an operator can act on."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_checkpoint.main import main
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.settings import SettingsError, load_settings

PREFIX = "TRAINYARD_CHECKPOINT_"


def load(env: dict[str, str], argv: list[str] | None = None) -> CheckpointSettings:
    return load_settings(CheckpointSettings, prog="trainyard-checkpoint-store", env_prefix=PREFIX,
                         argv=argv or [], env=env)


def test_defaults_and_sources() -> None:
    s = load({})
    assert s.storage_root == Path("/var/lib/trainyard/checkpoints")
    assert s.listen_port == 50053
    s = load({PREFIX + "STORAGE_URL": "file:///mnt/lustre/ckpt", PREFIX + "LISTEN_PORT": "7400"},
             ["--listen-port", "7401"])
    assert s.storage_root == Path("/mnt/lustre/ckpt") and s.listen_port == 7401
    assert load({PREFIX + "STORAGE_URL": "file://localhost/data/my%20ckpts"}).storage_root == \
        Path("/data/my ckpts")


@pytest.mark.parametrize(("url", "message"), [
    ("s3://bucket/prefix", "S3 support arrives with the checkpoint issue"),
    ("S3://bucket/prefix", "S3 support arrives with the checkpoint issue"),
    ("/var/lib/ckpt", "unsupported storage URL scheme '(none)'"),
    ("gs://bucket", "unsupported storage URL scheme 'gs'"),
    ("file://server/share", "takes no host"),
    ("file:relative/path", "must be absolute"),
    ("file:///", "filesystem root"),
    ("file:///a/../b", "'..'"),
    ("file:///a?x=1", "no query"),
])
def test_bad_storage_urls(url: str, message: str) -> None:
    with pytest.raises(SettingsError, match="storage_url") as info:
        load({PREFIX + "STORAGE_URL": url})
    assert message in info.value.message


def test_main_exits_2_with_the_message_on_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--storage-url", "s3://bucket/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "S3 support arrives with the checkpoint issue" in err
