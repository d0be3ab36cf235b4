"""`trainyard completion bash|zsh`: the installed command prints a script that a real bash sources and completes
with (sub-commands, options, option values, positional choices), generated from the parser, so every command the
CLI has is in it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard_cli.completion import commands
from trainyard_cli.main import build_parser

TRAINYARD = str(Path(sys.executable).parent / "trainyard")
BASH = shutil.which("bash")


def _script(shell: str) -> str:
    proc = subprocess.run([TRAINYARD, "completion", shell], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` (the word being typed) after `trainyard` and the others."""
    assert BASH is not None
    line = " ".join(f"'{w}'" for w in ("trainyard", *words))
    program = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); _trainyard; "
               'printf "%s\\n" "${COMPREPLY[@]}"')
    proc = subprocess.run([BASH, "--norc", "-c", program], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_bash_completes_commands_options_and_values() -> None:
    script = _script("bash")
    assert complete(script, "no") == ["nodes"]
    assert {"list", "get", "cordon", "uncordon", "set-health", "--output"} <= set(complete(script, "nodes", ""))
    assert complete(script, "nodes", "set-health", "--un") == ["--unhealthy"]
    assert complete(script, "jobs", "--output", "") == ["table", "wide", "json", "yaml"]
    assert complete(script, "nodes", "get", "-o", "w") == ["wide"]
    assert complete(script, "status", "job-1", "--wa") == ["--watch"]  # a job id is skipped, not a command
    assert complete(script, "completion", "") == ["bash", "zsh", "--help"]
    assert "failed" in complete(script, "jobs", "--state", "")


def test_every_command_of_the_parser_is_in_the_script() -> None:
    parser = build_parser()
    paths = [c.path for c in commands(parser)]
    assert {"", "submit", "nodes", "nodes get", "nodes set-health", "quotas set", "tokens create",
            "completion"} <= set(paths)
    script = _script("bash")
    for path in paths:
        assert f"\n        {path or chr(39) * 2}) echo " in script or f"\n        '{path}') echo " in script, path
    zsh = _script("zsh")
    assert zsh.startswith("#compdef trainyard\n") and "bashcompinit" in zsh and zsh.endswith(script)


def test_an_unknown_shell_is_a_usage_error() -> None:
    proc = subprocess.run([TRAINYARD, "completion", "fish"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
