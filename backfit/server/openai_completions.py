"""POST /v1/completions (legacy, api-protocols §7.4): raw prompt, no chat template, so
lm-evaluation-harness `local-completions` can score the model (`echo` + `logprobs`).

prompt: a string, a list of strings, a token-id list, or a list of token-id lists (one choice
each, run concurrently; streaming takes one prompt). Text prompts are tokenized exactly as the
shipped tokenizer does (`tokenizer_api.raw_ids`: BOS only where `add_bos_token` says so, none
for DSV4), so lm-eval's text and token requests score the same tokens. `echo` prepends the
prompt; with `logprobs` (0..20) the prompt tokens' logprobs come first (the first token has
none), as OpenAI and vLLM do. `max_tokens` defaults to
16 (OpenAI); `max_tokens: 0` with `echo` scores the prompt only (one token is run, not returned).
`suffix` and `n` > 1 are a 400 naming the field. `return_tokens_as_token_ids` (vLLM) names
logprob tokens `token_id:<id>` (exact even for byte tokens that are not valid UTF-8 alone).
Stop strings apply to the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiohttp import web

from backfit.server.bridge import CTX, KEEPALIVE, EngineUnavailable, QueueFull
from backfit.server.http import (
    BadRequest,
    ClientGone,
    get_bool,
    get_dict,
    get_int,
    get_str,
    json_response,
    read_json,
    sse_comment,
    sse_data,
    sse_start,
)
from backfit.server.openai_chat import (
    close_stream,
    error_response,
    first_event,
    map_exception,
    parse_stop,
    sampling_params,
)
from backfit.server.protocol import Usage
from backfit.server.tokenizer_api import raw_ids

__all__ = ["Logprobs", "handle", "prompt_ids"]

log = logging.getLogger("backfit.server")
MAX_PROMPTS = 64


def prompt_ids(ctx, prompt) -> list[list[int]]:
    """The `prompt` field -> one id list per prompt (strings: tokenizer_api.raw_ids)."""
    vocab = ctx.tokenizer.get_vocab_size(with_added_tokens=True)

    def ids_of(p, where):
        if isinstance(p, str):
            return raw_ids(ctx, p)
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in p):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"{where}: token id {bad[0]} is outside [0, {vocab})", where)
            return list(p)
        raise BadRequest(f"{where} must be a string or an array of token ids", where)

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) for t in prompt)):
        out = [ids_of(prompt, "prompt")]
    elif isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"prompt: at most {MAX_PROMPTS} prompts per request", "prompt")
        out = [ids_of(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        raise BadRequest("prompt must be a non-empty string, array of strings or token ids",
                         "prompt")
    for i, ids in enumerate(out):
        if not ids:
            raise BadRequest(f"prompt[{i}] is empty", "prompt")
    return out


class Logprobs:
    """The legacy `logprobs` object, built token by token: tokens, token_logprobs,
    top_logprobs ({token text: logprob}), text_offset (chars into the returned text)."""

    def __init__(self, tokenizer, offset: int = 0, as_ids: bool = False):
        self.tok, self.offset, self.as_ids = tokenizer, offset, as_ids
        self.d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _s(self, tid: int) -> str:
        if self.as_ids:                                   # vLLM's return_tokens_as_token_ids
            return f"token_id:{tid}"
        return self.tok.decode([tid], skip_special_tokens=False)

    def add(self, tid: int, lp: float | None, top) -> None:
        self.d["tokens"].append(self._s(tid))
        self.d["token_logprobs"].append(lp)
        self.d["top_logprobs"].append(None if top is None else
                                      {self._s(t): v for t, v in top})
        self.d["text_offset"].append(self.offset)         # into the text (specials skipped)
        self.offset += len(self.tok.decode([tid], skip_special_tokens=True))

    def take(self) -> dict:
        out = self.d
        self.d = {k: [] for k in out}
        return out


def _parse(body: dict):
    get_str(body, "model")
    if get_int(body, "n", 1) != 1 or (get_int(body, "best_of", 1) or 1) != 1:
        raise BadRequest("n and best_of must be 1", "n")
    if body.get("suffix") not in (None, ""):
        raise BadRequest("suffix is not supported", "suffix")
    mt = get_int(body, "max_tokens", 16, lo=0)
    echo = get_bool(body, "echo", False)
    nlp = get_int(body, "logprobs", None, lo=0, hi=20)
    if mt == 0 and not echo:
        raise BadRequest("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
    params = sampling_params(body, max(mt, 1), stop=parse_stop(body), logprobs=nlp,
                             prompt_logprobs=nlp if echo and nlp is not None else None,
                             skip_special_tokens=get_bool(body, "skip_special_tokens", True))
    opts = get_dict(body, "stream_options", {}) or {}
    as_ids = bool(get_bool(body, "return_tokens_as_token_ids", False))
    return mt, echo, nlp, params, bool(get_bool(body, "stream", False)), \
        opts.get("include_usage") is True, as_ids


async def handle(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    try:
        body = await read_json(request)
        mt, echo, nlp, params, stream, include_usage, as_ids = _parse(body)
        prompts = prompt_ids(ctx, body.get("prompt"))
        if stream and len(prompts) > 1:
            raise BadRequest("streaming takes one prompt", "prompt")
        gens = [ctx.bridge.generate(ids, params) for ids in prompts]
        tasks = []
        try:
            for g in gens:
                tasks.append(await first_event(g))
        except BaseException:
            for g, t in zip(gens, tasks):
                await close_stream(g, t)
            raise
    except (ValueError, QueueFull, EngineUnavailable) as e:
        return map_exception(e)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": ctx.model_name}
    if stream:
        return await _stream(request, ctx, head, gens[0], tasks[0], prompts[0], mt, echo,
                             Logprobs(ctx.tokenizer, as_ids=as_ids) if nlp is not None else None,
                             include_usage)
    try:
        results = await asyncio.gather(*(_one(ctx, g, t, ids, mt, echo, Logprobs(
            ctx.tokenizer, as_ids=as_ids) if nlp is not None else None)
                                         for g, t, ids in zip(gens, tasks, prompts)))
    finally:
        for g, t in zip(gens, tasks):
            await close_stream(g, t)
    if any(r is None for r in results):
        return error_response(503, "generation failed (engine error)", "server_error",
                              code="engine_error", headers={"Retry-After": "5"})
    choices = [{"index": i, **c} for i, (c, _) in enumerate(results)]
    usage = [u for _, u in results]
    return json_response({**head, "choices": choices, "usage": _usage(usage)},
                         headers={"x-request-id": cid})


def _usage(us: list[Usage]) -> dict:
    p, c = sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in us)}}


def _echo(ctx, ids, lp: Logprobs | None, first) -> str:
    text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
    if lp is not None:
        plp = first.prompt_logprobs or []
        skip = len(ids) - len(plp)            # positions without logits (none: no cache hit)
        for k, tid in enumerate(ids):
            e = plp[k - skip] if k >= skip else None
            lp.add(tid, None if e is None else e[1], None if e is None else e[2])
    return text


async def _outputs(g, task):
    try:
        yield await task
    except StopAsyncIteration:
        return
    async for o in g:
        yield o


async def _one(ctx, g, task, ids, mt, echo, lp: Logprobs | None):
    """One prompt to completion -> (choice dict, Usage), or None on an engine failure."""
    text, reason, usage, first = [], None, None, True
    try:
        async for o in _outputs(g, task):
            if o is KEEPALIVE:
                continue
            if first and echo:
                text.append(_echo(ctx, ids, lp, o))
            first = False
            if mt > 0:
                text.append(o.text)
                if lp is not None and o.logprobs:
                    for tid, (v, top) in zip(o.token_ids, o.logprobs):
                        lp.add(tid, v, top)
            if o.finished:
                reason, usage = o.finish_reason, o.usage
    except (RuntimeError, ValueError):        # engine died mid-request, or refused it late
        return None
    if usage is None:
        return None
    if mt == 0:
        usage = Usage(usage.prompt_tokens, 0, usage.cached_tokens)
        reason = "length"
    else:
        usage = Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
    return ({"text": "".join(text), "logprobs": lp.take() if lp else None,
             "finish_reason": "stop" if reason == "abort" else reason}, usage)


async def _stream(request, ctx, head, g, task, ids, mt, echo, lp, include_usage):
    resp, first, usage = None, True, None

    def chunk(text, logprobs=None, finish=None):
        return {**head, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                     "finish_reason": finish}]}
    try:
        resp = await sse_start(request, {"x-request-id": head["id"]})
        async for o in _outputs(g, task):
            if o is KEEPALIVE:
                await sse_comment(resp)
                continue
            text = ""
            if first and echo:
                text = _echo(ctx, ids, lp, o)
            first = False
            if mt > 0:
                text += o.text
                if lp is not None and o.logprobs:
                    for tid, (v, top) in zip(o.token_ids, o.logprobs):
                        lp.add(tid, v, top)
            finish = None
            if o.finished:
                finish = "stop" if o.finish_reason == "abort" else o.finish_reason
                usage = o.usage
            if text or finish:
                await sse_data(resp, chunk(text, lp.take() if lp else None, finish))
        if include_usage and usage is not None:
            await sse_data(resp, {**head, "choices": [], "usage": _usage([usage])})
        await sse_data(resp, "[DONE]")
    except (ValueError, RuntimeError) as e:      # engine failure, or refused after the headers
        if resp is None:
            raise
        with contextlib.suppress(ClientGone, ConnectionError):
            await sse_data(resp, {"error": {"message": str(e)[:500], "type": "server_error",
                                            "param": None, "code": "engine_error"}})
            await sse_data(resp, "[DONE]")
    except (ClientGone, ConnectionError):
        log.debug("completion %s: client went away", head["id"])
    finally:
        await close_stream(g, task)
    return resp if resp is not None else web.Response(status=499)
