"""The shipped tokenizer as clients see it: raw-text prompts tokenized exactly as the checkpoint's
tokenizer does, and the vLLM-compatible `/tokenize`, `/detokenize` and `GET /tokenizer_info`
(lm-evaluation-harness's remote tokenizer reads the last two).

Raw text (`/v1/completions` string prompts, `/tokenize` {prompt}) → ids as
`tokenizer.json` encodes it (added tokens such as `<｜User｜>` parsed, as `transformers` and vLLM
do: a raw prompt has no template to protect, and token-id prompts reach every id anyway), then
BOS in front when `add_special_tokens` and `tokenizer_config.json`'s `add_bos_token` say so (EOS
after with `add_eos_token`). DSV4 ships `add_bos_token: false`, so its raw prompts get no BOS,
as `AutoTokenizer(...)(text)` gives none: lm-eval's text and token requests then score the
same tokens. Chat requests never come here: their user text is never parsed into control tokens
(`chat_format`).

`GET /tokenizer_info` is vLLM's (`--enable-tokenizer-info-endpoint`): the tokenizer's
configuration as `tokenizer_config.json` holds it, AddedToken objects flattened to their text
(`bos_token`, `eos_token`, `pad_token`, `added_tokens_decoder` {id: text}), file paths dropped,
`tokenizer_class` always present. No `chat_template`: DSV4 has none (its prompts are built by the
DSV4 encoder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

from backfit.server import openai_request
from backfit.server.bridge import CTX
from backfit.server.http import BadRequest, get_bool, get_dict, get_list, json_response, read_json
from backfit.server.protocol import ChatRequest

__all__ = ["load_tokenizer_config", "raw_ids", "tokenize", "detokenize", "tokenizer_info"]

_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def load_tokenizer_config(model_dir: str | Path) -> dict[str, Any]:
    """DIR/tokenizer_config.json as a dict ({} when absent); a broken file is a ValueError."""
    p = Path(model_dir) / "tokenizer_config.json"
    if not p.is_file():
        return {}
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: expected a JSON object")
    return cfg


def _flat(v: Any) -> Any:
    """AddedToken dicts ({"__type": "AddedToken", "content": ...}) -> their text, recursively."""
    if isinstance(v, dict):
        if "content" in v and (v.get("__type") == "AddedToken" or "special" in v):
            return v["content"]
        return {k: _flat(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_flat(x) for x in v]
    return v


def raw_ids(ctx, text: str, add_special_tokens: bool = True) -> list[int]:
    """Raw text -> ids as the shipped tokenizer gives them (module docstring)."""
    ids = ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    if not add_special_tokens:
        return ids
    cfg = ctx.tokenizer_config or {}
    bos = ctx.tokenizer.token_to_id(_flat(cfg.get("bos_token")) or "")
    eos = ctx.tokenizer.token_to_id(_flat(cfg.get("eos_token")) or "")
    if cfg.get("add_bos_token") and bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    if cfg.get("add_eos_token") and eos is not None and ids[-1:] != [eos]:
        ids = ids + [eos]
    return ids


async def tokenize(request: web.Request) -> web.Response:
    """{prompt, add_special_tokens?} (raw text, module docstring) or {messages, tools?, ...}
    (the same encoder path as generation) -> {count, max_model_len, tokens, token_strs?}."""
    ctx = request.app[CTX]
    body = await read_json(request)
    if "messages" in body:
        tools, choice = openai_request.parse_tools(body)
        thinking, effort = openai_request.parse_reasoning(body)
        req = ChatRequest(openai_request.parse_messages(body["messages"], ctx.images is not None),
                          tools, choice, thinking, effort, get_dict(body, "response_format", None))
        if ctx.images is not None:             # image parts count as their blocks' positions
            req = await ctx.images.resolve(req)
        try:
            ids = ctx.encoder.encode_request(req).ids
        except ValueError as e:
            raise BadRequest(str(e)[:500], "messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string (or give messages)", "prompt")
        ids = raw_ids(ctx, prompt, get_bool(body, "add_special_tokens", True))
    out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs", False):
        out["token_strs"] = [ctx.tokenizer.id_to_token(t) for t in ids]
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    body = await read_json(request)
    ids = get_list(body, "tokens")
    vocab = ctx.tokenizer.get_vocab_size(with_added_tokens=True)
    if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                              for t in ids):
        raise BadRequest(f"tokens must be an array of token ids in [0, {vocab})", "tokens")
    return json_response({"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)})


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info (module docstring)."""
    cfg = {k: _flat(v) for k, v in (request.app[CTX].tokenizer_config or {}).items()
           if k not in _FILE_KEYS}
    cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    return json_response(cfg)
