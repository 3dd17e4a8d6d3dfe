"""N local `backfit serve` replicas behind one cache-aware router (docs/DEPLOY.md), one URL.

    python scripts/replicas.py CONVERTED --replicas 2 [--port 8000] [--gpus-per-replica 4] \\
        [--router-arg=--cache-threshold=0.5 ...] -- [backfit serve flags: --device cuda ...]

Replica i serves on --replica-base-port + i with `--shutdown-timeout` (a drain on SIGTERM);
with --gpus-per-replica K it sees CUDA devices i*K .. i*K+K-1. Once every replica's /health is
200 the router (the Shepherd Model Gateway, `smg launch`: pip install 'backfit[deploy]') starts
in front of them with --policy cache_aware, and this prints one line:

    replicas: ready on http://127.0.0.1:8000 -> 2 replicas (http://127.0.0.1:8001 pid 123, ...)

A replica that dies is reported and left out by the router; the router dying stops everything.
Ctrl-C (or SIGTERM) stops everything: the replicas drain (their /health turns 503, admitted
requests finish within --shutdown-timeout), then the router goes; a second Ctrl-C kills all.
Each process logs to --log-dir (replica-I.log, router.log).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

POLL_S = 0.5


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, serve_args = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Everything after -- goes to each `backfit serve`.")
    ap.add_argument("converted")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1", help="where the router and replicas listen")
    ap.add_argument("--port", type=int, default=8000, help="the router's port (the one URL)")
    ap.add_argument("--replica-base-port", type=int, default=None,
                    help="replica i listens on this + i (default: --port + 1)")
    ap.add_argument("--gpus-per-replica", type=int, default=0,
                    help="CUDA devices per replica (CUDA_VISIBLE_DEVICES); 0: leave it alone")
    ap.add_argument("--policy", default="cache_aware", help="the router's --policy")
    ap.add_argument("--router-metrics-port", type=int, default=29000,
                    help="the router's own Prometheus port (smg's default)")
    ap.add_argument("--router-arg", action="append", default=[],
                    help="one more smg flag, e.g. --router-arg=--cache-threshold=0.5")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="each replica's drain on stop (backfit serve --shutdown-timeout)")
    ap.add_argument("--ready-timeout", type=float, default=1800.0,
                    help="seconds for the replicas to load")
    ap.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        ap.error("--replicas must be at least 1")
    if args.replica_base_port is None:
        args.replica_base_port = args.port + 1
    return args, serve_args


def devices(i: int, k: int) -> str:
    """CUDA_VISIBLE_DEVICES of replica i with k devices each: i*k .. i*k+k-1."""
    return ",".join(str(d) for d in range(i * k, i * k + k))


def router_cmd(args, urls: list[str]) -> list[str]:
    """`smg launch` over the replicas: health probes every 2 s (a dead or draining replica is
    out within ~2 probes), a short shutdown grace (the replicas drained before it stops)."""
    return [sys.executable, "-m", "smg", "launch", "--host", args.host, "--port", str(args.port),
            "--worker-urls", *urls, "--policy", args.policy,
            "--prometheus-host", args.host, "--prometheus-port", str(args.router_metrics_port),
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--shutdown-grace-period-secs", "5",
            "--log-level", "warn", *args.router_arg]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """Its own process group (a terminal's Ctrl-C reaches only this script, which stops the
    children in order; killpg also reaches a replica's rank processes)."""
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _tail(log: Path, n: int = 15) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-n:])


def _wait(pred, procs: dict[str, subprocess.Popen], logs: dict[str, Path], timeout: float,
          what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}) before {what}:\n"
                                   f"{_tail(logs[name])}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what}: not within {timeout:g} s (logs: {logs})")
        time.sleep(POLL_S)


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def stop(procs: dict[str, subprocess.Popen], grace: float, stopping: list[int]) -> None:
    """Replicas first (SIGTERM: they drain while the router still forwards their streams),
    then the router; past `grace` seconds, or on another signal, SIGKILL what is left."""
    order = [[p for n, p in procs.items() if n != "router"],
             [p for n, p in procs.items() if n == "router"]]
    for group in order:
        for p in group:
            _signal(p, signal.SIGTERM)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in group) and time.monotonic() < end \
                and len(stopping) < 2:
            time.sleep(0.1)
        for p in group:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> int:
    args, serve_args = parse(sys.argv[1:] if argv is None else argv)
    if importlib.util.find_spec("smg") is None:
        print("replicas: the router is not installed: pip install 'backfit[deploy]' (smg)",
              file=sys.stderr)
        return 1
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="backfit-replicas-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stopping.append(s))
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    urls = [f"http://{args.host}:{args.replica_base_port + i}" for i in range(args.replicas)]
    try:
        for i, url in enumerate(urls):
            env = dict(os.environ)
            if args.gpus_per_replica:
                env["CUDA_VISIBLE_DEVICES"] = devices(i, args.gpus_per_replica)
            name = f"replica-{i}"
            logs[name] = log_dir / f"{name}.log"
            procs[name] = _spawn([sys.executable, "-m", "backfit.cli", "serve", args.converted,
                                  "--host", args.host, "--port", url.rsplit(":", 1)[1],
                                  "--shutdown-timeout", f"{args.shutdown_timeout:g}",
                                  *serve_args], logs[name], env)
        print(f"replicas: loading {args.replicas} x {args.converted} (logs in {log_dir})",
              flush=True)
        _wait(lambda: stopping or all(_get(u + "/health") == 200 for u in urls), procs, logs,
              args.ready_timeout, "every replica is ready")
        logs["router"] = log_dir / "router.log"
        procs["router"] = _spawn(router_cmd(args, urls), logs["router"])
        front = f"http://{args.host}:{args.port}"
        _wait(lambda: stopping or _get(front + "/v1/models") == 200, procs, logs, 120,
              "the router answers")
        if not stopping:
            pids = ", ".join(f"{u} pid {procs[f'replica-{i}'].pid}" for i, u in enumerate(urls))
            print(f"replicas: ready on {front} -> {args.replicas} replicas ({pids}); router "
                  f"pid {procs['router'].pid}; Ctrl-C stops all", flush=True)
        dead: set[str] = set()
        while not stopping:
            for name, p in procs.items():
                if p.poll() is not None and name not in dead:
                    dead.add(name)
                    print(f"replicas: {name} exited ({p.returncode}); last lines:\n"
                          f"{_tail(logs[name])}", flush=True)
            if "router" in dead:
                return 1
            time.sleep(POLL_S)
        return 0
    except RuntimeError as e:
        print(f"replicas: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("replicas: stopping (replicas drain first; Ctrl-C again kills)", flush=True)
        stop(procs, args.shutdown_timeout + 10, stopping)
        print("replicas: stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
