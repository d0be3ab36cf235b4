"""Checkpoint-store settings: storage URLs are checked at start-up with messages an operator can act on."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_checkpoint.main import main
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.settings import SettingsError, load_settings, redacted

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


def test_s3_url_and_credentials() -> None:
    s = load({PREFIX + "STORAGE_URL": "s3://ckpt-bucket/team/a/", PREFIX + "S3_ENDPOINT_URL": "http://127.0.0.1:9000",
              PREFIX + "S3_ACCESS_KEY_ID": "AKIDEXAMPLE", PREFIX + "S3_SECRET_ACCESS_KEY": "very-secret-value"})
    assert (s.storage.scheme, s.storage.bucket, s.storage.prefix) == ("s3", "ckpt-bucket", "team/a")
    assert s.s3_credentials() == ("AKIDEXAMPLE", "very-secret-value", "")
    shown = redacted(s)
    assert shown["s3_secret_access_key"] == "***" and shown["s3_access_key_id"] == "***"
    assert "very-secret-value" not in repr(s) and "very-secret-value" not in str(shown)
    assert load({PREFIX + "STORAGE_URL": "S3://ckpt-bucket"}).storage.prefix == ""


def test_s3_secret_without_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(SettingsError, match="s3_access_key_id and s3_secret_access_key go together") as info:
        load({PREFIX + "STORAGE_URL": "s3://ckpt-bucket/p", PREFIX + "S3_SECRET_ACCESS_KEY": "very-secret-value"})
    assert "very-secret-value" not in info.value.message


@pytest.mark.parametrize(("url", "message"), [
    ("s3://Bad_Bucket/prefix", "not a valid S3 bucket name"),
    ("s3://key:secret@bucket/prefix", "not in the URL"),
    ("s3://bucket/a/../b", "'..'"),
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
    assert main(["--storage-url", "gs://bucket/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "unsupported storage URL scheme 'gs'" in err


def test_commit_verify_and_gc_settings() -> None:
    s = load({})
    assert (s.commit_verify, s.gc_interval_s, s.gc_grace_s) == ("checksum", 300.0, 3600.0)
    s = load({PREFIX + "COMMIT_VERIFY": "size", PREFIX + "GC_INTERVAL_S": "0"})
    assert (s.commit_verify, s.gc_interval_s) == ("size", 0.0)
    with pytest.raises(SettingsError, match="commit_verify"):
        load({PREFIX + "COMMIT_VERIFY": "md5"})
