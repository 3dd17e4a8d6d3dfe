"""`backfit demo`: the whole flow on the built-in tiny checkpoint, on any CPU-only machine.

original checkpoint -> convert (INT8, tp 4; and a lossless BF16 copy) -> verify -> generate
-> serve (one request per protocol through the official SDKs; `--serve` keeps it up)
-> one image request against a tiny Vision-Exp checkpoint (a generated PNG)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_demo"]

PROMPT = "The harbour town woke slowly that morning."


def _step(n: int, text: str) -> float:
    print(f"\n[{n}/7] {text}", flush=True)
    return time.time()


def run_demo(workdir: str | None = None, max_positions: int = 512, max_tokens: int = 24,
             serve: bool = False) -> dict:
    from backfit.convert.run import convert
    from backfit.synthetic import write_checkpoint
    from backfit.verify.run import verify

    root = Path(workdir) if workdir else \
        Path(os.environ.get("BACKFIT_CACHE", Path.home() / ".cache" / "backfit")) / "demo"
    src, int8, lossless = root / "original", root / "converted-int8-tp4", root / "converted-bf16-tp1"
    t = _step(1, f"writing a tiny DeepSeek-V4-Flash checkpoint in the exact original format to {src}")
    print("      FP8 e4m3 linears with 128x128 UE8M0 scales, MXFP4 experts, the real tokenizer")
    if src.exists():
        shutil.rmtree(src)
    write_checkpoint(src, "flash", seed=0)
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"      {len(list(src.glob('*.safetensors')))} shards, {size / 1e6:.1f} MB, {time.time() - t:.1f} s")

    t = _step(2, f"backfit convert {src} {int8} --tp 4 --force   (the default INT8 format)")
    convert(src, int8, tp=4, force=True, progress=False)
    print(f"      {time.time() - t:.1f} s")
    t = _step(3, f"backfit convert {src} {lossless} --tp 1 --linears bf16 --experts bf16 --force")
    convert(src, lossless, tp=1, linears="bf16", experts="bf16", force=True, progress=False)
    print(f"      {time.time() - t:.1f} s")

    t = _step(4, "backfit verify: runtime on the converted dirs vs the reference on the original")
    print("\n--- semantics: lossless conversion, float32 activations ---")
    sem = verify(src, lossless, max_positions=max_positions)
    print("\n--- conversion: INT8 conversion (tp 4), float32 activations ---")
    conv = verify(src, int8, max_positions=max_positions)
    print(f"      {time.time() - t:.1f} s")

    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    t = _step(5, f"backfit generate {int8} --prompt {PROMPT!r} --max-tokens {max_tokens} "
                 f"--max-model-len 2048 --speculative-config '{spec}'")
    print("      (random weights: the text is gibberish, the point is that it runs; the MTP block\n"
          "      drafts 3 tokens a step and the model verifies them: the same text as without)\n"
          f"{PROMPT}", end="")
    sys.stdout.flush()         # its own process: tp 4 ranks need a process with no TP info yet
    subprocess.run([sys.executable, "-m", "backfit.cli", "generate", str(int8), "--prompt", PROMPT,
                    "--max-tokens", str(max_tokens), "--max-model-len", "2048",
                    "--speculative-config", spec], check=True)
    print(f"      {time.time() - t:.1f} s")
    t = _step(6, f"backfit serve {lossless}   (OpenAI Chat/Responses/Completions, Anthropic)")
    _serve_step(lossless, keep=serve)
    print(f"      {time.time() - t:.1f} s")
    t = _step(7, "an image request: a tiny DeepSeek-V4-Flash-Vision-Exp checkpoint, served")
    _vision_step(root / "vision")
    print(f"      {time.time() - t:.1f} s")
    verdict = {True: "PASS", False: "FAIL"}
    print(f"\nsemantics check {verdict[sem['ok']]}; conversion check {verdict[conv['ok']]} "
          "(thresholds: docs/VERIFICATION.md)")
    return {"semantics": sem, "conversion": conv}


def _vision_step(root: Path) -> None:
    """Write and convert a tiny Vision-Exp checkpoint (ViT + aligner + sentinels + bias_vl on
    the 0731 text model, small vocabulary), serve it, send one Chat request with a generated
    PNG as a data URL through the openai SDK, print what the image cost."""
    import asyncio
    import base64
    import threading

    import openai

    from backfit.convert.run import convert
    from backfit.server.app import make_context, start_server
    from backfit.server.bridge import AsyncEngine, EngineConfig
    from backfit.synthetic import write_checkpoint
    from backfit.verify.image_prompts import synthetic_png

    src, conv = root / "original", root / "converted-bf16-tp1"
    for d in (src, conv):
        if d.exists():
            shutil.rmtree(d)
    write_checkpoint(src, "vision", seed=0, small_vocab=True, n_routed_experts=8,
                     moe_intermediate_size=256)
    convert(src, conv, tp=1, linears="bf16", experts="bf16", force=True, progress=False)
    print(f"      {src} -> {conv} (the tower, aligner and sentinels pass through in BF16)")
    engine = AsyncEngine(EngineConfig(str(conv), dtype="float32", max_model_len=2048,
                                      max_num_seqs=2, cpu_kv_cache_gib=0.25))
    ctx = make_context(engine, str(conv))
    loop = asyncio.new_event_loop()
    port = _free_port()
    runner = loop.run_until_complete(start_server(ctx, "127.0.0.1", port))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine.start()
    try:
        while not engine.ready.is_set():
            if engine.error is not None:
                raise RuntimeError(f"engine failed to start: {engine.error}")
            time.sleep(0.05)
        png = synthetic_png(320, 400)
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
        r = c.chat.completions.create(model="deepseek-v4-flash", messages=msgs, max_tokens=4)
        text = c.chat.completions.create(model="deepseek-v4-flash", max_tokens=4, messages=[
            {"role": "user", "content": "What is in the picture?"}]).usage.prompt_tokens
        print(f"      openai chat.completions with a 320x400 PNG ({len(png):,} bytes, data URL): "
              f"finish={r.choices[0].finish_reason}, {r.usage.prompt_tokens} prompt tokens "
              f"(~{r.usage.prompt_tokens - text} for the image: an 11 x 9 grid of aligner "
              f"rows in its N-layout block)")
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        engine.shutdown()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_step(model: Path, keep: bool = False) -> None:
    """Start the server in this process on the tiny model, send one request per protocol
    through the official SDKs (Responses / Anthropic only where those modules exist), print
    the curl and openai examples; stop, or with keep=True serve until Ctrl-C."""
    import asyncio
    import importlib.util
    import threading

    from backfit.server.app import make_context, start_server
    from backfit.server.bridge import AsyncEngine, EngineConfig

    port = 8000 if keep else _free_port()
    engine = AsyncEngine(EngineConfig(str(model), dtype="float32", max_model_len=2048,
                                      max_num_seqs=4, cpu_kv_cache_gib=0.25))
    ctx = make_context(engine, str(model))
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(start_server(ctx, "127.0.0.1", port))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine.start()
    while not engine.ready.is_set():
        if engine.error is not None:
            raise RuntimeError(f"engine failed to start: {engine.error}")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    print(f"      listening on {url} (the model id is {ctx.model_name})")
    try:
        _sdk_requests(url, importlib.util.find_spec("backfit.server.openai_responses"),
                      importlib.util.find_spec("backfit.server.anthropic"))
        body = ('{"model": "deepseek-v4-flash", "max_tokens": 16, "stream": true, '
                '"messages": [{"role": "user", "content": "Hi"}]}')
        print("\n      try it yourself (backfit demo --serve keeps the server up):\n"
              f"        curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{body}'\n"
              f"        python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', "
              "api_key='none'); print(c.chat.completions.create(model='deepseek-v4-flash', "
              "max_tokens=16, messages=[{'role': 'user', 'content': 'Hi'}]).choices[0].message)\"")
        if keep:
            print(f"\n      serving on {url} until Ctrl-C (docs/API.md: pointing clients at it)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        engine.shutdown()


def _sdk_requests(url: str, responses: bool, anthropic: bool) -> None:
    import openai
    c = openai.OpenAI(base_url=url + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Say hello."}]
    r = c.chat.completions.create(model="deepseek-v4-flash", messages=msgs, max_tokens=3)
    u = r.usage
    print(f"      openai chat.completions: finish={r.choices[0].finish_reason} usage: "
          f"{u.prompt_tokens} prompt, {u.completion_tokens} completion "
          f"({u.completion_tokens_details.reasoning_tokens} reasoning)")
    n = sum(1 for _ in c.chat.completions.create(model="deepseek-v4-flash", messages=msgs,
                                                 max_tokens=3, stream=True))
    print(f"      openai chat.completions stream: {n} chunks")
    r = c.completions.create(model="deepseek-v4-flash", prompt="The harbour", max_tokens=4,
                             logprobs=1, echo=True)
    print(f"      openai completions (echo + logprobs, as lm-eval): "
          f"{len(r.choices[0].logprobs.tokens)} scored tokens")
    if responses:
        r = c.responses.create(model="deepseek-v4-flash", input="Say hello.",
                               max_output_tokens=3)
        print(f"      openai responses: status={r.status} usage: {r.usage.output_tokens} output")
    else:
        print("      openai responses: not built in this checkout (skipped)")
    if anthropic:
        import anthropic as anthropic_sdk
        a = anthropic_sdk.Anthropic(base_url=url, api_key="none")
        m = a.messages.create(model="deepseek-v4-flash", max_tokens=3, messages=msgs)
        print(f"      anthropic messages: stop_reason={m.stop_reason} usage: "
              f"{m.usage.output_tokens} output")
    else:
        print("      anthropic messages: not built in this checkout (skipped)")
