"""The agent's settings: derived defaults and validation messages (precedence is tested in core)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_agent.settings import AgentSettings, default_node_id
from trainyard_core.settings import SettingsError, load_settings


def load(*argv: str, env: dict[str, str] | None = None) -> AgentSettings:
    return load_settings(AgentSettings, prog="trainyard-agent", env_prefix="TRAINYARD_AGENT_", argv=list(argv),
                         env=env or {})


def test_defaults_are_derived(tmp_path: Path) -> None:
    s = load("--node-id", "gpu-node-01", "--listen-host", "10.1.2.3")
    assert s.advertise_host == s.worker_address == "10.1.2.3"
    assert s.state_dir.endswith("/trainyard/agent/gpu-node-01")
    assert s.agent_address(7000) == "10.1.2.3:7000"
    assert not s.simulated and s.heartbeat_interval_s == 1.0


def test_environment_maps_and_addresses(tmp_path: Path) -> None:
    s = load(env={"TRAINYARD_AGENT_GPU_PROFILE": "a100x4", "TRAINYARD_AGENT_LABELS": "rack=r1,switch=s3",
                  "TRAINYARD_AGENT_WORKER_ENV": "GLOO_SOCKET_IFNAME=lo", "TRAINYARD_AGENT_STATE_DIR": str(tmp_path),
                  "TRAINYARD_AGENT_ADVERTISE_HOST": "agent.example", "TRAINYARD_AGENT_WORKER_ADDRESS": "10.0.0.9",
                  "TRAINYARD_AGENT_KILL_WORKERS_ON_STOP": "true"})
    assert s.simulated and s.labels == {"rack": "r1", "switch": "s3"}
    assert s.worker_env == {"GLOO_SOCKET_IFNAME": "lo"} and s.kill_workers_on_stop
    assert (s.advertise_host, s.worker_address, s.state_dir) == ("agent.example", "10.0.0.9", str(tmp_path))


def test_a_wildcard_listen_address_is_not_advertised() -> None:
    s = load("--listen-host", "0.0.0.0", "--node-id", "gpu-node-01")
    assert s.advertise_host not in ("0.0.0.0", "")


@pytest.mark.parametrize("argv,message", [
    (["--node-id", "GPU_Node"], "node_id: Value error, 'GPU_Node' is not a valid node id"),
    (["--gpu-profile", "h200x8"], "unknown GPU profile 'h200x8'; known profiles: a100x4, a100x8, cpu, h100x8"),
    (["--scheduler-address", "scheduler"], "'scheduler' is not host:port"),
    (["--scheduler-address", "host:99999"], "'host:99999' is not host:port"),
    (["--listen-port", "70000"], "listen_port: Input should be less than or equal to 65535"),
    (["--heartbeat-interval-s", "0"], "heartbeat_interval_s: Input should be greater than 0"),
    (["--worker-env", "1BAD=x"], "'1BAD' is not a valid environment variable name"),
    (["--labels=-rack=r1"], "label key '-rack' must be"),
    (["--log-max-bytes", "10"], "log_max_bytes: Input should be greater than or equal to 4096"),
    (["--reconnect-initial-s", "10", "--reconnect-max-s", "1"], "reconnect_max_s (1.0) must be at least"),
    (["--labels", "rack"], "labels expects key=value pairs"),
])
def test_invalid_settings_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(*argv, "--state-dir", "/tmp/unused-agent-state")
    assert message in info.value.message


def test_state_dir_must_be_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SettingsError, match="exists and is not a directory"):
        load("--state-dir", str(f))


@pytest.mark.parametrize("hostname,node_id", [("gpu-node-01.cluster.local", "gpu-node-01"),
                                              ("GPU_NODE_7", "gpu-node-7"), ("42", "node-42"), ("a", "a-node")])
def test_node_id_from_host_name(hostname: str, node_id: str) -> None:
    assert default_node_id(hostname) == node_id


def test_topology_file_labels_merge_under_the_agents_own(tmp_path: Path) -> None:
    f = tmp_path / "topology.yaml"
    f.write_text("nodes:\n  gpu-node-01: {rack: r12, switch: leaf-3}\n")
    s = load("--node-id", "gpu-node-01", "--topology-file", str(f), "--labels", "switch=leaf-7,pool=batch",
             "--state-dir", str(tmp_path / "state"))
    assert s.labels == {"rack": "r12", "switch": "leaf-7", "pool": "batch"} and s.topology_file == str(f)


def test_a_topology_file_without_this_node_stops_the_agent(tmp_path: Path) -> None:
    f = tmp_path / "topology.yaml"
    f.write_text("nodes:\n  gpu-node-01: {rack: r12}\n")
    with pytest.raises(SettingsError) as info:
        load("--node-id", "gpu-node-02", "--topology-file", str(f), "--state-dir", str(tmp_path))
    assert f"topology file {f} does not list node 'gpu-node-02'" in info.value.message


def test_a_bad_health_policy_file_stops_the_agent(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text("xids:\n  79: {action: nuke}\n")
    with pytest.raises(SettingsError) as info:
        load("--health-policy-file", str(f), "--state-dir", str(tmp_path))
    assert "health_policy_file: Value error, health policy file" in info.value.message
    assert "xids.79.action: Input should be 'ignore'" in info.value.message
    f.write_text("xids:\n  79: {action: drain_node}\n")
    assert load("--health-policy-file", str(f), "--state-dir", str(tmp_path)).health_policy_file == str(f)


@pytest.mark.parametrize("argv,message", [
    (["--health-counters-interval-s", "0"], "health_counters_interval_s: Input should be greater than 0"),
    (["--health-policy-file", "/no/such/policy.yaml"], "cannot read health policy file /no/such/policy.yaml"),
    (["--topology-file", "/no/such/topology.yaml"], "cannot read topology file /no/such/topology.yaml"),
])
def test_more_invalid_settings_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(*argv, "--state-dir", "/tmp/unused-agent-state")
    assert message in info.value.message


def test_a_wildcard_listen_address_advertises_the_fqdn(monkeypatch: pytest.MonkeyPatch) -> None:
    """--advertise-host said it defaults to listen_host but was the short host name, which the scheduler's
    host often cannot resolve. Now: listen_host when concrete, else the FQDN (hostname -f)."""
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-node-01")
    monkeypatch.setattr("socket.getfqdn", lambda name="": f"{name}.cluster.example")
    assert load("--listen-host", "0.0.0.0").advertise_host == "gpu-node-01.cluster.example"
    assert load("--listen-host", "::").advertise_host == "gpu-node-01.cluster.example"
    assert load("--listen-host", "10.1.2.3").advertise_host == "10.1.2.3"
    assert load().advertise_host == "127.0.0.1"
    s = load("--listen-host", "0.0.0.0", "--advertise-host", "agent.example")
    assert (s.advertise_host, s.worker_address) == ("agent.example", "agent.example")


def test_a_resolver_that_only_knows_localhost_gives_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "vm")
    monkeypatch.setattr("socket.getfqdn", lambda name="": "localhost")
    assert load("--listen-host", "0.0.0.0").advertise_host == "vm"


def test_the_help_says_what_advertise_host_defaults_to() -> None:
    from trainyard_core.settings import settings_parser

    text = " ".join(settings_parser(AgentSettings, prog="trainyard-agent").format_help().split())
    assert "default: listen_host when it is a concrete address, else this host's FQDN" in text
    assert "--etcd-endpoints" not in text and "--etcd-prefix" not in text


def test_an_unknown_agent_variable_is_refused_loudly() -> None:
    with pytest.raises(SettingsError) as info:
        load(env={"TRAINYARD_AGENT_GPU_PROFILES": "h100x8"})
    assert "TRAINYARD_AGENT_GPU_PROFILES is no setting" in info.value.message
    assert "TRAINYARD_AGENT_GPU_PROFILE" in info.value.message
    # The workers' and the CLI's variables in the agent's environment are not its business.
    s = load(env={"TRAINYARD_CHECKPOINT_STORE": "h:1", "TRAINYARD_URL": "http://gw", "TRAINYARD_NODE_ID": "x",
                  "TRAINYARD_AGENT_NODE_ID": "gpu-node-09", "TRAINYARD_AGENT_STATE_DIR": "/tmp/unused-agent-state"})
    assert s.node_id == "gpu-node-09"
