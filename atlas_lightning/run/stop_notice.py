"""A clean stop on one rank reaches every rank: a notice in the process group's store.

Why: under FSDP2 a fault on one rank (out of memory, a non-finite step, the engine dying, a
write refused) ends that rank's step while the other ranks wait in a collective for it: gloo
waits for the group's timeout (30 minutes), or for ever where none is set.

Contract (``run/faults.py`` calls it; a no-op at world 1):

* ``publish(stop)``: the rank whose fault became ``RunStopped`` writes the notice (its rank,
  the cause, the message) into the process group's rendezvous store (the first notice of a
  launch wins). A rank other than 0 then ends: its process's end closes its connections, which
  wakes the other ranks' pending gloo collectives with an error. Rank 0 hosts the store: it
  waits up to ``LINGER_S`` for every other rank to have heard the notice before it returns.
* ``received()``: on a rank whose step failed with whatever its collective raised, the notice
  of the rank that stopped, if one was published (waited for up to ``NOTICE_WAIT_S``), marked as
  heard; ``run/faults.py`` then stops this rank with the same cause (the same exit code),
  naming the rank that stopped and why.
* ``watching()`` (around ``trainer.fit``, every rank): a thread that polls the store every
  ``POLL_S`` once the group exists. A rank still blocked ``GRACE_S`` after another rank's notice
  (its collective not woken: rank 0 stopped and lingers, or NCCL, whose collectives a peer's
  end does not wake) prints the stop line itself, marks the notice heard and ends its process
  with the same exit code (``os._exit``: its own checkpoint write in flight, if any, is left
  without a marker; the last complete checkpoint stands).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from lightning import Callback, Trainer

from atlas_lightning import distributed as dist_utils
from atlas_lightning.errors import RunStopped

log = logging.getLogger("atlas_lightning")

NOTICE = "atlas_lightning/stop"
HEARD = "atlas_lightning/stop_heard"
#: How long rank 0, having stopped, keeps the store up for the other ranks to read the notice.
LINGER_S = 60.0
#: How long a rank whose collective failed looks for the notice of the rank that stopped.
NOTICE_WAIT_S = 5.0
#: How often the watcher reads the store, and how long it leaves a woken rank to stop itself.
POLL_S = 1.0
GRACE_S = 15.0
#: Set once this rank's main thread handles a fault (the watcher then leaves the stop to it).
_handling = threading.Event()
_clients = threading.local()


def _store():
    """A client of the process group's rendezvous store (``MASTER_ADDR:MASTER_PORT``) of this
    thread's own (a store client is not shared between threads: the watcher has its own), or
    None outside a multi-rank group or where it cannot be reached (logged: the other ranks then
    wait for their collectives' timeout)."""
    if not dist_utils.is_distributed() or dist_utils.world_size() == 1:
        return None
    client = getattr(_clients, "store", None)
    if client is None:
        from datetime import timedelta

        import torch.distributed as dist

        try:
            client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=30), wait_for_workers=False)
        except Exception as err:  # no rendezvous store to reach: no notice, never a crash of the thread
            log.warning("stops reach no other rank: the process group's store (MASTER_ADDR:MASTER_PORT) cannot "
                        "be reached: %s: %s", type(err).__name__, err)
            return None
        _clients.store = client
    return client


def publish(stop: RunStopped) -> None:
    """This rank stopped (module doc): the notice, then the end of its process group."""
    _handling.set()
    store = _store()
    if store is None:
        return
    world, rank = dist_utils.world_size(), dist_utils.rank()
    notice = json.dumps({"rank": rank, "cause": stop.cause, "message": str(stop)})
    try:
        store.compare_set(NOTICE, "", notice)  # the first stop of the launch is the one named
    except Exception as err:  # the store is gone with rank 0: the others hear of it there
        log.warning("could not tell the other ranks of this stop: %s", err)
    if rank != 0:
        _heard(store)
        return
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline and _count(store) < world - 1:
        time.sleep(0.1)


def received() -> Optional[dict]:
    """The notice of the rank that stopped (``rank``, ``cause``, ``message``), marked as heard,
    and this rank's process group ended; None without one (module doc)."""
    _handling.set()
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + NOTICE_WAIT_S
    notice = None
    while notice is None and time.monotonic() < deadline:
        try:
            if store.check([NOTICE]):
                notice = json.loads(store.get(NOTICE))
        except Exception:  # the store is gone (rank 0 ended): no notice can come
            break
        time.sleep(0.1)
    if notice is None or notice["rank"] == dist_utils.rank():
        return None
    _heard(store)
    return notice


class _HandlingFault(Callback):
    """First of ``trainer``'s callbacks: from Lightning's first hook on an exception on, this rank
    stops through its main thread (its step checkpoint's write in flight is waited for there)."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        _handling.set()


@contextmanager
def watching(trainer: Optional[Trainer] = None) -> Iterator[None]:
    """Watch for another rank's stop while the body (``trainer.fit``) runs (module doc)."""
    _handling.clear()
    if trainer is not None:
        trainer.callbacks.insert(0, _HandlingFault())
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(done,), name="stop-notice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def _watch(done: threading.Event) -> None:
    while not done.wait(POLL_S):
        if not dist_utils.is_distributed():
            continue  # the group is made inside fit
        store = _store()
        if store is None:
            return
        try:
            if not store.check([NOTICE]):
                continue
            notice = json.loads(store.get(NOTICE))
        except Exception:  # the store is gone: rank 0 ended, its collectives woke the others
            return
        if notice["rank"] == dist_utils.rank() or _handling.wait(GRACE_S) or done.is_set():
            return
        message = f"rank {notice['rank']} stopped, so this rank {dist_utils.rank()} did: {notice['message']}"
        log.error("stopped: %s", message)
        print(f"atlas-lightning fit: stopped: {message}", file=sys.stderr, flush=True)
        _heard(store)
        logging.shutdown()  # flushes main_ppo.log
        os._exit(RunStopped(message, cause=notice["cause"]).exit_code)


def _heard(store) -> None:
    try:
        store.add(HEARD, 1)
    except Exception:
        pass  # rank 0 ended meanwhile: nobody waits for us


def _count(store) -> int:
    try:
        return int(store.add(HEARD, 0))
    except Exception:
        return 1 << 30  # the store itself failed: nobody can read the notice any more
