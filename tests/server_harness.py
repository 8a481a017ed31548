"""Run a real `tokenmill serve` subprocess on 127.0.0.1 and talk to it with plain HTTP."""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# TOKENMILL_CACHE_DIR of every server this test run starts: apart from the user's cache (a server may
# measure the CPU while idle), but one for the whole run, since its other entries cost every server
# with an empty cache its start-up (a GGUF's tokenizer converted by transformers: ~13 s of a default-
# model server's ~18 s on a 2-core AMD EPYC, ~5 s with the entry cached)
SERVER_CACHE_DIR = Path(tempfile.mkdtemp(prefix="tokenmill-test-cache-"))
atexit.register(shutil.rmtree, SERVER_CACHE_DIR, ignore_errors=True)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll predicate() until it holds or timeout seconds pass; returns its last value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc, in pid order."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return sorted(children)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def request(self, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
                timeout: float = 120) -> HttpResult:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        all_headers = {"Content-Type": "application/json"}
        if self.api_key:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        all_headers.update(headers or {})
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        try:
            conn.request(method, path, body=data, headers=all_headers)
            response = conn.getresponse()
            return HttpResult(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            conn.close()

    def post(self, path: str, body, **kwargs) -> HttpResult:
        return self.request("POST", path, body, **kwargs)

    def open_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Start a streamed request; read events with read_event(response)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(), headers=headers)
        return conn, conn.getresponse()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the /metrics samples called `name` whose labels include `labels`."""
        text = self.request("GET", "/metrics").body.decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        return wait_until(predicate, timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def read_event(response: http.client.HTTPResponse) -> dict | str | None:
    """The next server-sent event's data (parsed JSON, or '[DONE]'); None at the end of the stream."""
    while True:
        line = response.readline()
        if not line:
            return None
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].decode()
            return data if data == "[DONE]" else json.loads(data)


def start_server(args: list[str], log_dir: Path, api_key: str | None = None, timeout: float = 240,
                 prelude: str | None = None, env: dict[str, str] | None = None) -> ServerProcess:
    """Start `tokenmill serve ARGS` on a free port and wait until /health answers.

    prelude: Python run in the server process before it starts (to inject a fault).
    env: variables set for the server on top of this process's.
    """
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cli_args = ["serve", "--port", str(port), *args] + (["--api-key", api_key] if api_key else [])
    if prelude is None:
        command = [sys.executable, "-m", "tokenmill.cli", *cli_args]
    else:
        command = [sys.executable, "-c", f"{prelude}\nimport sys\nfrom tokenmill.cli import main\n"
                   f"sys.exit(main({cli_args!r}))"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TOKENMILL_CACHE_DIR": str(SERVER_CACHE_DIR),
           **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, port, log_path, api_key)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if server.request("GET", "/health", timeout=2).status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not start within {timeout} s:\n{server.log()}")


@contextmanager
def serve_app(app, log_dir: Path, api_key: str | None = None):
    """Run an ASGI app under uvicorn on a thread of this process, on a free port (a ServerProcess
    without a process: request() and the readers work the same)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    try:
        yield ServerProcess(process=None, port=port, log_path=log_dir / "unused.log", api_key=api_key)
    finally:
        server.should_exit = True
        thread.join(30)
