"""deploy/ holds what a real host needs, and it agrees with the code and with deploy/README.md: the example
settings files load through each service's real loader, the systemd units pass `systemd-analyze verify`
and carry the keys the docs promise, the sysusers file creates the user they run as."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from trainyard_agent.main import EXIT_REFUSED
from trainyard_agent.settings import AgentSettings
from trainyard_checkpoint.settings import CheckpointSettings
from trainyard_core.addresses import address_list
from trainyard_core.settings import BaseSettings, EtcdSettings, SettingsError, load_settings
from trainyard_gateway.settings import GatewaySettings
from trainyard_scheduler.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONFIG = DEPLOY / "config"
UNITS = DEPLOY / "systemd"
SYSUSERS = DEPLOY / "sysusers.d" / "trainyard.conf"
SERVICES: list[tuple[str, type[BaseSettings]]] = [
    ("scheduler", SchedulerSettings),
    ("checkpoint-store", CheckpointSettings),
    ("gateway", GatewaySettings),
    ("agent", AgentSettings),
]
EXIT_INVALID_SETTINGS = 2  # trainyard_core.service.run, and argparse's usage errors
STATE_ROOT = Path("/var/lib")  # where systemd puts StateDirectory=


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as systemd reads it: sections of keys, each with every value given (in order)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in re.sub(r"\\\n", " ", path.read_text()).splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}: {raw!r} outside a section or without '='"
        key, value = (p.strip() for p in line.split("=", 1))
        current.setdefault(key, []).append(value)
    return sections


def one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def config_of(name: str) -> dict[str, object]:
    data = yaml.safe_load((CONFIG / f"{name}.yaml").read_text())
    assert isinstance(data, dict)
    return data


# --- example settings files ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "cls"), SERVICES)
def test_example_config_loads(name: str, cls: type[BaseSettings]) -> None:
    settings = load_settings(cls, prog=f"trainyard-{name}", argv=["--config", str(CONFIG / f"{name}.yaml")],
                             env={})
    assert settings.metrics_host == "0.0.0.0" and settings.metrics_port > 0
    assert isinstance(settings, EtcdSettings) == (name != "agent")


def test_every_example_config_is_a_services() -> None:
    assert sorted(p.stem for p in CONFIG.glob("*.yaml")) == sorted(name for name, _ in SERVICES)


def test_the_agent_has_no_etcd_settings() -> None:
    """It never talks to etcd; its --help offered etcd_endpoints and etcd_prefix all the same."""
    assert not {"etcd_endpoints", "etcd_prefix"} & set(AgentSettings.model_fields)
    with pytest.raises(SystemExit):
        load_settings(AgentSettings, prog="trainyard-agent", argv=["--etcd-endpoints", "e:2379"], env={})
    with pytest.raises(SettingsError, match="TRAINYARD_AGENT_ETCD_ENDPOINTS is no setting"):
        load_settings(AgentSettings, prog="trainyard-agent", env={"TRAINYARD_AGENT_ETCD_ENDPOINTS": "e:2379"})


def test_the_gateway_and_the_agents_are_given_every_scheduler_replica() -> None:
    gateway = address_list(str(config_of("gateway")["scheduler_address"]))
    agent = address_list(str(config_of("agent")["scheduler_address"]))
    assert len(gateway) >= 2 and gateway == agent
    replica = str(config_of("scheduler")["advertise_address"])
    assert replica in gateway


def test_the_agents_state_dir_is_its_units_state_directory() -> None:
    unit = parse_unit(UNITS / "trainyard-agent.service")
    assert Path(str(config_of("agent")["state_dir"])) == STATE_ROOT / one(unit, "Service", "StateDirectory")


def test_the_checkpoint_stores_default_storage_is_its_units_state_directory() -> None:
    unit = parse_unit(UNITS / "trainyard-checkpoint-store.service")
    default_root = load_settings(CheckpointSettings, prog="c", env={}).storage_root
    assert default_root == STATE_ROOT / one(unit, "Service", "StateDirectory")


# --- systemd units -----------------------------------------------------------------------------------------

def _console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_there_is_a_unit_per_service() -> None:
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(f"trainyard-{n}.service" for n, _ in SERVICES)


@pytest.mark.parametrize(("name", "cls"), SERVICES)
def test_unit_has_what_the_docs_promise(name: str, cls: type[BaseSettings]) -> None:
    unit = parse_unit(UNITS / f"trainyard-{name}.service")
    # `systemctl enable` starts it at boot only with an [Install] section.
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert (one(unit, "Service", "User"), one(unit, "Service", "Group")) == ("trainyard", "trainyard")
    program, *args = one(unit, "Service", "ExecStart").split()
    assert Path(program).name == f"trainyard-{name}" and Path(program).name in _console_scripts()
    assert args == ["--config", f"/etc/trainyard/{name}.yaml"] and (CONFIG / f"{name}.yaml").exists()
    assert one(unit, "Service", "EnvironmentFile") == f"-/etc/trainyard/{name}.env"
    assert one(unit, "Service", "Restart") == "always"
    no_restart = set(one(unit, "Service", "RestartPreventExitStatus").split())
    assert str(EXIT_INVALID_SETTINGS) in no_restart
    assert cls.env_prefix in (UNITS / f"trainyard-{name}.service").read_text()


def test_the_agent_unit_keeps_workers_and_stops_on_a_refused_registration() -> None:
    """services/node-agent/README.md: KillMode=process, RestartPreventExitStatus=3 (a refused registration
    restarting every 2 s forever helps nobody)."""
    unit = parse_unit(UNITS / "trainyard-agent.service")
    assert one(unit, "Service", "KillMode") == "process"
    assert str(EXIT_REFUSED) in one(unit, "Service", "RestartPreventExitStatus").split()
    assert one(unit, "Service", "StateDirectoryMode") == "0700"  # worker logs may hold secrets


def _verifiable_copies(tmp_path: Path) -> list[Path]:
    """The units with ExecStart pointing at this environment's console scripts (the /opt path of a real
    install does not exist here, and systemd-analyze checks that the program is executable)."""
    copies = []
    for unit in sorted(UNITS.glob("*.service")):
        program = one(parse_unit(unit), "Service", "ExecStart").split()[0]
        here = Path(sys.executable).parent / Path(program).name
        here_text = str(here) if here.exists() else (shutil.which(Path(program).name) or "/bin/true")
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace(program, here_text))
        copies.append(copy)
    return copies


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed "
                    "(the keys are still checked by parsing)")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    copies = _verifiable_copies(tmp_path)
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, copies)], capture_output=True,
                          text=True, timeout=120)
    # Unknown keys are only warnings; anything said about our units is a finding. Lines about other units
    # (the host's own) are not ours to judge.
    ours = [line for line in (done.stdout + done.stderr).splitlines()
            if any(c.name in line or str(c) in line for c in copies)]
    assert done.returncode == 0 and not ours, done.stdout + done.stderr


def test_the_unit_check_catches_an_unknown_key(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    bad = tmp_path / "trainyard-bad.service"
    bad.write_text("[Service]\nExecStart=/bin/true\nRestartPreventExitStatuses=3\n")
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)], capture_output=True, text=True,
                          timeout=120)
    assert "RestartPreventExitStatuses" in done.stdout + done.stderr


# --- the trainyard user ------------------------------------------------------------------------------------

def test_sysusers_creates_the_user_the_units_run_as() -> None:
    entries = [line.split() for line in SYSUSERS.read_text().splitlines() if line.strip() and line[0] != "#"]
    users = {e[1] for e in entries if e[0] == "u"}
    assert users == {one(parse_unit(u), "Service", "User") for u in UNITS.glob("*.service")}


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_file_is_valid(tmp_path: Path) -> None:
    # --root and --dry-run: nothing outside tmp_path is read for writing, nothing is written.
    done = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "trainyard" in done.stdout + done.stderr


def test_deploy_readme_installs_what_deploy_holds() -> None:
    """Every file under deploy/ that the README names exists, and the install steps name the sysusers file,
    the unit and `systemctl enable`."""
    text = (DEPLOY / "README.md").read_text()
    named = {m.rstrip(".,)`") for m in re.findall(r"deploy/[A-Za-z0-9_./-]+", text)}
    assert named and all((ROOT / n).exists() for n in named), sorted(n for n in named if not (ROOT / n).exists())
    for needed in ("deploy/sysusers.d/trainyard.conf", "systemd-sysusers", "systemctl enable", "daemon-reload"):
        assert needed in text


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    cfg = tmp_path / "s.yaml"
    cfg.write_text("listen_port: 1111\nnode_timeout_s: 7\nreconcile_interval_s: 3\nworker_fence_s: 20\n")
    s = load_settings(SchedulerSettings, prog="s", env_prefix="P_",
                      argv=["--config", str(cfg), "--listen-port", "3333"],
                      env={"P_LISTEN_PORT": "2222", "P_NODE_TIMEOUT_S": "9"})
    assert (s.listen_port, s.node_timeout_s, s.reconcile_interval_s) == (3333, 9.0, 3.0)


def test_bad_settings_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="master_port_range"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=["--master-port-range", "9-1"], env={})
    with pytest.raises(SettingsError, match="listen_port"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=[], env={"P_LISTEN_PORT": "-4"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_", argv=["--config", str(bad)], env={})


def test_node_timeout_must_be_longer_than_two_pulse_intervals() -> None:
    with pytest.raises(SettingsError, match=r"node_timeout_s \(1.0\) must be more than two liveness pulse intervals"):
        load_settings(SchedulerSettings, prog="s", env_prefix="P_",
                      argv=["--node-timeout-s", "1", "--heartbeat-interval-ms", "1000"], env={})
