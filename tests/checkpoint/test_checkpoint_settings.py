"""Checkpoint-store settings: storage URLs are checked at start-up with messages an operator can act on; the
environment is TRAINYARD_CHECKPOINT_STORE_<SETTING>, beside the workers' TRAINYARD_CHECKPOINT_* variables."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainyard_checkpoint.main import main
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.settings import SettingsError, load_settings, redacted

PREFIX = "TRAINYARD_CHECKPOINT_STORE_"
# What a worker's environment holds (the scheduler's launch env, the client's settings, the CLI's): a store
# started from such an environment must neither take these for settings nor refuse them.
WORKER_ENV = {
    "TRAINYARD_CHECKPOINT_STORE": "10.0.0.5:50053", "TRAINYARD_CHECKPOINT_EVERY_STEPS": "500",
    "TRAINYARD_CHECKPOINT_INTERVAL_S": "1800", "TRAINYARD_CHECKPOINT_KEEP_LAST": "3",
    "TRAINYARD_CHECKPOINT_KEEP_EVERY_STEPS": "1000", "TRAINYARD_CHECKPOINT_THREADS": "4",
    "TRAINYARD_CHECKPOINT_CHUNK_BYTES": "4096", "TRAINYARD_CHECKPOINT_TIMEOUT_S": "60",
    "TRAINYARD_JOB_ID": "job-a", "TRAINYARD_ATTEMPT": "1", "TRAINYARD_URL": "http://gw:8080",
    "TRAINYARD_TOKEN": "ty_x",
}


def load(env: dict[str, str], argv: list[str] | None = None) -> CheckpointSettings:
    return load_settings(CheckpointSettings, prog="trainyard-checkpoint-store", argv=argv or [], env=env)


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


def test_the_prefix_is_the_service_name() -> None:
    """TRAINYARD_CHECKPOINT_STORE_STORAGE_URL, as the docs say (TRAINYARD_<SERVICE>_), was silently ignored."""
    assert CheckpointSettings.env_prefix == "TRAINYARD_CHECKPOINT_STORE_"
    assert load({"TRAINYARD_CHECKPOINT_STORE_STORAGE_URL": "file:///mnt/ckpt"}).storage_root == Path("/mnt/ckpt")


def test_an_unknown_variable_under_the_prefix_stops_the_store() -> None:
    with pytest.raises(SettingsError) as info:
        load({PREFIX + "STORAGE_ULR": "file:///mnt/ckpt"})
    assert f"{PREFIX}STORAGE_ULR is no setting" in info.value.message
    assert f"{PREFIX}STORAGE_URL" in info.value.message


def test_main_exits_2_naming_an_unknown_variable(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PREFIX + "GC_INTERVAL", "5")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert f"{PREFIX}GC_INTERVAL is no setting" in err and f"{PREFIX}GC_INTERVAL_S" in err


def test_a_workers_environment_is_not_taken_for_settings(caplog: pytest.LogCaptureFixture) -> None:
    """TRAINYARD_CHECKPOINT_STORE (the store's address, no trailing '_') is not under the prefix."""
    with caplog.at_level(logging.WARNING):
        s = load(WORKER_ENV)
    assert s == load({}) and not caplog.text


def test_the_old_prefix_still_works_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Installs and scripts that set TRAINYARD_CHECKPOINT_STORAGE_URL keep working, and hear about it."""
    with caplog.at_level(logging.WARNING, logger="trainyard_core.settings"):
        s = load({**WORKER_ENV, "TRAINYARD_CHECKPOINT_STORAGE_URL": "file:///old",
                  "TRAINYARD_CHECKPOINT_GC_GRACE_S": "10"})
    assert s.storage_root == Path("/old") and s.gc_grace_s == 10.0
    assert "TRAINYARD_CHECKPOINT_STORAGE_URL is an old name; use TRAINYARD_CHECKPOINT_STORE_STORAGE_URL" in caplog.text
    assert load({"TRAINYARD_CHECKPOINT_STORAGE_URL": "file:///old",
                 PREFIX + "STORAGE_URL": "file:///new"}).storage_root == Path("/new")
    # main.py and the local cluster still name the old prefix; they get the current one.
    s = load_settings(CheckpointSettings, prog="c", env_prefix="TRAINYARD_CHECKPOINT_",
                      env={PREFIX + "LISTEN_PORT": "7000", **WORKER_ENV})
    assert s.listen_port == 7000


def test_run_as_maps_teams_from_the_setting_and_the_site_file(tmp_path: Path) -> None:
    site = tmp_path / "teams"
    site.write_text("# team uid:gid\nml 2001:2001\nresearch 2002:2002\n")
    s = load({PREFIX + "RUN_AS": "ml=2003:2003", PREFIX + "RUN_AS_FILE": str(site)})
    assert s.run_as == {"ml": "2003:2003", "research": "2002:2002"}, "run_as entries win over the file"
    assert {team: (i.uid, i.gid) for team, i in s.owners().items()} == {"ml": (2003, 2003), "research": (2002, 2002)}
    assert load({}).owners() == {}


@pytest.mark.parametrize(("env", "message"), [
    ({"RUN_AS": "ml=0:0"}, "uid 0 is root"),
    ({"RUN_AS": "ml=2001:2001,research=2001:2002"}, "both run as uid 2001"),
    ({"RUN_AS": "ML!=2001:2001"}, "is not a team name"),
    ({"RUN_AS_FILE": "/nonexistent/teams"}, "cannot read run_as_file"),
    ({"RUN_AS": "ml=2001:2001", "STORAGE_URL": "s3://ckpt-bucket/p"}, "with s3:// storage there are none"),
])
def test_bad_run_as_is_refused_with_what_to_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load({PREFIX + k: v for k, v in env.items()})
    assert message in info.value.message
