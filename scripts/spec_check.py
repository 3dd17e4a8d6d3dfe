"""Speculative decoding end to end on the lent GPU: `backfit serve --speculative-config ...` gives
the greedy text of `backfit serve` without it, through all three protocols.

    python3 scripts/spec_check.py [--device cuda] [--out DIR]

For each drafter (Flash's MTP block, k = 3; 0731's DSpark, k = 5): a tiny checkpoint of that
variant (small vocabulary) is written and converted, one server runs without speculation and one
with it (both on the device's default: triton kernels, CUDA graphs), and the same greedy requests
go to /v1/chat/completions, /v1/responses and /v1/messages of each (plain HTTP: the device image
has no SDKs). Every text (each protocol's message text: ids differ by design) must be non-empty
and equal, and the speculative server's /metrics must count drafts.
Exit status 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a short poem about the sea.", "def fib(n):", "List three prime numbers."]
CASES = [("flash", {"method": "mtp", "num_speculative_tokens": 3}),
         ("0731", {"method": "dspark", "num_speculative_tokens": 5})]


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def texts(port: int) -> list[str]:
    out = []
    for p in PROMPTS:
        msg = [{"role": "user", "content": p}]
        c = post(port, "/v1/chat/completions", {"model": "m", "messages": msg, "max_tokens": 40,
                                                "temperature": 0, "thinking": False})
        out.append(c["choices"][0]["message"].get("content") or "")
        r = post(port, "/v1/responses", {"model": "m", "input": p, "max_output_tokens": 40,
                                         "temperature": 0, "thinking": False})
        out.append("".join(c.get("text", "") for item in r.get("output") or []
                           if item.get("type") == "message" for c in item.get("content") or []))
        a = post(port, "/v1/messages", {"model": "m", "messages": msg, "max_tokens": 40,
                                        "temperature": 0, "thinking": {"type": "disabled"}})
        out.append("".join(b.get("text", "") for b in a.get("content") or []
                           if b.get("type") == "text"))
    return out


def serve(conv: Path, port: int, device: str, spec: dict | None, log: Path):
    cmd = [sys.executable, "-m", "backfit.cli", "serve", str(conv), "--device", device,
           "--port", str(port), "--max-model-len", "512"]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            if p.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            time.sleep(1)
    raise RuntimeError("server did not come up")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    from backfit.convert.run import convert
    from backfit.synthetic import write_checkpoint
    ok = True
    for variant, spec in CASES:
        d = Path(tempfile.mkdtemp())
        write_checkpoint(d / "orig", variant, seed=0, small_vocab=True)
        convert(d / "orig", d / "conv", tp=1, progress=False)
        got = {}
        for name, sp, port in (("plain", None, 8771), ("spec", spec, 8772)):
            p = serve(d / "conv", port, args.device, sp, out / f"serve_{variant}_{name}.log")
            try:
                got[name] = texts(port)
                if sp:
                    m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                    drafts = [ln for ln in m.splitlines()
                              if ln.startswith("vllm:spec_decode_num_drafts")]
                    print(variant, drafts)
                    ok &= bool(drafts) and float(drafts[0].split()[-1]) > 0
            finally:
                p.terminate()
                p.wait(60)
        same = got["plain"] == got["spec"] and all(got["plain"])
        ok &= same
        print(f"{variant} {spec['method']} k={spec['num_speculative_tokens']}: "
              f"{'same greedy text' if same else 'DIFFERENT'} over {len(got['plain'])} requests")
        if not same:
            for a, b in zip(got["plain"], got["spec"]):
                if a != b:
                    print("  plain:", a[:200], "\n  spec: ", b[:200])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
