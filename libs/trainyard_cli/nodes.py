"""`trainyard nodes`: list the nodes (the default action), show one with its GPUs, and the operator's actions on
them: cordon (no new placement; what runs there stays), uncordon, and a GPU's health set by hand (out of
service, or back after a repair). Each maps to one route of /v1/nodes; the gateway checks the operator role."""

from __future__ import annotations

import argparse
from typing import Any

from . import output
from .api import dump
from .commands import api_for

EPILOG = """\
examples:
  trainyard nodes                                   every node, its state and free GPUs
  trainyard nodes -o wide                           with unhealthy GPUs, CPUs, memory, labels, heartbeat
  trainyard nodes get gpu-01                        one node and each of its GPUs
  trainyard nodes cordon gpu-01 --reason "replacing a fan"
  trainyard nodes uncordon gpu-01
  trainyard nodes set-health gpu-01 3 --unhealthy --reason "xid 79 seen by hand"
  trainyard nodes set-health gpu-01 3 --healthy --reason "replaced"

Cordoning, uncordoning and setting a GPU's health need an operator token.
"""


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    nodes = sub.add_parser("nodes", parents=[common], help="list nodes and their free GPUs; cordon, uncordon, "
                                                          "set a GPU's health (operator)",
                           description="List the nodes (the default action), show one, or act on one.",
                           epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    output.add_output_option(nodes)
    nodes.set_defaults(func=cmd_nodes_list)
    nsub = nodes.add_subparsers(dest="nodes_command", metavar="ACTION")
    p = nsub.add_parser("list", parents=[common], help="list nodes (the default)")
    output.add_output_option(p)
    p.set_defaults(func=cmd_nodes_list)
    p = nsub.add_parser("get", parents=[common], help="one node, with its GPUs")
    p.add_argument("node_id", metavar="NODE")
    output.add_output_option(p)
    p.set_defaults(func=cmd_nodes_get)
    p = nsub.add_parser("cordon", parents=[common], help="no new placement on the node (operator)")
    p.add_argument("node_id", metavar="NODE")
    p.add_argument("--reason", help="shown on the node (default: cordoned by <you>)")
    p.set_defaults(func=cmd_nodes_cordon)
    p = nsub.add_parser("uncordon", parents=[common], help="let the scheduler place on the node again (operator)")
    p.add_argument("node_id", metavar="NODE")
    p.set_defaults(func=cmd_nodes_uncordon)
    p = nsub.add_parser("set-health", parents=[common], help="take a GPU out of service, or put it back (operator)")
    p.add_argument("node_id", metavar="NODE")
    p.add_argument("gpu_index", metavar="GPU", type=int, help="the GPU's index on the node")
    health = p.add_mutually_exclusive_group(required=True)
    health.add_argument("--healthy", dest="healthy", action="store_true", default=None, help="back in service")
    health.add_argument("--unhealthy", dest="healthy", action="store_false", help="out of service")
    p.add_argument("--reason", required=True, help="why; written to the node's audit log")
    p.set_defaults(func=cmd_nodes_set_health)


def cmd_nodes_list(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        nodes = [dump(n) for n in api.list_nodes()]
    if not nodes and not output.machine(args):
        print("no nodes registered")
        return 0
    output.emit(args, {"nodes": nodes}, lambda wide: output.nodes_table(nodes, wide=wide))
    return 0


def cmd_nodes_get(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        node = dump(api.get_node(args.node_id))
    output.emit(args, node, lambda _: output.node_details(node))
    return 0


def _report(args: argparse.Namespace, node: dict[str, Any], text: str) -> int:
    if getattr(args, "json", False):
        output.print_json(node)
    else:
        print(text)
    return 0


def cmd_nodes_cordon(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        node = dump(api.cordon_node(args.node_id, reason=args.reason or ""))
    return _report(args, node, f"node {node['node_id']} cordoned ({node['cordon_reason'] or 'no reason'}): no new "
                               "placement; what runs there goes on")


def cmd_nodes_uncordon(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        node = dump(api.uncordon_node(args.node_id))
    return _report(args, node, f"node {node['node_id']} uncordoned: {node['state']}")


def cmd_nodes_set_health(args: argparse.Namespace) -> int:
    with api_for(args) as api:
        node = dump(api.set_gpu_health(args.node_id, args.gpu_index, healthy=args.healthy, reason=args.reason))
    # The agent applies it and reports it with its next heartbeat: the answer may still show the GPU as it was.
    said = "healthy" if args.healthy else "unhealthy"
    return _report(args, node, f"node {node['node_id']} GPU {args.gpu_index} set {said} ({args.reason}); the node "
                               "reports it with its next heartbeat (`trainyard nodes get` shows it)")
