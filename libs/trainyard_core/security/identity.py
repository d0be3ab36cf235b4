"""Principals: who is calling, as named by the URI SAN of its certificate.

Every certificate Trainyard trusts names exactly one principal, `trainyard://<kind>[/<name>]`:

    trainyard://scheduler            the scheduler replicas
    trainyard://gateway              the gateway replicas
    trainyard://checkpoint-store     the checkpoint-store replicas
    trainyard://node/<node_id>       the agent of one node
    trainyard://tool/<name>          an internal tool (its teams are bound in the callee's settings)
    trainyard://job/<job_id>         the workers of one job attempt (a short-lived certificate the scheduler
                                     mints at launch, signed by the job issuer: `job_credentials.py`)

The form mirrors SPIFFE IDs (`spiffe://<trust domain>/<path>`): a site running SPIRE or cert-manager
issues these URIs as the workloads' SVID/certificate SANs (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..contract import DNS_LABEL, ID, TEAM, Name

SCHEME = "trainyard://"
Kind = Literal["scheduler", "gateway", "checkpoint-store", "node", "tool", "job"]
SINGLETONS: tuple[Kind, ...] = ("scheduler", "gateway", "checkpoint-store")
NAMED: tuple[Kind, ...] = ("node", "tool", "job")
# A node's or tool's name is one DNS label (contract.DNS_LABEL), so each principal also has a DNS name in its
# certificate, which is what a client verifies a server's certificate against. A job's name is its job id
# (contract.ID), which is not always a DNS label (an id may end with '-'); a job principal is only ever a
# client, so it has no DNS name and its certificate carries none. The id's characters need no escaping in
# a URI.
DNS_SUFFIX = "trainyard.internal"
NAME_RULES: dict[Kind, Name] = {"node": DNS_LABEL, "tool": DNS_LABEL, "job": ID}
# Principals that only call, never serve.
CLIENT_ONLY: tuple[Kind, ...] = ("job",)


class InvalidPrincipal(ValueError):
    """A URI that does not name a Trainyard principal."""


@dataclass(frozen=True, slots=True)
class Principal:
    kind: Kind
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind in SINGLETONS and self.name:
            raise InvalidPrincipal(f"{self.kind} principals have no name (got {self.name!r})")
        rule = NAME_RULES.get(self.kind)
        if rule is not None and not rule.matches(self.name):
            raise InvalidPrincipal(f"{self.kind} principal needs a name of {rule.rule} (got {self.name!r})")
        if self.kind not in SINGLETONS + NAMED:
            raise InvalidPrincipal(f"unknown principal kind {self.kind!r}")

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.kind}/{self.name}" if self.name else f"{SCHEME}{self.kind}"

    @property
    def dns_name(self) -> str:
        """`<name>.<kind>.trainyard.internal`, or `<kind>.trainyard.internal`: in the certificate's DNS SANs,
        and the name a client expects of the server it calls (gRPC's target name override). A job principal
        never serves and has none (ValueError)."""
        if self.kind in CLIENT_ONLY:
            raise ValueError(f"{self} is a client-only principal: it has no DNS name")
        return f"{self.name}.{self.kind}.{DNS_SUFFIX}" if self.name else f"{self.kind}.{DNS_SUFFIX}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> Principal:
        if not uri.startswith(SCHEME):
            raise InvalidPrincipal(f"{uri!r} is not a {SCHEME} URI")
        parts = uri[len(SCHEME):].split("/")
        kind = parts[0]
        if kind in SINGLETONS and len(parts) == 1:
            return cls(kind)
        if kind in NAMED and len(parts) == 2:
            return cls(kind, parts[1])
        raise InvalidPrincipal(f"{uri!r} names no principal: expected {SCHEME}<scheduler|gateway|"
                               f"checkpoint-store> or {SCHEME}<node|tool|job>/<name>")


def node(node_id: str) -> Principal:
    return Principal("node", node_id)


def tool(name: str) -> Principal:
    return Principal("tool", name)


def job(job_id: str) -> Principal:
    return Principal("job", job_id)


SCHEDULER = Principal("scheduler")
GATEWAY = Principal("gateway")
CHECKPOINT_STORE = Principal("checkpoint-store")


def tool_team_bindings(pairs: Iterable[str]) -> dict[str, frozenset[str]]:
    """`TOOL:TEAM` pairs (a service's `tool_teams` setting: the teams each tool may act for) as tool name →
    teams; ValueError naming the first malformed pair."""
    out: dict[str, set[str]] = {}
    for pair in pairs:
        name, sep, team = pair.partition(":")
        try:
            tool(name)
        except InvalidPrincipal:
            raise ValueError(f"{pair!r}: expected TOOL:TEAM with TOOL a tool principal's name "
                             "(lower-case letters, digits, '-')") from None
        if not sep or not TEAM.matches(team):
            raise ValueError(f"{pair!r}: expected TOOL:TEAM with TEAM {TEAM.rule}")
        out.setdefault(name, set()).add(team)
    return {name: frozenset(teams) for name, teams in out.items()}
