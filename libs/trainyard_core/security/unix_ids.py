"""Teams' Unix identities: the site mapping `team → uid:gid` that the node-agent runs each team's workers as
(`run_as`, `run_as_file`), and that the checkpoint-store hands each team's checkpoint directories to on a
POSIX mount. One parser for both, so a mapping one accepts the other accepts too, with the same messages.

A site keeps the mapping the same on every host (as Slurm needs its users' uids to be): a team's workers on
any node and its directories on the shared filesystem are then the same owner.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..contract import TEAM

# Ids below are system accounts (Debian and Fedora give people and site services ids from 1000 up).
MIN_ID = 1000
# nobody / nogroup: shared by NFS root squashing and daemons, so what it owns is no team's alone.
NOBODY_ID = 65534
# (uid_t)-1 tells setreuid "leave it unchanged".
MAX_ID = 2**32 - 2
RUN_AS_EXAMPLE = "--run-as ml=2001:2001 --run-as research=2002:2002"


@dataclass(frozen=True, slots=True)
class Identity:
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


def _check_id(kind: str, value: int) -> int:
    if value < MIN_ID:
        what = "root" if value == 0 else "a system account"
        raise ValueError(f"{kind} {value} is {what}: workers run as ids from {MIN_ID} up")
    if value == NOBODY_ID:
        raise ValueError(f"{kind} {value} is nobody/nogroup, which daemons and NFS root squashing share: give "
                         "the team an id of its own")
    if value > MAX_ID:
        raise ValueError(f"{kind} {value} is out of range (at most {MAX_ID})")
    return value


def parse_identity(text: str) -> Identity:
    """`uid:gid`, `user:group`, either mixed, or a user name alone (with its primary group); names are
    looked up in the host's user database. ValueError naming what is wrong."""
    user, sep, group = text.strip().partition(":")
    if not user or (sep and not group):
        raise ValueError(f"{text!r} is not uid:gid, user:group or a user name (e.g. 2001:2001)")
    primary: int | None = None
    if user.isdigit():
        uid = int(user)
    else:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ValueError(f"no user named {user!r} on this host (getent passwd {user} finds none): create "
                             "it, or give the ids as uid:gid") from None
        uid, primary = entry.pw_uid, entry.pw_gid
    if not group:
        if primary is None:
            raise ValueError(f"{text!r} gives a uid without a gid: write uid:gid (e.g. {uid}:{uid})")
        gid = primary
    elif group.isdigit():
        gid = int(group)
    else:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"no group named {group!r} on this host (getent group {group} finds none)") from None
    return Identity(_check_id("uid", uid), _check_id("gid", gid))


def read_run_as_file(path: str) -> dict[str, str]:
    """The mapping in a site file: one `team uid:gid` (or `team user[:group]`) per line, `#` comments.
    ValueError naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read run_as_file {path}: {exc.strerror or exc}") from None
    mapping: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path} line {number}: expected 'team uid:gid' (e.g. 'ml 2001:2001'), got {raw!r}")
        team, who = fields
        if team in mapping:
            raise ValueError(f"{path} line {number}: team {team!r} is mapped twice")
        mapping[team] = who
    return mapping


def check_run_as(run_as: Mapping[str, str]) -> dict[str, Identity]:
    """Every team's identity; ValueError for a team name the contract refuses, an identity that cannot be
    a worker's, or two teams sharing a uid (their workers could read and signal each other's)."""
    identities: dict[str, Identity] = {}
    owner: dict[int, str] = {}
    for team, who in run_as.items():
        if not TEAM.matches(team):
            raise ValueError(f"run_as: {team!r} is not a team name: use {TEAM.rule}")
        try:
            ident = parse_identity(who)
        except ValueError as exc:
            raise ValueError(f"run_as: team {team!r}: {exc}") from None
        if ident.uid in owner:
            raise ValueError(f"run_as: teams {owner[ident.uid]!r} and {team!r} both run as uid {ident.uid}: give "
                             "each team a uid of its own, or their workers can read and signal each other's")
        owner[ident.uid] = team
        identities[team] = ident
    return identities


__all__ = ["MAX_ID", "MIN_ID", "NOBODY_ID", "RUN_AS_EXAMPLE", "Identity", "check_run_as", "parse_identity",
           "read_run_as_file"]
