"""The SGLang server process (one a node, or several: cluster.py) and the requests to it; Router:
SGLang's load balancer in front of several, handled the same way. Its process, restarts, API key and the
router: docs/sglang.md."""
import atexit
import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import proc

_LIVE = weakref.WeakSet()  # servers that must die with us
_HANDLERS = []


class ServerDown(Exception):
    """The server did not answer (dead, restarting, connection reset)."""


class ServerError(RuntimeError):
    """The server answered with an HTTP error: a bad request of ours, not a crash."""

    def __init__(self, path, code, body):
        super().__init__(f"SGLang {path} -> HTTP {code}: {body[:2000]}")
        self.code, self.body = code, body

    def message(self):
        """The server's own "message" field when the body is JSON carrying one, else the body."""
        with suppress(ValueError):
            obj = json.loads(self.body)
            if isinstance(obj, dict) and obj.get("message"):
                return str(obj["message"])
        return self.body


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host, port):
    with socket.socket() as s, suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT does not count
        s.bind((host, port))
        return True
    return False


def _stop_all():
    for server in list(_LIVE):
        server.stop()


def _install_handlers():
    if _HANDLERS or threading.current_thread() is not threading.main_thread():
        return
    atexit.register(_stop_all)
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if prev == signal.SIG_IGN:
            continue

        def handler(signum, frame, prev=prev):
            _stop_all()
            if callable(prev):
                prev(signum, frame)  # SIGINT's default raises KeyboardInterrupt
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
        signal.signal(sig, handler)
    _HANDLERS.append(True)


class Server:
    """One server process and the requests to it. A request that finds it dead restarts it (at most
    max_restarts times, from model_path, with the same args and env) and calls on_restart()."""

    def __init__(self, model_path, run_dir, args, env, launch_cmd, timeout, request_timeout, max_restarts,
                 on_restart, host="127.0.0.1", api_key=None, name=""):
        self.model_path = str(model_path)  # what a restart loads: a "disk" weight sync moves it
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.name, self.host, self.api_key = name, host, api_key  # name: e.g. "node01"; "" for the job's one server
        self.log_path = self.run_dir / (f"sglang_{name}.log" if name else "sglang.log")
        self.args, self.env = list(args), dict(env)  # env: added to our environment for the server
        self.launch_cmd = list(launch_cmd or [sys.executable, "-m", "sglang.launch_server"])
        self.timeout, self.request_timeout, self.on_restart = timeout, request_timeout, on_restart
        self.max_restarts, self.restarts, self.epoch = max_restarts, 0, 0
        self.pool = ThreadPoolExecutor(256, thread_name_prefix="sglang-req")  # requests in flight at most
        self.lock, self.proc = threading.Lock(), None
        self.released = False  # its GPU memory freed (SGLangEngine.release): no token may probe it
        _install_handlers()
        _LIVE.add(self)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def command(self):
        """The server's command line (without the API key)."""
        return [*self.launch_cmd, "--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                *self.args]

    def _start(self):
        # a restart keeps the port where it is still free: a router in front knows the server by its URL
        self.port = self.port if getattr(self, "port", None) and port_free(self.host, self.port) else free_port(self.host)
        self.url = f"http://{self.host}:{self.port}"
        cmd = self.command()
        shown = " ".join(cmd) + (" --api-key ***" if self.api_key else "")
        cmd += ["--api-key", self.api_key] if self.api_key else []
        env = dict(os.environ, **{k: str(v) for k, v in self.env.items()}) if self.env else None
        with open(self.log_path, "ab") as log:
            extra = " ".join(f"{k}={v}" for k, v in self.env.items())
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting: {extra} {shown}\n".encode())
            log.flush()
            self.proc = proc.popen(cmd, log, env)  # from any thread (_recover's); SGLang's children are armed too
            log.write(f"=== pid {self.proc.pid}\n".encode())  # its process group's too
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                proc.kill_group(self.proc)
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} while "
                                   f"starting; last lines of {self.log_path}:\n{self.log_tail()}")
            if self._healthy(5.0):
                return
            time.sleep(0.5)
        proc.kill_group(self.proc)
        raise RuntimeError(f"SGLang server not healthy after {self.timeout:.0f}s (raise "
                           f"--sglang-server-timeout?); last lines of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def _healthy(self, timeout, path="/health"):
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def _recover(self, epoch, error):
        """Restart a server a request found gone, once per failure epoch: requests that failed together share it."""
        with self.lock:
            if self.epoch != epoch or self.proc is None:
                return
            # one token through its scheduler unless released: /health may answer from its status alone, 200 from a
            # hung scheduler (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0; SGLang 0.5.23 http_server.py:721-795)
            if self.proc.poll() is None and self._healthy(30.0, "/health" if self.released else "/health_generate"):
                return  # a transient error: the server is fine, just retry
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"SGLang server died {self.restarts + 1} times ({error}); last lines "
                                   f"of {self.log_path}:\n{self.log_tail()}")
            self.restarts += 1
            print(f"[sglang] server down ({error}); restart {self.restarts}/{self.max_restarts} "
                  f"from {self.model_path}", file=sys.stderr)
            proc.kill_group(self.proc)
            self._start()
            self.epoch += 1
            self.on_restart()

    def watch(self, every=2.0):
        """Restart the server when it dies (a daemon thread): for one only a router calls, its weights on disk."""
        def loop():
            while self.proc is not None:
                time.sleep(every)
                p, epoch = self.proc, self.epoch
                if p is not None and p.poll() is not None:
                    try:
                        self._recover(epoch, f"exited with code {p.returncode}")
                    except RuntimeError as e:  # its start failed: again next tick, while restarts are left
                        print(f"[sglang] {e}", file=sys.stderr, flush=True)
                        if self.restarts >= self.max_restarts:  # the next call raises it for the step
                            return
        threading.Thread(target=loop, daemon=True, name=f"sglang-watch-{self.name}").start()

    def stop(self):
        server, self.proc = self.proc, None
        if server is not None:
            proc.kill_group(server)
        self.pool.shutdown(wait=False, cancel_futures=True)
        _LIVE.discard(self)

    def post(self, path, payload, timeout=None, url=None):
        """POST to this server (or to `url`, another server of the job's: the same key)."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        req = urllib.request.Request((url or self.url) + path, data=json.dumps(payload).encode(), headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as r:
                body = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerError(path, e.code, e.read().decode(errors="replace")) from None
        except (OSError, http.client.HTTPException) as e:
            raise ServerDown(f"{type(e).__name__}: {e}") from None
        with suppress(ValueError):
            return json.loads(body)
        return body

    def call(self, path, payload, timeout=None):
        """POST, surviving server deaths: restart and retry (at most max_restarts + 1 tries)."""
        for _ in range(self.max_restarts + 2):
            epoch = self.epoch
            try:
                return self.post(path, payload, timeout)
            except ServerDown as e:
                self._recover(epoch, e)
        raise RuntimeError(f"SGLang {path}: no answer after {self.max_restarts + 2} tries")


class Router(Server):
    """SGLang's load balancer (sglang-router) on 127.0.0.1 in front of `workers` (server URLs), --policy
    cache_aware: a multi-turn sample's later turns go where its earlier ones went (docs/sglang.md)."""

    def __init__(self, workers, run_dir, timeout, request_timeout, api_key=None, launch_cmd=None, args=()):
        self.workers = list(workers)
        super().__init__("", run_dir, args, {}, launch_cmd or [sys.executable, "-m", "sglang_router.launch_router"],
                         timeout, request_timeout, max_restarts=3, on_restart=lambda: None, api_key=api_key,
                         name="router")

    def _healthy(self, timeout, path=None):
        """At its start every worker registered and healthy (its /health says 200 before that), later one:
        a dead server is its node's to restart (path: a server's probe, not the router's)."""
        need = 1 if getattr(self, "ready", False) else len(self.workers)
        try:
            with urllib.request.urlopen(self.url + "/readiness", timeout=timeout) as r:
                self.ready = json.loads(r.read()).get("healthy_workers", 0) >= need
                return self.ready
        except (OSError, http.client.HTTPException, ValueError):
            return False

    def command(self):
        own = [] if "--policy" in self.args else ["--policy", "cache_aware"]
        if "--prometheus-port" not in self.args:  # its default is fixed (29000): two routers on a machine clash
            own += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return [*self.launch_cmd, "--host", self.host, "--port", str(self.port), "--worker-urls", *self.workers,
                *own, *self.args]
