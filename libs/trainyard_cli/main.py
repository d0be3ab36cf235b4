"""`trainyard`: the command-line client of the gateway.

Exit codes (EXIT_CODES, printed by `--help`): 0 success; 1 the API refused or the gateway could not be
reached (`error: <message>` on stderr, never a traceback); 2 usage errors (bad flags, unreadable spec file,
no URL or token configured). `status --watch` exits 0 when the job succeeded and 1 when it ended otherwise;
`submit --follow` 0 when it succeeded, 3 when it failed, 4 when it was cancelled (`submit --wait` the same
when the job ended before it was seen running, else 0 once it runs); 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from trainyard_core import contract

from . import audit, checkpoints, commands, completion, jobops, nodes, output, pending, usage
from .errors import CliError, UsageError
from .spec import parse_duration, when

STATES = list(contract.JOB_STATES)
EXIT_CODES = """\
exit codes:
  0    success (status --watch, submit --follow: the job succeeded; submit --wait: it runs or succeeded)
  1    the API refused the request or the gateway could not be reached (status --watch: the job did not succeed)
  2    usage error: bad flags, an unreadable spec file, no URL or token configured
  3    submit --follow or --wait: the job failed
  4    submit --follow or --wait: the job was cancelled
  130  interrupted (Ctrl-C)
"""
LOGS_EPILOG = """\
examples:
  trainyard logs JOB                          every rank's lines of the current attempt
  trainyard logs JOB --rank 0 --tail 100      the last 100 lines of rank 0
  trainyard logs JOB --attempt 1              the first attempt's lines, from the nodes it ran on
  trainyard logs -f JOB                       follow until the job ends (across restarts)
  trainyard logs -f JOB --attempt 0 --since 1h   every attempt that ran in the last hour, then follow

--follow streams the lines (server-sent events) and, when the connection drops, reconnects and goes on
after the last line it printed. --since selects attempts (the nodes keep no time per line): those that ended
before WHEN are left out. Lines go to stdout as `[rank N] text`; notes (a node that cannot be read for now,
a restart, a reconnect) to stderr.
"""
JOBS_EPILOG = """\
examples:
  trainyard jobs                                    the newest 50 jobs
  trainyard jobs --state failed --since 1d          what failed in the last day
  trainyard jobs --user alice --label project=atlas --all
  trainyard jobs --name sweep- --finished-since 2026-11-30T00:00:00Z

WHEN is a duration back from now (90s, 10m, 1h30m, 2d) or a time (2026-01-31T12:00:00Z).
"""

SUBMIT_EPILOG = """\
examples:
  trainyard submit --name hello --nodes 2 --gpus-per-node 1 -- python train.py --epochs 3
  trainyard submit -f job.yaml
  trainyard submit -f job.yaml --nodes 4 --env LR=3e-4      (flags override the file)
  trainyard submit --name big --nodes 4 --gpus-per-node 8 --accelerators H100-80GB-HBM3,A100-SXM4-80GB \\
      --priority-class high --topology-tier leaf --topology-wait 10m --time-limit 6h \\
      --preempt-signal SIGUSR1 --preempt-grace 2m --max-restarts 3 -- python train.py
  trainyard submit --name prep --nodes 1 --gpus-per-node 0 --cpus-per-node 16 -- python prep.py   (CPU task)

spec file (YAML or JSON):
  name: hello
  command: [python, train.py]
  env: {LR: "3e-4"}
  resources: {nodes: 2, gpus_per_node: 1, accelerators: [H100-80GB-HBM3, A100-SXM4-80GB], min_memory_gb: 40}
  priority_class: high
  topology: {tier: leaf, wait_s: 10m}
  preemption: {signal: SIGUSR1, grace_s: 60}
  time_limit_s: 6h

durations (flags and *_s fields of a spec file): seconds, or like 90s, 10m, 1h30m, 2d
"""

QUEUES_EPILOG = """\
examples:
  trainyard queues
  trainyard queues set batch --tier -10 --max-gpus 64 --node-label pool=spot --description "cheap, preemptible"
  trainyard queues delete batch

`set` replaces the whole queue (flags not given go back to their defaults). Changes need an operator token.
"""

QUOTAS_EPILOG = """\
examples:
  trainyard quotas
  trainyard quotas get vision
  trainyard quotas set vision --limit H100-80GB-HBM3=64:32 --limit '*=8' --weight 2
  trainyard quotas delete vision

--limit MODEL=NOMINAL[:BORROW_LIMIT]: NOMINAL GPUs of MODEL are guaranteed to the team; it may borrow idle
GPUs up to BORROW_LIMIT more (no :BORROW_LIMIT: no limit), and borrowed gangs are reclaimed first. '*'
covers every model without a limit of its own. `set` replaces the whole quota. Changes need an operator token.
"""
TIERS = list(contract.TOPOLOGY_TIERS)
SIGNALS = list(contract.PREEMPTION_SIGNALS)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _signal(text: str) -> str:
    name = text.strip().upper()
    return name if name.startswith("SIG") else "SIG" + name


def _common_options() -> argparse.ArgumentParser:
    # SUPPRESS defaults let the options appear before or after the sub-command without one
    # occurrence resetting the other.
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection and output")
    group.add_argument("--url", default=argparse.SUPPRESS,
                       help="gateway URL (default: $TRAINYARD_URL, else .trainyard/local.env)")
    group.add_argument("--token", default=argparse.SUPPRESS,
                       help="API token (default: $TRAINYARD_TOKEN, else .trainyard/local.env)")
    group.add_argument("--ca-bundle", default=argparse.SUPPRESS, metavar="PEM",
                       help="CA certificate(s) of an HTTPS gateway (default: $TRAINYARD_CA_BUNDLE, else "
                            ".trainyard/local.env; else the system's CAs)")
    group.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                       help="print JSON instead of tables")
    group.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                       help="HTTP timeout (default 30)")
    return common


def _local_missing(_: argparse.Namespace) -> int:
    raise UsageError("`trainyard local` is not available: the module trainyard_cli.local is missing from "
                     "this installation")


def _add_local(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Imported here, not at the top, so the API commands work even where the local cluster code is absent.
    try:
        local = importlib.import_module("trainyard_cli.local")
    except ModuleNotFoundError as exc:
        if exc.name != "trainyard_cli.local":
            raise
        parser = subparsers.add_parser("local", help="local development cluster (not installed)")
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(func=_local_missing)
        return
    local.add_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="trainyard", parents=[common],
        description="Command-line client of a Trainyard cluster's gateway.",
        epilog="Configuration: TRAINYARD_URL, TRAINYARD_TOKEN and TRAINYARD_CA_BUNDLE (an HTTPS gateway's CA), from "
               "flags, the environment, or .trainyard/local.env in this directory or a parent (written by `make "
               "run`), as the Python SDK (trainyard_sdk) finds them.\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    p = sub.add_parser("submit", parents=[common], help="submit a job",
                       description="Submit a job from a spec file, flags, or both.",
                       epilog=SUBMIT_EPILOG + "\n" + EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-f", "--file", help="YAML or JSON job spec ('-' reads standard input)")
    p.add_argument("--name", help=f"job name: {contract.JOB_NAME.rule}")
    p.add_argument("--nodes", type=int, help=f"nodes in the gang, 1-{contract.MAX_NODES} (default 1)")
    p.add_argument("--gpus-per-node", type=int,
                   help=f"GPUs, and workers, per node, 0-{contract.MAX_GPUS_PER_NODE} (default 1; 0: a CPU task)")
    p.add_argument("--accelerator", help="exact accelerator model; default any")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment variable for the workers (repeatable; a bare KEY copies it from here)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="label (repeatable)")
    p.add_argument("--working-dir", help="absolute working directory of the workers")
    p.add_argument("--queue", help="queue name")
    p.add_argument("--priority", type=int,
                   help=f"priority within the queue, {contract.MIN_PRIORITY}..{contract.MAX_PRIORITY}")
    p.add_argument("--max-restarts", type=int,
                   help=f"restarts allowed after a failure, 0-{contract.MAX_RESTARTS}")
    p.add_argument("--idempotency-key", help="a retried submit with the same key returns the first job")
    p.add_argument("--wait", action="store_true",
                   help="then wait until the job runs, printing where it stands in the queue (its state, how long "
                        "it has waited, why it is not placed) to stderr; exit 0 once it runs, or by how it ended "
                        "(as --follow)")
    p.add_argument("--follow", action="store_true",
                   help="then print the job's logs as they come until it ends; exit 0 if it succeeded, 3 if it "
                        "failed, 4 if it was cancelled")
    g = p.add_argument_group("accelerators and CPUs")
    g.add_argument("--accelerators", metavar="A,B,...", help="any of these models; the fastest that fits is used")
    g.add_argument("--min-memory-gb", type=int, metavar="GB", help="only GPUs with at least this much memory")
    g.add_argument("--min-cc", metavar="X.Y", help="only GPUs of at least this compute capability, e.g. 8.0")
    g.add_argument("--vendor", help="only GPUs of this vendor, e.g. nvidia or amd")
    g.add_argument("--allow-mixed", action="store_true", default=None,
                   help="let the gang span several accepted models (one model per node)")
    g.add_argument("--cpus-per-node", type=int, metavar="N", help="CPUs held on each node")
    g.add_argument("--speed-hint", action="append", default=[], metavar="MODEL=FACTOR",
                   help="this job's relative speed on a model (repeatable); overrides the scheduler's factors")
    g = p.add_argument_group("priority, topology, preemption and limits")
    g.add_argument("--priority-class", metavar="CLASS",
                   help="low, normal, high or critical (or a class the operator configured)")
    g.add_argument("--topology-tier", choices=TIERS, help="keep the gang within one node, leaf switch, spine or zone")
    g.add_argument("--topology-required", action="store_true", default=None,
                   help="wait as long as it takes for a placement within --topology-tier")
    g.add_argument("--topology-wait", type=_duration, metavar="DURATION",
                   help="wait up to this long for a placement within --topology-tier, then take the best")
    g.add_argument("--preempt-signal", type=_signal, choices=SIGNALS, metavar="SIGNAL",
                   help=f"signal sent when the job is preempted, then SIGKILL ({', '.join(SIGNALS)})")
    g.add_argument("--preempt-grace", type=_duration, metavar="DURATION",
                   help="time between the preemption signal and SIGKILL")
    g.add_argument("--restart-backoff", type=_duration, metavar="DURATION",
                   help="delay before the first restart, doubling after each (default "
                        f"{contract.DEFAULT_RESTART_BACKOFF_S:g}s)")
    g.add_argument("--time-limit", type=_duration, metavar="DURATION",
                   help="wall-clock limit of one attempt: seconds or e.g. 90m, 1h30m, 2d")
    g = p.add_argument_group("checkpoints (handed to the job's checkpoint library)")
    g.add_argument("--checkpoint-every", type=int, metavar="STEPS", help="save every this many training steps")
    g.add_argument("--checkpoint-interval", type=_duration, metavar="DURATION", help="save at least this often")
    g.add_argument("--keep-last", type=int, metavar="N", help="committed checkpoints the store keeps for the job")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after `--`")
    p.set_defaults(func=commands.cmd_submit)

    p = sub.add_parser("jobs", parents=[common], help="list jobs, newest first",
                       description="List jobs, newest first: running ones and finished ones (also those that "
                                   "have left etcd for the history store). Every filter given must match.",
                       epilog=JOBS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="page through every matching job, not only the first page")
    p.add_argument("--state", action="append", choices=STATES, help="only jobs in this state (repeatable)")
    p.add_argument("--user", help="only jobs this user submitted")
    p.add_argument("--team", help="only this team's jobs (operators; others see their own team only)")
    p.add_argument("--queue", help="only jobs of this queue")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="only jobs with this label (repeatable)")
    p.add_argument("--name", metavar="PREFIX", help="only jobs whose name starts with PREFIX")
    p.add_argument("--since", type=when, metavar="WHEN", help="submitted at or after WHEN (1d: a day ago)")
    p.add_argument("--until", type=when, metavar="WHEN", help="submitted before WHEN")
    p.add_argument("--finished-since", type=when, metavar="WHEN", help="finished at or after WHEN")
    p.add_argument("--finished-until", type=when, metavar="WHEN", help="finished before WHEN")
    p.add_argument("--page-size", type=int, default=contract.DEFAULT_PAGE_SIZE,
                   help=f"jobs per request, 1-{contract.MAX_PAGE_SIZE} (default {contract.DEFAULT_PAGE_SIZE})")
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_jobs)

    p = sub.add_parser("status", parents=[common], help="show a job",
                       description="Show a job. With --watch, print each state change as it happens (the "
                                   "gateway streams them) until the job ends; the exit code is then 0 if it "
                                   "succeeded, else 1.")
    p.add_argument("job_id")
    p.add_argument("-w", "--watch", action="store_true", help="follow the job's changes until it ends")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)  # polled once; now streamed
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_status)

    p = sub.add_parser("logs", parents=[common], help="print a job's logs, every rank",
                       description="Print the output of every worker, each line prefixed with its rank.",
                       epilog=LOGS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job_id")
    p.add_argument("--tail", type=int, default=0, metavar="N", help="last N lines of each rank (default all)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    p.add_argument("--attempt", type=int,
                   help="attempt to show (default the current one, and with --follow the later ones; 0 every attempt)")
    p.add_argument("--rank", type=int, action="append", metavar="R", help="only this rank (repeatable)")
    p.add_argument("--since", type=when, metavar="WHEN",
                   help="leave out attempts that ended before WHEN (1h: an hour ago, or a time)")
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)  # polled once; now streamed
    p.set_defaults(func=commands.cmd_logs)

    p = sub.add_parser("cancel", parents=[common], help="cancel a job")
    p.add_argument("job_id")
    p.add_argument("--reason", help="recorded in the job's events")
    p.set_defaults(func=commands.cmd_cancel)

    jobops.add_parsers(sub, common)

    checkpoints.add_parser(sub, common)

    nodes.add_parser(sub, common)

    audit.add_parser(sub, common)
    usage.add_parser(sub, common)
    pending.add_parser(sub, common)

    queues = sub.add_parser("queues", parents=[common], help="list queues, or manage them (operator)",
                            description="List the queues (the default action), or create, replace and delete them.",
                            epilog=QUEUES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    output.add_output_option(queues)
    queues.set_defaults(func=commands.cmd_queues_list)
    qsub = queues.add_subparsers(dest="queues_command", metavar="ACTION")
    p = qsub.add_parser("list", parents=[common], help="list queues (the default)")
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_queues_list)
    p = qsub.add_parser("set", parents=[common], help="create or replace a queue (operator)")
    p.add_argument("name")
    p.add_argument("--tier", type=int, default=0,
                   help=f"{contract.MIN_QUEUE_TIER}..{contract.MAX_QUEUE_TIER}: higher tiers go first and may "
                        "preempt lower (default 0)")
    p.add_argument("--max-gpus", type=int, default=0,
                   help="most GPUs the queue's jobs hold at once (default 0: no cap)")
    p.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE",
                   help="run the queue's jobs only on nodes with this label (repeatable: all of them)")
    p.add_argument("--description")
    p.set_defaults(func=commands.cmd_queues_set)
    p = qsub.add_parser("delete", parents=[common], help="delete a queue no unfinished job uses (operator)")
    p.add_argument("name")
    p.set_defaults(func=commands.cmd_queues_delete)

    quotas = sub.add_parser("quotas", parents=[common], help="show team quotas, or manage them (operator)",
                            description="List quotas (the default action; tokens other than operators see their "
                                        "own team's), show one, or create, replace and delete them.",
                            epilog=QUOTAS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    output.add_output_option(quotas)
    quotas.set_defaults(func=commands.cmd_quotas_list)
    qsub = quotas.add_subparsers(dest="quotas_command", metavar="ACTION")
    p = qsub.add_parser("list", parents=[common], help="list quotas (the default)")
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_quotas_list)
    p = qsub.add_parser("get", parents=[common], help="one team's quota")
    p.add_argument("team")
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_quotas_get)
    p = qsub.add_parser("set", parents=[common], help="create or replace a team's quota (operator)")
    p.add_argument("team")
    p.add_argument("--limit", action="append", default=[], metavar="MODEL=NOMINAL[:BORROW]",
                   help="GPUs of MODEL ('*': any model) guaranteed, and borrowable above that (repeatable)")
    p.add_argument("--weight", type=float, help="fair-share weight (default 1)")
    p.set_defaults(func=commands.cmd_quotas_set)
    p = qsub.add_parser("delete", parents=[common], help="delete a team's quota (operator)")
    p.add_argument("team")
    p.set_defaults(func=commands.cmd_quotas_delete)

    tokens = sub.add_parser("tokens", help="manage API tokens (team admin: its team's; operator: any)")
    tsub = tokens.add_subparsers(dest="tokens_command", metavar="ACTION", required=True)
    p = tsub.add_parser("create", parents=[common], help="create a token; its secret is printed once")
    p.add_argument("--team", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--role", choices=contract.ROLES, default=contract.DEFAULT_ROLE.value,
                   help="viewer, member (default), admin of the team, or operator of the cluster (only an "
                        "operator grants it; a team admin grants up to admin)")
    p.add_argument("--ttl", help=f"lifetime, {contract.TTL.rule}; default the gateway's "
                                 f"({contract.DEFAULT_TOKEN_TTL} unless configured)")
    p.add_argument("--scope", action="append", choices=contract.SCOPES, default=None,
                   help="only this kind of action (repeatable); default everything the role allows")
    p.add_argument("--description", help="what the token is for")
    p.set_defaults(func=commands.cmd_tokens_create)
    p = tsub.add_parser("list", parents=[common], help="list tokens (never their secrets)")
    p.add_argument("--team", help="only this team's tokens (a team admin sees only its own)")
    output.add_output_option(p)
    p.set_defaults(func=commands.cmd_tokens_list)
    p = tsub.add_parser("revoke", parents=[common], help="revoke a token by its id")
    p.add_argument("token_id")
    p.set_defaults(func=commands.cmd_tokens_revoke)

    _add_local(sub)
    completion.add_parser(sub, parser)  # last: the script it prints covers every command above
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(func(args) or 0)
    except CliError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`trainyard logs ... | head`): not an error. Point stdout at /dev/null so
        # the interpreter's final flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
