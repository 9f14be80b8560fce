"""The serving side's memory in the separate layout, read from outside the server.

The vLLM server runs in processes (and on cards) of its own, so the trainer's allocator says
nothing about it. ``ServingMemory`` reads it the way an operator would, around a window of work
(``window``: generation, the receive of a weight sync):

* CPU (the server's process tree: the API server and its engine-core children, found with
  ``psutil`` from the pid training rank 0 started): each process's peak resident set
  (``VmHWM``), reset through ``/proc/<pid>/clear_refs`` when the window opens, summed over the
  processes when it closes: an upper bound of their simultaneous peak, exact for each process;
  plus the resident sets sampled every ``interval_s`` (their largest sum: a lower bound);
* GPU (the serving cards): the used memory of each card, from NVML (``pynvml``, or the copy vLLM
  ships), sampled every ``interval_s`` in a thread (the window's peak is the largest sample, so a
  spike shorter than the interval can be missed) and read once more when the window closes.
  NVML needs no CUDA context, so reading adds nothing to the cards it reads. Cards are named as
  ``CUDA_VISIBLE_DEVICES`` names them (``rollout/separate.py``): an index is taken as NVML's
  (PCI bus order, which is CUDA's too on a node of identical cards or with
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), a UUID as itself.

Where neither is available (an attached server, ``rollout.server_url``, on CPU; no NVML on a GPU
machine) the window records ``measured: False`` and why; nothing is estimated in its place.

Who calls it: ``run/memory_check_separate.py`` on training rank 0.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

GIB = 2**30


def status_kib(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``, ...) of ``/proc/<pid>/status`` in KiB; 0 where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak(pid: int) -> bool:
    """Reset ``pid``'s VmHWM (Linux; the same user may do it); False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _nvml():
    """The NVML module (``pynvml``, else vLLM's copy), initialised; None when there is none."""
    for name in ("pynvml", "vllm.third_party.pynvml"):
        try:
            module = __import__(name, fromlist=["nvmlInit"])
            module.nvmlInit()
            return module
        except Exception:  # not installed, or no driver: try the next, then give up
            continue
    return None


class ServingMemory:
    """Memory of the server with process id ``pid`` (CPU) or of the serving ``cards`` (GPU:
    ``CUDA_VISIBLE_DEVICES`` entries, indexes or UUIDs); see the module doc. ``records`` holds
    one dict a window."""

    def __init__(self, *, pid: Optional[int] = None, cards: Optional[list[str]] = None,
                 interval_s: float = 0.05) -> None:
        self.pid, self.cards, self.interval_s = pid, list(cards) if cards else None, interval_s
        self.records: list[dict] = []
        self._nvml = _nvml() if self.cards else None
        self._handles = self._card_handles() if self._nvml is not None else None

    @property
    def measures(self) -> str:
        if self._handles:
            return (f"serving cards {','.join(self.cards)}: NVML used memory, sampled every "
                    f"{self.interval_s * 1000:.0f} ms (peak = largest sample)")
        if self.pid is not None:
            return ("server process tree (API server + engine core): summed peak resident sets (VmHWM, reset "
                    "at each window; an upper bound of their simultaneous peak) and sampled resident sets")
        return "not measured: " + self.why_not()

    def why_not(self) -> str:
        if self.cards and self._nvml is None:
            return "no NVML (pynvml) on this machine to read the serving cards"
        if self.cards and not self._handles:
            return f"NVML does not know the serving cards {self.cards}"
        return "the server was not started by this trainer (rollout.server_url) and runs on no card it can read"

    # -- reading --------------------------------------------------------------------------

    def _card_handles(self) -> list:
        handles = []
        for card in self.cards or []:
            try:
                if card.isdigit():
                    handles.append(self._nvml.nvmlDeviceGetHandleByIndex(int(card)))
                else:
                    handles.append(self._nvml.nvmlDeviceGetHandleByUUID(card))
            except Exception:  # an unknown index or UUID: the card cannot be read
                return []
        return handles

    def _cards_used(self) -> list[int]:
        return [int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles]

    def _processes(self) -> list[int]:
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [root.pid] + [child.pid for child in root.children(recursive=True)]
        except psutil.Error:
            return []

    def _tree_rss(self) -> int:
        return sum(status_kib(pid, "VmRSS") for pid in self._processes()) * 1024

    # -- windows --------------------------------------------------------------------------

    @contextmanager
    def window(self, phase: str, step: int):
        """Measure the serving side while the block runs; appends a record to ``records``:
        ``phase``, ``step``, ``seconds``, ``measured``, and when measured ``start_gib``,
        ``peak_gib``, ``end_gib`` (GPU: the largest card's; ``cards_gib`` per card) or on CPU
        ``peak_gib`` (summed VmHWM), ``sampled_peak_gib``, ``processes``."""
        record: dict = {"phase": phase, "step": step, "measured": bool(self._handles) or self.pid is not None}
        if not record["measured"]:
            record["why"] = self.why_not()
        started = time.monotonic()
        read: Optional[Callable[[], list[int]]] = None
        if self._handles:
            read = self._cards_used
        elif self.pid is not None:
            record["peak_reset"] = all([_reset_peak(pid) for pid in self._processes()])
            read = lambda: [self._tree_rss()]  # noqa: E731
        samples: list[list[int]] = []
        stop = threading.Event()
        sampler = None
        if read is not None:
            samples.append(read())

            def sample() -> None:
                while not stop.wait(self.interval_s):
                    samples.append(read())

            sampler = threading.Thread(target=sample, name="serving-memory", daemon=True)
            sampler.start()
        try:
            yield record
        finally:
            stop.set()
            if sampler is not None:
                sampler.join()
                samples.append(read())
                record.update(self._summary(samples))
            record["seconds"] = time.monotonic() - started
            self.records.append(record)

    def _summary(self, samples: list[list[int]]) -> dict:
        if self._handles:
            per_card = [max(s[i] for s in samples) / GIB for i in range(len(self._handles))]
            return {"start_gib": max(samples[0]) / GIB, "end_gib": max(samples[-1]) / GIB, "peak_gib": max(per_card),
                    "cards_gib": dict(zip(self.cards, per_card)), "samples": len(samples)}
        processes = self._processes()
        return {"start_gib": samples[0][0] / GIB, "end_gib": samples[-1][0] / GIB,
                "peak_gib": sum(status_kib(pid, "VmHWM") for pid in processes) * 1024 / GIB,
                "sampled_peak_gib": max(s[0] for s in samples) / GIB, "processes": len(processes),
                "samples": len(samples)}


def serving_cards_of(cfg) -> Optional[list[str]]:
    """The serving cards' ``CUDA_VISIBLE_DEVICES`` entries (None on CPU)."""
    from atlas_lightning.rollout.separate import serving_cards

    cards = serving_cards(cfg)
    return cards.split(",") if cards else None


def server_pid(engine) -> Optional[int]:
    """The pid of the server ``engine`` owns (None when it attached to one, or has none)."""
    server = getattr(engine, "server", None)
    process = getattr(server, "process", None)
    return int(process.pid) if process is not None else None

