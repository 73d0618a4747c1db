"""Code that runs in the child processes of test_holds.py (kept apart from
the test module so children import only this and vmmipc)."""

import os

import vmmipc


def holding_child(ticket: bytes, results, commands) -> None:
    """Import `ticket` holding its use, read it, say so, then do what the
    parent says: "release" (then say so), "release-other <hex>" (try to let
    go of a ticket this process never held), "exit", or nothing at all
    (wait to be killed)."""
    try:
        m = vmmipc.import_stream(ticket, hold=True)
        first = bytes(m.view[:4])
        results.put(("held", os.getpid(), first, vmmipc.cache_info().holds))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        results.put(("error", repr(e)))
        return
    while True:
        cmd = commands.get()
        if cmd == "release":
            vmmipc.release(ticket)
            results.put(("released", vmmipc.cache_info().holds))
        elif isinstance(cmd, tuple) and cmd[0] == "release-other":
            try:
                vmmipc.release(cmd[1])
                results.put(("release-other", "accepted"))
            except vmmipc.NotFoundError as e:
                results.put(("release-other", e.message))
        elif cmd == "exit":
            return
