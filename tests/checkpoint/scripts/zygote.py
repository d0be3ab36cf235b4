"""Fork server for the client tests: imports torch, DCP and the client library once, then forks a fresh
process for every worker a test starts. Importing torch costs seconds of CPU per process; a test suite
that starts dozens of gloo workers (the crash-safety test starts over a hundred) would spend most of its
time there. The forked workers are ordinary processes running ordinary scripts: each gets its own
environment, argv and log file, forms its own gloo group, talks to the real checkpoint-store.

    python zygote.py SOCKET_PATH      prints "ready" once it listens

Protocol, one Unix-socket connection per worker: the test sends one JSON line {"argv": [script, args...],
"env": {...}, "log": path, "user": [uid, gid] (optional: run as that identity)}; the zygote answers
{"pid": N} at once and {"exit": code} or {"signal": n} when
the worker ends, then closes the connection. Only the zygote forks; it never runs torch code itself.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback

# What every worker needs, imported once here and shared with every worker by fork. torch._dynamo is
# imported by DTensor on first use, a second of CPU per process otherwise.
import client_state  # noqa: F401
import s3fs  # noqa: F401 - fsspec imports it for the first s3:// location
import torch
import torch._dynamo
import torch.distributed.checkpoint
import torch.distributed.tensor  # noqa: F401

import trainyard_checkpoint.client  # noqa: F401


def run_child(request: dict[str, object], sel: selectors.BaseSelector, conn: socket.socket) -> None:
    code = 1
    try:
        # Nothing of the zygote's: its listener, other workers' connections and pidfds.
        for key in list(sel.get_map().values()):
            owned = key.data[1]
            if owned is not None:
                owned[1].close()
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
            else:
                os.close(key.fd)
        conn.close()
        fd = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # A test that gives up on a worker first asks it for every thread's stack (into its log).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        user = request.get("user")
        if user is not None:
            # A worker of a team's Unix identity, as the node agent runs one with run_as: no groups but the
            # team's, umask 077 (tests/checkpoint/test_job_credentials.py, teams apart on the storage).
            uid, gid = (int(v) for v in user)  # type: ignore[attr-defined]
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o077)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        sys.argv = argv
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("accept", None))
    buffers: dict[socket.socket, bytes] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            kind, data = key.data
            if kind == "accept":
                conn, _ = listener.accept()
                buffers[conn] = b""
                sel.register(conn, selectors.EVENT_READ, ("request", None))
            elif kind == "request":
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                chunk = conn.recv(1 << 16)
                if not chunk:
                    sel.unregister(conn)
                    buffers.pop(conn, None)
                    conn.close()
                    continue
                buffers[conn] += chunk
                if b"\n" not in buffers[conn]:
                    continue
                line = buffers.pop(conn).split(b"\n", 1)[0]
                sel.unregister(conn)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run_child(request, sel, conn)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                pidfd = os.pidfd_open(pid)
                sel.register(pidfd, selectors.EVENT_READ, ("exit", (pid, conn)))
            else:
                pid, conn = data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                answer = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
                    {"exit": os.waitstatus_to_exitcode(status)}
                try:
                    conn.sendall(json.dumps(answer).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    main(sys.argv[1])
