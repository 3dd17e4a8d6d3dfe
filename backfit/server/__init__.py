"""backfit.server: OpenAI Chat/Responses/Completions and Anthropic Messages over aiohttp.

Each protocol module turns its JSON into one neutral ChatRequest (protocol.py), chat_format.py
encodes it for DeepSeek-V4, bridge.py (the only module that imports the engine) streams the
engine's output through parser.py into neutral events, and each protocol renders them.
docs/API.md lists the endpoints, flags and client set-ups.
"""
