#!/usr/bin/env python3
"""Runs a SecantusDB server for tally's tests, demo and benchmarks.

Prints ``listening <port>`` once the server accepts connections, then runs
until it receives SIGTERM/SIGINT or, with --watch-stdin, until its standard
input closes (the parent exited, however it exited: how the tests make sure
no server outlives them). A data directory it created itself is removed at
exit; one given with --storage-path is kept, so a test can restart a server
on the same data.
"""

import argparse
import shutil
import signal
import sys
import tempfile
import threading

from pymongo import MongoClient
from secantus import commands, rbac
from secantus.server import SecantusDBServer


def role_privileges(roles, resolve):
    """The privileges ``roles`` grant, as mongod lists them: each built-in
    role's actions on its database (every database for the *AnyDatabase
    ones), each custom role's own privileges, inherited roles included."""
    privileges, pending, seen = [], [(r.get("role"), r.get("db")) for r in roles], set()
    while pending:
        name, db = pending.pop()
        if (name, db) in seen or not isinstance(name, str) or not isinstance(db, str):
            continue
        seen.add((name, db))
        spec = rbac.BUILT_IN_ROLES.get(name)
        if spec is not None:
            resource = {"db": "" if spec.any_db else db, "collection": ""}
            privileges.append({"resource": resource, "actions": sorted(spec.actions)})
            continue
        record = resolve(db, name) or {}
        privileges.extend(record.get("privileges") or [])
        pending.extend((r.get("role"), r.get("db")) for r in record.get("roles") or [])
    return privileges


def connection_status(doc, ctx):
    """SecantusDB 0.7.0b3 leaves connectionStatus's authenticatedUserPrivileges
    empty whatever ``showPrivileges`` says; mongod lists them, and `tallyd
    doctor` reads them. Filled in from the roles the server itself enforces."""
    reply = original_connection_status(doc, ctx)
    if doc.get("showPrivileges") and ctx.connection_auth is not None:
        reply["authInfo"]["authenticatedUserPrivileges"] = role_privileges(
            ctx.connection_auth.effective_roles, ctx.storage.get_role)
    return reply


original_connection_status = commands._HANDLERS["connectionStatus"]
commands._HANDLERS["connectionStatus"] = connection_status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--storage-path", help="data directory to keep (default: a temporary one)")
    parser.add_argument("--idle-timeout", type=float, default=300.0,
                        help="seconds after which idle client connections are closed")
    parser.add_argument("--oplog-max-entries", type=int, default=100_000,
                        help="the oplog keeps at most this many entries")
    parser.add_argument("--oplog-retention-seconds", type=float, default=3600.0,
                        help="the oplog drops entries older than this (pruned as writes come)")
    parser.add_argument("--noop-heartbeat-seconds", type=float, default=0.0)
    parser.add_argument("--auth", action="store_true", help="require SCRAM authentication")
    parser.add_argument("--standalone", action="store_true",
                        help="advertise a standalone server instead of a one-node replica set")
    parser.add_argument("--watch-stdin", action="store_true",
                        help="stop when standard input reaches end of file")
    args = parser.parse_args()

    temporary = None
    storage = args.storage_path
    if storage is None:
        temporary = tempfile.mkdtemp(prefix="tally-secantus-")
        storage = temporary

    server = SecantusDBServer(
        host="127.0.0.1",
        port=args.port,
        storage_path=storage,
        replica_set_name=None if args.standalone else "secantus",
        require_auth=args.auth,
        enable_test_commands=True,
        client_idle_timeout_s=args.idle_timeout,
        oplog_max_entries=args.oplog_max_entries,
        oplog_retention_seconds=args.oplog_retention_seconds,
        noop_heartbeat_seconds=args.noop_heartbeat_seconds,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def watch_parent() -> None:
        # read() returns at end of file: the parent closed the pipe or died.
        sys.stdin.read()
        stop.set()

    server.start()
    # Ready means it answers `hello`, not merely that the port is open.
    with MongoClient("127.0.0.1", server.port, directConnection=True,
                     serverSelectionTimeoutMS=30_000) as client:
        client.admin.command("hello")
    print(f"listening {server.port}", flush=True)
    if args.watch_stdin:
        threading.Thread(target=watch_parent, daemon=True).start()
    stop.wait()
    try:
        server.stop()
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
