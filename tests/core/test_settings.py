"""The shared settings loader: the class names its prefix, a variable under it that is no setting is refused
with the closest names, old prefixes keep their exact names with a warning, maps of models take
NAME=VALUE[,field=value] flags."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import BaseModel, Field

from trainyard_core.settings import (
    BaseSettings,
    SettingsError,
    env_names,
    load_settings,
    model_map_syntax,
    settings_parser,
)


class Tier(BaseModel):
    weight: int
    spot: bool = False


class ToySettings(BaseSettings):
    """Toy service."""

    env_prefix: ClassVar[str] = "TOY_SERVICE_"
    legacy_env_prefixes: ClassVar[tuple[str, ...]] = ("TOY_",)

    listen_port: int = Field(1, description="port")
    storage_url: str = "file:///x"
    labels: dict[str, str] = Field(default_factory=dict)
    tiers: dict[str, Tier] = Field(default_factory=lambda: {"default": Tier(weight=1)})
    verbose: bool = False


def load(*argv: str, env: dict[str, str] | None = None, prefix: str | None = None) -> ToySettings:
    return load_settings(ToySettings, prog="toy", env_prefix=prefix, argv=list(argv), env=env or {})


def test_the_class_names_its_prefix() -> None:
    assert load(env={"TOY_SERVICE_LISTEN_PORT": "7"}).listen_port == 7
    assert "TOY_SERVICE_CONFIG" in env_names(ToySettings) and "TOY_SERVICE_TIERS" in env_names(ToySettings)
    # A caller may still name another prefix (tests do); the class's own is then not read.
    assert load(env={"P_LISTEN_PORT": "8", "TOY_SERVICE_LISTEN_PORT": "7"}, prefix="P_").listen_port == 8


def test_an_unknown_variable_under_the_prefix_is_refused_with_the_closest_names() -> None:
    with pytest.raises(SettingsError) as info:
        load(env={"TOY_SERVICE_STORAGE_ULR": "file:///y"})
    message = info.value.message
    assert "TOY_SERVICE_STORAGE_ULR is no setting" in message and "TOY_SERVICE_STORAGE_URL" in message
    with pytest.raises(SettingsError, match=r"TOY_SERVICE_X is no setting.*the closest are TOY_SERVICE_"):
        load(env={"TOY_SERVICE_X": "1"})


def test_variables_outside_the_prefix_are_left_alone() -> None:
    """TOY_SERVICE (no trailing '_') is as TRAINYARD_CHECKPOINT_STORE is for the checkpoint-store: another
    program's variable, next to the prefix but not under it."""
    s = load(env={"TOY_SERVICE": "h:1", "TOY_SERVICEX_PORT": "2", "TOY_KEEP_LAST": "3", "OTHER_LISTEN_PORT": "4"})
    assert s.listen_port == 1


def test_old_prefix_exact_names_work_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trainyard_core.settings"):
        s = load(env={"TOY_STORAGE_URL": "file:///old", "TOY_VERBOSE": "yes"})
    assert s.storage_url == "file:///old" and s.verbose
    assert "TOY_STORAGE_URL is an old name; use TOY_SERVICE_STORAGE_URL" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainyard_core.settings"):
        s = load(env={"TOY_STORAGE_URL": "file:///old", "TOY_SERVICE_STORAGE_URL": "file:///new"})
    assert s.storage_url == "file:///new" and "TOY_STORAGE_URL is ignored" in caplog.text
    # Under the old prefix, names that are no setting belong to someone else: neither refused nor warned.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainyard_core.settings"):
        load(env={"TOY_KEEP_LAST": "3"})
    assert not caplog.text


def test_a_caller_naming_the_old_prefix_gets_the_current_one() -> None:
    s = load(env={"TOY_SERVICE_LISTEN_PORT": "9", "TOY_STORAGE_URL": "file:///old"}, prefix="TOY_")
    assert (s.listen_port, s.storage_url) == (9, "file:///old")
    with pytest.raises(SettingsError, match="TOY_SERVICE_LISTEN_PROT"):
        load(env={"TOY_SERVICE_LISTEN_PROT": "9"}, prefix="TOY_")


def test_maps_of_models_from_flags_and_the_environment() -> None:
    assert model_map_syntax(Tier) == "NAME=WEIGHT[,spot=...]"
    s = load("--tiers", "gold=10", "--tiers", "spot=1,spot=true")
    assert s.tiers == {"gold": Tier(weight=10), "spot": Tier(weight=1, spot=True)}
    s = load(env={"TOY_SERVICE_TIERS": "gold=weight=10;spot=1,spot=yes"})
    assert s.tiers == {"gold": Tier(weight=10), "spot": Tier(weight=1, spot=True)}
    assert "repeatable: NAME=WEIGHT[,spot=...]" in " ".join(settings_parser(ToySettings, prog="toy").format_help()
                                                             .split())


@pytest.mark.parametrize(("value", "message"), [
    ("gold", "tiers expects NAME=WEIGHT[,spot=...], got 'gold'"),
    ("gold=", "expects NAME=WEIGHT"),
    ("gold=1,cheap=true", "entry 'gold': unknown field 'cheap'"),
    ("gold=1,2", "expects NAME=WEIGHT"),
    ("gold=lots", "tiers.gold.weight"),
])
def test_bad_model_map_entries_are_named(value: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load("--tiers", value)
    assert message in info.value.message


def test_plain_maps_and_scalars_from_flags() -> None:
    s = load("--labels", "rack=r1,switch=s3", "--labels", "zone=z", "--listen-port", "123", "--verbose")
    assert s.labels == {"rack": "r1", "switch": "s3", "zone": "z"} and s.listen_port == 123 and s.verbose


def test_abbreviated_flags_are_refused() -> None:
    """argparse would take --listen for --listen-port: a documented flag that lost its end would still work."""
    with pytest.raises(SystemExit):
        load("--listen", "5")


def test_an_unknown_key_in_the_file_names_the_closest(tmp_path: Path) -> None:
    f = tmp_path / "toy.yaml"
    f.write_text("listen_prot: 5\n")
    with pytest.raises(SettingsError, match="'listen_prot' is no setting of this service; the closest are listen_port"):
        load("--config", str(f))
    # The file named through the environment.
    f.write_text("listen-port: 5\n")
    assert load(env={"TOY_SERVICE_CONFIG": str(f)}).listen_port == 5


def test_the_base_settings_say_metrics_are_off_by_default() -> None:
    help_text = " ".join(settings_parser(ToySettings, prog="toy").format_help().split())
    assert "-1 (the default): off" in help_text and "TOY_SERVICE_LISTEN_PORT" in help_text
    assert load().metrics_port == -1
    with pytest.raises(SettingsError, match="metrics_port"):
        load("--metrics-port", "-5")


def test_a_class_without_a_prefix_needs_one_given() -> None:
    class Bare(BaseSettings):
        pass

    with pytest.raises(ValueError, match="names no env_prefix"):
        load_settings(Bare, prog="bare")
    assert load_settings(Bare, prog="bare", env_prefix="B_", env={"B_LOG_LEVEL": "DEBUG"}).log_level == "DEBUG"
