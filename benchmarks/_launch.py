"""Launch a benchmark's own worker in N gloo processes with torch's launcher (127.0.0.1 only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PORT_TRIES = 3  # launches on a fresh port when another process took the one picked


def torchrun(script: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script *args`` with the repository importable; stdout and stderr captured.
    The port is picked free and released before torchrun binds it, so another launch on the machine can take it
    first (EADDRINUSE as the store starts, before the worker runs anything): then it is launched again on another."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for _ in range(PORT_TRIES):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={port}", os.path.abspath(script), *args]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if not (out.returncode and ("EADDRINUSE" in out.stderr or "address already in use" in out.stderr.lower())):
            break
    return out


def relay(script: str, nproc: int, *args: str) -> None:
    """``torchrun`` a worker that prints its own tables: print them, and on failure the end of its stderr (and
    exit with its status)."""
    out = torchrun(script, nproc, *args)
    print(out.stdout)
    if out.returncode:
        print(out.stderr[-3000:])
        sys.exit(out.returncode)
