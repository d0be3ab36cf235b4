"""The API's contract, once: every limit, name rule and closed vocabulary of a job spec, a queue, a quota
and a token. The gateway's request schemas (and so its OpenAPI document), the scheduler's validation and
the CLI all read them from here; a second copy of a limit drifts (ours did: `nodes` was 10,000 in the
gateway and 4,096 in the scheduler, so the API advertised requests the scheduler then refused).

Plain constants, enums and `Name` rules: no pydantic or grpc, so the scheduler's domain layer imports it.

A `Name`'s `pattern` is read by three regex engines: pydantic's (Rust `regex`, through `Field(pattern=)`),
JSON Schema's (ECMA-262: the OpenAPI document, and the tools that generate requests from it) and Python's
`re` (the scheduler, the CLI). The patterns use only what all three read the same way: explicit ASCII
classes and ranges, no `.`, `\\s`, `\\w` or `\\d`; and Python matches them with `fullmatch`, because its `$`
also matches before a trailing newline. Lengths are counted in characters (code points), as JSON Schema's
`maxLength` and Python's `len` count them.

A few rules relate fields and so are not one field's bound; the gateway states each in its schema
(`if`/`then`, `not`, `uniqueItems`) and the scheduler checks them too: `accelerator` or `accelerators`,
not both; a CPU task (`gpus_per_node` 0) names no GPU; `topology.required` and `topology.wait_s` need a
`topology.tier`, and not each other. One limit JSON Schema cannot state at all: the command's arguments
together are at most `MAX_COMMAND_LENGTH` characters (the schema's description says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

INT32_MAX = 2**31 - 1
DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class Name:
    """A name rule: `pattern` for schemas and validators, `rule` for messages ("must be <rule>")."""

    pattern: str
    rule: str
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (self.pattern.startswith("^") and self.pattern.endswith("$")):
            raise ValueError(f"a Name's pattern is anchored at both ends: {self.pattern!r}")
        object.__setattr__(self, "_regex", re.compile(self.pattern))

    def matches(self, value: str) -> bool:
        return self._regex.fullmatch(value) is not None

    @property
    def or_empty(self) -> Name:
        """The same rule for a field where "" means "none" (the default queue, any accelerator, ...)."""
        return Name(f"^({self.pattern[1:-1]})?$", f"{self.rule}, or empty")


# --- names ---------------------------------------------------------------------------------------------

JOB_NAME = Name(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$",
                "1-63 lower-case letters, digits, '.', '_' or '-', starting and ending with a letter or digit")
# One DNS label: a team, and the name of a node or tool principal (it is also a DNS name in its certificate).
DNS_LABEL = Name(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
                 "1-63 lower-case letters, digits or '-', starting and ending with a letter or digit")
# One rule for the team a token acts for, a job's team and a quota's team: a token minted for a team whose
# jobs the scheduler refuses was the bug (`ml_team`).
TEAM = DNS_LABEL
USER = Name(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$",
            "1-128 letters, digits, '.', '_', '@', '+' or '-', starting with a letter or digit")
QUEUE_NAME = Name(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$",
                  "1-63 lower-case letters, digits, '-' or '_', starting and ending with a letter or digit")
# Priority classes are named by the operator in the scheduler's settings.
PRIORITY_CLASS = Name(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                      "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
LABEL_KEY = Name(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$",
                 "1-63 letters, digits, '.', '_', '/' or '-', starting and ending with a letter or digit")
ENV_KEY = Name(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
               "1-128 letters, digits and '_', not starting with a digit")
# Accelerator models as the agents report them (normalised: 'NVIDIA H100 80GB HBM3' → 'H100-80GB-HBM3').
MODEL_NAME = Name(r"^[!-~]{1,64}$", "1-64 characters of printable ASCII without spaces (e.g. H100-80GB-HBM3)")
COMPUTE_CAPABILITY = Name(r"^[0-9]{1,2}\.[0-9]{1,2}$", 'major.minor, like "8.0" or "9.0"')
# Ids the services mint (`trainyard_core.ids.new_id`): jobs, tokens; node ids follow the same rule.
ID = Name(r"^[a-z][a-z0-9-]{2,62}$", "3-63 lower-case letters, digits and '-', starting with a letter")
# A page token is opaque (the scheduler's listing module makes them): base64url, at most 256 characters.
PAGE_TOKEN = Name(r"^[A-Za-z0-9_-]{1,256}$", "the next_page_token of the previous page, unchanged")
IDEMPOTENCY_KEY = Name(r"^[A-Za-z0-9._-]{1,128}$", "1-128 letters, digits, '.', '_' or '-'")
# Strings handed to exec() or the environment cannot carry NUL.
NO_NUL = Name(r"^[^\x00]*$", "text without NUL characters")
PROGRAM = Name(r"^[^\x00-\x20][^\x00]*$",
               "a program: not empty, not starting with a space or control character, no NUL characters")
WORKING_DIR = Name(r"^(/[^\x00]*)?$", "an absolute path without NUL characters (or empty: a per-job directory)")
# What a node agent writes to its GPU-health audit log: one line a person can read anywhere.
GPU_HEALTH_REASON = Name(r"^[ -~]*[!-~][ -~]*$", "one line of printable ASCII, not only spaces")
# The checkpoint-store's ids (an ID that starts with "ckpt-") and tag names; its validation reads them too.
CHECKPOINT_ID = Name(r"^ckpt-[a-z0-9-]{0,58}$", "'ckpt-' followed by lower-case letters, digits and '-' (as the "
                     "checkpoint-store returns them), 5-63 characters")
CHECKPOINT_TAG = Name(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
                      "1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")

NAMES: tuple[Name, ...] = (JOB_NAME, TEAM, USER, QUEUE_NAME, PRIORITY_CLASS, LABEL_KEY, ENV_KEY, MODEL_NAME,
                           COMPUTE_CAPABILITY, ID, IDEMPOTENCY_KEY, PAGE_TOKEN, NO_NUL, PROGRAM, WORKING_DIR,
                           GPU_HEALTH_REASON, CHECKPOINT_ID, CHECKPOINT_TAG)


def rule_for(pattern: str) -> str | None:
    """The rule of a pattern given in a validation error, for a message a person can act on."""
    for name in NAMES:
        for form in (name, name.or_empty):
            if form.pattern == pattern:
                return form.rule
    return None


# --- vocabularies ----------------------------------------------------------------------------------------

class JobState(StrEnum):
    PENDING = "pending"
    ADMITTED = "admitted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"
    RESTARTING = "restarting"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobState)
# A checkpoint's states as the API names them (the checkpoint-store's CheckpointState, lower case).
CHECKPOINT_STATES: tuple[str, ...] = ("writing", "committed", "aborted", "deleted", "damaged")
# Domains a job may ask its gang to fit in, innermost first (node ⊂ leaf switch ⊂ spine ⊂ zone); "" asks
# for none. The scheduler also knows the NVLink island inside a node and the whole cluster: not a job's to
# ask (a node's share is packed into one island anyway, and "cluster" constrains nothing).
TOPOLOGY_TIERS: tuple[str, ...] = ("node", "leaf", "spine", "zone")
PLACEMENT_TIERS: tuple[str, ...] = ("island", *TOPOLOGY_TIERS, "cluster")
PREEMPTION_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
DEFAULT_PREEMPTION_SIGNAL = "SIGTERM"
DEFAULT_QUEUE = "default"
# A quota's entry for every accelerator model without one of its own.
ANY_MODEL = "*"
# Set by the scheduler and the agent for every worker; a job may not set them.
RESERVED_ENV: tuple[str, ...] = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
    "GROUP_RANK", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
)
RESERVED_ENV_PREFIX = "TRAINYARD_"

# --- job spec limits -------------------------------------------------------------------------------------

MAX_NODES = 4096
MAX_GPUS_PER_NODE = 64
MAX_CPUS_PER_NODE = 4096
MAX_MEMORY_GB = 4096
MAX_ACCELERATORS = 16
MAX_VENDOR_LENGTH = 32
MAX_SPEED_HINTS = 32
MAX_SPEED_HINT = 1000.0  # and > 0
MAX_COMMAND_ARGS = 1024
MAX_ARG_LENGTH = 32 * 1024
MAX_COMMAND_LENGTH = 128 * 1024  # every argument together
MAX_ENV_VARS = 256
MAX_ENV_VALUE_LENGTH = 32 * 1024
MAX_WORKING_DIR_LENGTH = 4096
MAX_LABELS = 64
# The label a resubmitted job carries: the id of the job whose spec it was made from.
RESUBMITTED_FROM_LABEL = "resubmitted_from"
MAX_LABEL_VALUE_LENGTH = 253
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_RESTARTS = 100
DEFAULT_RESTART_BACKOFF_S = 10.0
MAX_RESTART_BACKOFF_S = 3600.0
MAX_TIME_LIMIT_S = 365.0 * DAY_S
MAX_GRACE_S = 3600.0
MAX_TOPOLOGY_WAIT_S = 7.0 * DAY_S
MAX_CHECKPOINT_STEPS = 10**9
MAX_CHECKPOINT_INTERVAL_S = 7.0 * DAY_S
MAX_KEEP_LAST = 10_000
MAX_REASON_LENGTH = 1024  # a cancel or cordon reason
MAX_GPU_HEALTH_REASON_LENGTH = 500  # the node agent's audit log

# --- queues, quotas, tokens ------------------------------------------------------------------------------

MIN_QUEUE_TIER, MAX_QUEUE_TIER = -1000, 1000
MAX_GPUS = 10_000_000  # a queue's max_gpus, a quota's nominal and borrow_limit
MAX_NODE_LABELS = 16
MAX_NODE_LABEL_VALUE_LENGTH = 63
MAX_QUEUE_DESCRIPTION = 512
MAX_QUOTA_WEIGHT = 1000.0  # and > 0
MAX_QUOTA_MODELS = 64
MAX_TOKEN_DESCRIPTION = 256

# --- listing -----------------------------------------------------------------------------------------------

MAX_PAGE_SIZE = 500
# Submits in one SubmitJobs call (the gateway's batches of its concurrent submits).
MAX_SUBMIT_BATCH = 256
DEFAULT_PAGE_SIZE = 50
MAX_JOB_NAME_LENGTH = 63  # JOB_NAME's; a name-prefix filter is at most this long
# The times a filter may name: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z, RFC 3339's range (and
# protobuf Timestamp's).
MIN_UNIX_TIME_S = -62_135_596_800
MAX_UNIX_TIME_S = 253_402_300_799
MAX_LOG_TAIL = 1_000_000

# --- usage and cost ----------------------------------------------------------------------------------------

# What GET /v1/usage (the scheduler's UsageService) groups GPU-hours, CPU-hours and cost by: the job's team,
# its "project" label, its submitter, the accelerator model, its queue, or the job itself.
USAGE_GROUPS: tuple[str, ...] = ("team", "project", "user", "model", "queue", "job")
DEFAULT_USAGE_GROUP = "team"
DEFAULT_USAGE_WINDOW_DAYS = 30  # the window a usage report covers when it names no start
DEFAULT_USAGE_ROWS, MAX_USAGE_ROWS = 1000, 10_000  # groups in one answer (the largest first); totals cover all
DEFAULT_PENDING_ROWS, MAX_PENDING_ROWS = 100, 1000  # queue entries in one answer (the first in order); total counts all
# The currency prices are given in: an ISO 4217 code.
CURRENCY = Name(r"^[A-Z]{3}$", "3 upper-case letters, an ISO 4217 code (e.g. USD, EUR)")

# --- roles, scopes and token lifetimes ---------------------------------------------------------------------
# What a gateway token may do is its role (per team: viewer < member < admin; `operator` for the whole
# cluster), narrowed by its optional scopes. Which action needs which role and scope is the gateway's one
# table (trainyard_gateway.roles); the names live here for the gateway, its TokenService and the CLI.


class Role(StrEnum):
    VIEWER = "viewer"  # reads its team's jobs, logs, quota; the queues; nodes without addresses
    MEMBER = "member"  # viewer + submit, and cancel its own jobs
    ADMIN = "admin"  # member + cancel any job of its team, manage its team's tokens (up to admin)
    OPERATOR = "operator"  # the cluster: every team, nodes, queues, quotas, tokens of any role, audit

    @property
    def rank(self) -> int:
        return ROLES.index(self.value)

    def at_least(self, other: Role) -> bool:
        return self.rank >= other.rank


ROLES: tuple[str, ...] = tuple(r.value for r in Role)  # lowest first
DEFAULT_ROLE = Role.MEMBER


class Scope(StrEnum):
    JOBS_READ = "jobs:read"  # jobs and their logs
    JOBS_WRITE = "jobs:write"  # submit, cancel
    NODES_READ = "nodes:read"
    NODES_WRITE = "nodes:write"  # cordon, uncordon, set GPU health
    QUEUES_READ = "queues:read"
    QUEUES_WRITE = "queues:write"
    QUOTAS_READ = "quotas:read"
    QUOTAS_WRITE = "quotas:write"
    TOKENS_READ = "tokens:read"
    TOKENS_WRITE = "tokens:write"  # create, revoke
    AUDIT_READ = "audit:read"
    USAGE_READ = "usage:read"  # GPU-hours, CPU-hours and cost


SCOPES: tuple[str, ...] = tuple(s.value for s in Scope)
# A token's lifetime at creation: `<n><unit>`, unit s, m, h or d ("90d", "12h").
TTL = Name(r"^[1-9][0-9]{0,7}[smhd]$", "a whole number followed by s, m, h or d (e.g. 90d, 12h, 30m)")
_TTL_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": DAY_S}
DEFAULT_TOKEN_TTL = "90d"
MAX_TOKEN_TTL_S = 3650 * DAY_S  # the most any gateway's token_max_ttl_s may allow


def ttl_seconds(ttl: str) -> int:
    """'90d' → 7776000; ValueError (naming the rule) for anything TTL does not match."""
    if not TTL.matches(ttl):
        raise ValueError(f"ttl must be {TTL.rule} (got {ttl[:40]!r})")
    return int(ttl[:-1]) * _TTL_UNIT_S[ttl[-1]]
