"""The example settings files in deploy/config are valid for the services they are for."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_agent.settings import AgentSettings
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.settings import BaseSettings, load_settings
from trainyard_gateway.settings import GatewaySettings
from trainyard_scheduler.settings import SchedulerSettings

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "config"


@pytest.mark.parametrize(("name", "cls", "prefix"), [
    ("scheduler", SchedulerSettings, "TRAINYARD_SCHEDULER_"),
    ("checkpoint-store", CheckpointSettings, "TRAINYARD_CHECKPOINT_"),
    ("gateway", GatewaySettings, "TRAINYARD_GATEWAY_"),
    ("agent", AgentSettings, "TRAINYARD_AGENT_"),
])
def test_example_config_loads(name: str, cls: type[BaseSettings], prefix: str) -> None:
    settings = load_settings(cls, prog=name, env_prefix=prefix, argv=["--config", str(CONFIG / f"{name}.yaml")],
                             env={})
    assert settings.etcd_endpoints or name == "agent"
    assert settings.metrics_host == "0.0.0.0"


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("listen_port: 1111\nnode_timeout_s: 7\nreconcile_interval_s: 3\nworker_fence_s: 20\n")
    s = load_settings(SchedulerSettings, prog="s", env_prefix="P_",
                      argv=["--config", str(cfg), "--listen-port", "3333"],
                      env={"P_LISTEN_PORT": "2222", "P_NODE_TIMEOUT_S": "9"})
    assert (s.listen_port, s.node_timeout_s, s.reconcile_interval_s) == (3333, 9.0, 3.0)


def test_bad_settings_name_the_setting(tmp_path: Path) -> None:
    from trainyard_core.settings import SettingsError

    with pytest.raises(SettingsError, match="master_port_range"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=["--master-port-range", "9-1"], env={})
    with pytest.raises(SettingsError, match="listen_port"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=[], env={"P_LISTEN_PORT": "-4"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=["--config", str(bad)], env={})


def test_node_timeout_must_cover_several_heartbeats() -> None:
    from trainyard_core.settings import SettingsError

    with pytest.raises(SettingsError, match="at least 3 heartbeat intervals"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_",
                      argv=["--node-timeout-s", "1", "--heartbeat-interval-ms", "1000"], env={})
