"""The methods of both clients: each operation of the API once, bound by binding.py to the client it is read
from (a result for `Client`, a coroutine for `AsyncClient`; a listing an iterator or an async iterator; a stream
an `EventStream` or an `AsyncEventStream`). The builders (operations.py, streams.py) hold the arguments and the
docstrings."""

from __future__ import annotations

from . import operations as ops
from . import streams
from .binding import Listing, Operation, Streaming


class Operations:
    """The base of `Client` and `AsyncClient`: every method of the API, by resource."""

    # health
    health = Operation(ops.health)
    # jobs
    submit_job = Operation(ops.submit_job)
    get_job = Operation(ops.get_job)
    list_jobs = Listing(ops.list_jobs)
    list_jobs_page = Operation(ops.list_jobs_page)
    cancel_job = Operation(ops.cancel_job)
    hold_job = Operation(ops.hold_job)
    release_job = Operation(ops.release_job)
    requeue_job = Operation(ops.requeue_job)
    set_job_priority = Operation(ops.set_job_priority)
    resubmit_job = Operation(ops.resubmit_job)
    job_logs = Operation(ops.job_logs)
    job_events = Operation(ops.job_events)
    # streams
    follow_logs = Streaming(streams.follow_logs)
    watch_job = Streaming(streams.watch_job)
    watch_jobs = Streaming(streams.watch_jobs)
    # checkpoints
    list_checkpoints = Listing(ops.list_checkpoints)
    list_checkpoints_page = Operation(ops.list_checkpoints_page)
    get_checkpoint = Operation(ops.get_checkpoint)
    checkpoint_manifest = Operation(ops.checkpoint_manifest)
    tag_checkpoint = Operation(ops.tag_checkpoint)
    untag_checkpoint = Operation(ops.untag_checkpoint)
    delete_checkpoint = Operation(ops.delete_checkpoint)
    # nodes
    list_nodes = Operation(ops.list_nodes)
    get_node = Operation(ops.get_node)
    cordon_node = Operation(ops.cordon_node)
    uncordon_node = Operation(ops.uncordon_node)
    set_gpu_health = Operation(ops.set_gpu_health)
    # queues and quotas
    list_pending = Operation(ops.list_pending)
    list_queues = Operation(ops.list_queues)
    put_queue = Operation(ops.put_queue)
    delete_queue = Operation(ops.delete_queue)
    list_quotas = Operation(ops.list_quotas)
    get_quota = Operation(ops.get_quota)
    put_quota = Operation(ops.put_quota)
    delete_quota = Operation(ops.delete_quota)
    # tokens
    create_token = Operation(ops.create_token)
    list_tokens = Operation(ops.list_tokens)
    revoke_token = Operation(ops.revoke_token)
    # audit and usage
    audit = Listing(ops.audit)
    audit_page = Operation(ops.audit_page)
    usage = Operation(ops.usage)
