"""Offline token administration, straight against the gateway's etcd: how a production cluster gets its
first operator token (the bootstrap_admin_token setting is for the local cluster only), and how an
operator who lost every token gets back in.

    python -m trainyard_gateway.tokens_admin create --team ops --user alice --role operator --ttl 30d \\
        --config /etc/trainyard/gateway.yaml
    python -m trainyard_gateway.tokens_admin list [--team ops] --config ...
    python -m trainyard_gateway.tokens_admin revoke tok-... --config ...

Everything after the command's own flags is the gateway's settings (`--config`, `--etcd-endpoints`, the
TRAINYARD_GATEWAY_* environment), read exactly as the gateway reads them, so the token lands where the
gateway looks. `create` prints the secret once, on stdout, and nothing else there; the rest goes to stderr.
Whoever can run this can read the gateway's settings and reach its etcd, which is already everything.
Exit codes: 0 done, 1 refused or failed (the message says why), 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from trainyard_core import contract
from trainyard_core.errors import TrainyardError
from trainyard_core.settings import SettingsError, load_settings
from trainyard_core.store.etcd import EtcdStore

from . import roles
from .settings import GatewaySettings
from .tokens import TokenRecord, TokenStore, format_time

PROG = "python -m trainyard_gateway.tokens_admin"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Create, list and revoke gateway tokens offline.",
                                     allow_abbrev=False,
                                     epilog="Flags after the command's own are the gateway's settings "
                                            "(--config FILE, --etcd-endpoints ..., --etcd-prefix ...).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("create", help="create a token and print its secret once", allow_abbrev=False)
    p.add_argument("--team", required=True, help=f"team the token acts for: {contract.TEAM.rule}")
    p.add_argument("--user", required=True, help=f"user the token acts for: {contract.USER.rule}")
    p.add_argument("--role", default=contract.DEFAULT_ROLE.value, choices=contract.ROLES,
                   help=f"default {contract.DEFAULT_ROLE.value}")
    p.add_argument("--ttl", help=f"lifetime, {contract.TTL.rule}; default the gateway's token_default_ttl_s")
    p.add_argument("--scope", action="append", default=[], choices=contract.SCOPES,
                   help="only this kind of action (repeatable); default everything the role allows")
    p.add_argument("--description", default="", help="what the token is for")
    p = sub.add_parser("list", help="list tokens (never their secrets)", allow_abbrev=False)
    p.add_argument("--team", default="", help="only this team's")
    p = sub.add_parser("revoke", help="revoke a token by its id", allow_abbrev=False)
    p.add_argument("token_id")
    return parser


def _describe(r: TokenRecord) -> str:
    expires = "never" + (" (legacy)" if r.legacy else "") if r.expires_at is None else format_time(r.expires_at)
    scopes = ",".join(s.value for s in r.scopes) or "-"
    return f"{r.token_id}\t{r.team}\t{r.user}\t{r.role.value}\texpires {expires}\tscopes {scopes}\t{r.description}"


async def _run(args: argparse.Namespace, settings: GatewaySettings) -> int:
    store = EtcdStore.from_options(settings.etcd_options())  # TLS and the etcd credential, as the gateway
    try:
        tokens = TokenStore(store, settings.etcd_prefix, cache_ttl_s=0, default_ttl_s=settings.token_default_ttl_s,
                            max_ttl_s=settings.token_max_ttl_s)
        if args.command == "create":
            record, secret = await tokens.create(
                team=args.team, user=args.user, role=roles.parse_role(args.role), ttl=args.ttl,
                scopes=roles.parse_scopes(args.scope), description=args.description)
            print(f"created {_describe(record)}", file=sys.stderr)
            print("The secret below is shown only now; store it (TRAINYARD_TOKEN, or Authorization: Bearer).",
                  file=sys.stderr)
            print(secret, flush=True)
        elif args.command == "list":
            for record in await tokens.list(args.team or None):
                print(_describe(record))
        else:
            record = await tokens.revoke(args.token_id)
            print(f"revoked {_describe(record)}", file=sys.stderr)
        return 0
    finally:
        await store.close()


def main(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> int:
    args, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else list(argv))
    try:
        settings = load_settings(GatewaySettings, prog=PROG, argv=rest, env=dict(os.environ) if env is None else env)
    except SettingsError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, settings))
    except (TrainyardError, OSError) as exc:
        print(f"error: {exc.message if isinstance(exc, TrainyardError) else exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
