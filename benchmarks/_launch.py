"""Launch a benchmark's own worker in N gloo processes with torch's launcher (127.0.0.1 only)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script *args`` with the repository importable; stdout and stderr captured."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", os.path.abspath(script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def relay(script: str, nproc: int, *args: str) -> None:
    """``torchrun`` a worker that prints its own tables: print them, and on failure the end of its stderr (and
    exit with its status)."""
    out = torchrun(script, nproc, *args)
    print(out.stdout)
    if out.returncode:
        print(out.stderr[-3000:])
        sys.exit(out.returncode)
