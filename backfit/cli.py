"""`backfit` command line. Each command turns flags into arguments and calls one function.

Heavy imports (torch, triton, aiohttp) happen inside the commands, so `backfit --help` is instant.
"""

from __future__ import annotations

import sys

import click

from backfit import __version__


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


def _user_errors() -> tuple[type[Exception], ...]:
    from backfit.checkpoint import CheckpointError
    from backfit.config import ConfigError
    from backfit.convert.plan import ConvertError
    from backfit.formats import FormatError
    return ConvertError, CheckpointError, ConfigError, FormatError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="backfit")
def main() -> None:
    """backfit: run FP8/FP4-packed DeepSeek-V4 on BF16/INT8 GPUs (A100/A800, SM80).

    Data flows one way: original checkpoint -> `backfit convert` -> converted directory ->
    runtime -> server / verify. Start with `backfit demo` to see the whole flow on a tiny
    built-in checkpoint.
    """


@main.command()
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--tp", type=click.Choice(["1", "2", "4", "8"]), default="4", show_default=True,
              help="Tensor-parallel degree the output is pre-sharded for (one folder per rank).")
@click.option("--linears", type=click.Choice(["int8", "bf16"]), default="int8", show_default=True,
              help="FP8 attention/shared-expert linears: int8 = INT8 with one FP32 scale per "
                   "(row, 128 inputs), error measured per tensor; bf16 = lossless, 2x bytes.")
@click.option("--experts", type=click.Choice(["int8", "mx4", "bf16"]), default="int8",
              show_default=True,
              help="MXFP4 routed experts, all bit-exact (same weights in every scheme): "
                   "int8 = INT8 with per-(row, 32) power-of-two scales; mx4 = the packed 4-bit "
                   "MXFP4 bytes kept as they are, half the expert bytes. Both run the Triton "
                   "fused MoE, which decodes the weights to BF16 in registers for BF16 MMA. "
                   "Choose mx4 for decode-heavy serving (chat, agents, long contexts) and on "
                   "80 GiB cards: at TP4 it leaves ~9x the KV pool (1M-token contexts; with "
                   "int8 no KV fits at --gpu-memory-utilization 0.90), and on an H200 it "
                   "decodes as fast as int8 at batch 1 and 4-8 % faster at batch 8-64. Choose "
                   "int8 for prefill-heavy work (long prompts, short answers) on cards with "
                   "room: mx4 prefills ~15 % slower (docs/PERFORMANCE.md). bf16 = 2x the int8 "
                   "bytes (verification / big machines).")
@click.option("--force", is_flag=True, help="Replace DST if it exists (only once the new one is complete).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def convert(src: str, dst: str, tp: str, linears: str, experts: str, force: bool, quiet: bool) -> None:
    """Transcode an original DeepSeek-V4 checkpoint SRC into a backfit directory DST.

    SRC is a local directory or a Hugging Face repo id already in the local cache (nothing is
    downloaded). Work goes to DST.partial and is renamed to DST at the end; an interrupted run
    resumes where it stopped when re-run with the same options. Memory stays bounded (one tensor
    at a time), so the 160 GB Flash checkpoint converts on a 24 GB machine.
    """
    from backfit.convert.run import convert as run_convert
    try:
        run_convert(src, dst, tp=int(tp), linears=linears, experts=experts, force=force,
                    progress=not quiet)
    except _user_errors() as e:
        _fail(e)


@main.command()
@click.argument("original", type=click.Path(exists=True, file_okay=False))
@click.argument("converted", type=click.Path(exists=True, file_okay=False))
@click.option("--tp", type=int, default=None, help="Ranks to run the runtime on (default: the converted tp).")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text file of prompts separated by blank lines, or a JSON list of strings "
                   "(default: built-in prose in six languages and code in four).")
@click.option("--max-positions", type=int, default=512, show_default=True,
              help="Token positions compared in all (prompts are cycled to reach it).")
@click.option("--activations", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="Runtime activation dtype. float32 judges the conversion; "
                   "bfloat16 is judged against the reference's own bfloat16 noise floor.")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the full report as JSON.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16", "int8"]), default=None,
              help="Run the runtime on the engine's paged pools with this cache storage (int8 is "
                   "lossy: judged as a conversion). Default: one plain full forward.")
@click.option("--kernels", type=click.Choice(["torch", "triton"]), default=None,
              help="Run on the paged pools with these kernels (triton needs --device cuda).")
@click.option("--long-context", type=int, default=None, metavar="N",
              help="One sequence of N tokens through the paged pools (65536 on a GPU), where "
                   "index overflows and block-table or entry off-by-ones show.")
@click.option("--chunk", type=int, default=256, show_default=True,
              help="Prefill chunk on the paged pools (tokens per forward).")
@click.option("--reference-device", default="cpu", show_default=True,
              help="Where the independent reference runs (cpu or cuda). Its indexer and "
                   "attention are quadratic in length: use cuda for --long-context 65536.")
@click.option("--prefill-graphs", is_flag=True, default=False,
              help="Run every prefill chunk through the engine's piecewise CUDA graphs "
                   "(needs --kernels triton --device cuda; chunks padded as the engine pads them).")
@click.option("--images", type=int, default=None, metavar="N",
              help="Image prompts checked besides the text (Vision-Exp checkpoints; default 2 "
                   "there, 0 elsewhere): synthetic images of the built-in sizes.")
@click.option("--drafts", is_flag=True, default=False,
              help="Also check the checkpoint's drafter (speculative decoding: Flash's MTP "
                   "block, 0731's DSpark) against the reference's drafts after every 48 "
                   "tokens of each prompt: a fourth gate.")
def verify(original, converted, tp, prompts_file, max_positions, activations, device, json_out,
           kv_cache_dtype, kernels, long_context, chunk, reference_device, prefill_graphs,
           images, drafts) -> None:
    """Logit parity: runtime on CONVERTED vs the independent reference on ORIGINAL.

    Prints a weight table (every tensor dequantized vs the original), per-layer hidden-state
    errors and logit metrics (KL, top-1/top-5 agreement, max |dlogit|); exits 1 when the
    documented thresholds (docs/VERIFICATION.md) are breached.
    """
    import json as _json
    from pathlib import Path as _P

    from backfit.verify.run import verify as run_verify
    prompts = None
    if prompts_file:
        text = _P(prompts_file).read_text()
        prompts = _json.loads(text) if prompts_file.endswith(".json") else \
            [p.strip() for p in text.split("\n\n") if p.strip()]
    try:
        report = run_verify(original, converted, tp=tp, prompts=prompts, max_positions=max_positions,
                            activations=activations, device=device, json_out=json_out,
                            kv_cache_dtype=kv_cache_dtype, kernels=kernels,
                            long_context=long_context, chunk=chunk,
                            reference_device=reference_device, prefill_graphs=prefill_graphs,
                            images=images, drafts=drafts)
    except (ValueError, *_user_errors()) as e:
        _fail(e)
    sys.exit(0 if report["ok"] else 1)


def engine_options(f):
    """Engine flags shared by generate and serve (named as vLLM's)."""
    opts = [
        click.option("--tp", type=int, default=None, help="Tensor-parallel ranks (default: the "
                     "converted tp). Each rank is its own process; this one is rank 0."),
        click.option("--device", default="cpu", show_default=True, help="cpu or cuda."),
        click.option("--kernels", type=click.Choice(["triton", "torch"]), default=None,
                     help="GPU kernels: triton (default on CUDA) or the plain-torch reference "
                          "path (default on CPU; triton needs --device cuda)."),
        click.option("--enforce-eager", is_flag=True, default=False,
                     help="No CUDA graphs: run every step eagerly (graphs are used with "
                          "--kernels triton on CUDA; they cost start-up time and memory)."),
        click.option("--prefill-graph-tokens", type=int, default=None,
                     help="Prefill and mixed steps of up to this many tokens replay piecewise "
                          "CUDA graphs (the attention cores between them run eagerly; a step is "
                          "padded to the next of 64, 128, 256, ...). 0 = eager prefill. Default: "
                          "2048 (or the token budget, if smaller) where the graphs cost at most "
                          "10% of the KV capacity, else 0."),
        click.option("--async-scheduling/--no-async-scheduling", default=None,
                     help="Overlap each step's host work (reading the sampled tokens, "
                          "detokenizing, stops, scheduling) with the next step on the GPU; "
                          "outputs come one step later. Default: on with --device cuda, off "
                          "on CPU, where it gains nothing."),
        click.option("--dtype", "--activations", "dtype", default="bfloat16", show_default=True,
                     type=click.Choice(["bfloat16", "float32"]), help="Activation dtype."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "bf16", "int8"]),
                     default="auto", show_default=True, help="Cache storage: auto = the activation "
                     "dtype; int8 = one FP32 scale per 512-d entry, dequantized on read."),
        click.option("--max-model-len", type=int, default=None,
                     help="Longest prompt + output, in tokens. Default: the longest the KV pool "
                          "holds (a multiple of the block size), up to the model's own limit "
                          "(as vLLM picks it); serve prints it once ready."),
        click.option("--max-num-seqs", type=int, default=None,
                     help="Sequences running at once (default 64; generate: the prompt count)."),
        click.option("--max-num-batched-tokens", type=int, default=None,
                     help="Tokens per engine step (prefill chunks + decode tokens). Default: "
                     "8192 on CUDA where it costs at most 10% of the KV capacity, else 2048 "
                     "(steps above --prefill-graph-tokens run eagerly, and a 43-layer TP-4 "
                     "rank's eager step costs ~0.3 s of host time up to ~8K tokens, so one "
                     "8K chunk beats four: an 8K prompt's TTFT 1.1 s -> 0.44 s on an H200)."),
        click.option("--block-size", type=int, default=None,
                     help="Tokens per cache block, a multiple of every compression ratio "
                          "(default: the smallest such multiple >= 64)."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True,
                     show_default=True, help="Reuse cached blocks of shared prompt prefixes."),
        click.option("--num-snapshot-slots", type=int, default=None,
                     help="Prefix-cache snapshots (default: max-num-seqs; docs/ENGINE.md §3)."),
        click.option("--prefix-snapshot-interval", type=int, default=None, metavar="BLOCKS",
                     help="A prefix-cache snapshot every this many blocks of a prompt (0: only at "
                          "hints and prompt ends; default: the token budget in blocks)."),
        click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=True,
                     show_default=True, help="Split long prompts across steps, next to decodes."),
        click.option("--gpu-memory-utilization", type=float, default=0.90, show_default=True,
                     help="Share of the card for weights, activations and the cache pools."),
        click.option("--cpu-kv-cache-gib", type=float, default=4.0, show_default=True,
                     help="Cache pool budget on CPU."),
        click.option("--speculative-config", default=None, metavar="JSON",
                     help='Speculative decoding, as vLLM\'s: \'{"method": "mtp", '
                          '"num_speculative_tokens": 3}\' (DeepSeek-V4-Flash\'s MTP block) or '
                          '\'{"method": "dspark", "num_speculative_tokens": 5}\' (the 0731 '
                          'DSpark drafter, up to 5). Lossless: the same tokens (greedy) or the '
                          'same distribution (sampling) as without. Published deployments '
                          'settle at k = 3-5 (docs/SPECULATIVE.md). Optional key '
                          '"disable_by_batch_size".'),
        click.option("--speculative-disable-by-batch-size", type=int, default=None,
                     help="Decode without drafts while more requests than this are decoding "
                          "(speculation costs more than it saves at large batches; default 4, "
                          "measured: docs/SPECULATIVE.md)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def engine_kwargs(kw: dict) -> dict:
    """Pop the engine flags out of a command's keyword arguments -> EngineConfig fields."""
    names = ("device", "kernels", "enforce_eager", "prefill_graph_tokens", "async_scheduling",
             "dtype", "kv_cache_dtype", "max_model_len", "max_num_batched_tokens", "block_size",
             "enable_prefix_caching", "num_snapshot_slots", "prefix_snapshot_interval",
             "enable_chunked_prefill", "gpu_memory_utilization", "cpu_kv_cache_gib")
    out = {n: kw.pop(n) for n in names}
    out.update(speculative_kwargs(kw.pop("speculative_config", None),
                                  kw.pop("speculative_disable_by_batch_size", None)))
    if kw.get("max_num_seqs") is not None:
        out["max_num_seqs"] = kw.pop("max_num_seqs")
    kw.pop("max_num_seqs", None)
    return out


def speculative_kwargs(config: str | None, disable_by_batch_size: int | None) -> dict:
    """--speculative-config JSON (+ --speculative-disable-by-batch-size) -> EngineConfig fields;
    click.BadParameter names what is wrong."""
    import json
    if config is None:
        if disable_by_batch_size is not None:
            raise click.BadParameter("needs --speculative-config",
                                     param_hint="--speculative-disable-by-batch-size")
        return {}
    try:
        spec = json.loads(config)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON ({e})", param_hint="--speculative-config") from None
    known = {"method", "num_speculative_tokens", "disable_by_batch_size"}
    if not isinstance(spec, dict) or "method" not in spec or set(spec) - known:
        raise click.BadParameter(f"expected an object with \"method\" and optionally "
                                 f"{sorted(known - {'method'})}, got {config}",
                                 param_hint="--speculative-config")
    k = spec.get("num_speculative_tokens", 3 if spec["method"] == "mtp" else 5)
    if not isinstance(k, int) or isinstance(k, bool):
        raise click.BadParameter(f"num_speculative_tokens must be an integer, got {k!r}",
                                 param_hint="--speculative-config")
    out = {"speculative_method": spec["method"], "num_speculative_tokens": k}
    limit = disable_by_batch_size if disable_by_batch_size is not None else \
        spec.get("disable_by_batch_size")
    if limit is not None:
        out["speculative_disable_by_batch_size"] = limit
    return out


@main.command()
@click.argument("converted", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", default=None, help="Raw text; BOS is prepended, no chat template.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="One raw-text prompt per line, all in flight at once.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Per-request seed (reproducible).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True)
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable); not printed.")
@click.option("--ignore-eos", is_flag=True, help="Keep going past the end-of-sentence token.")
@engine_options
def generate(converted, prompt, prompts_file, tp, **kw) -> None:
    """Generate from raw-text prompts with the engine on a converted directory (printed as produced)."""
    from pathlib import Path as _P

    from backfit.engine.sampling_params import SamplingParams
    from backfit.generate import generate as run_generate
    if (prompt is None) == (prompts_file is None):
        _fail(click.UsageError("give exactly one of --prompt and --prompts-file"))
    prompts = [prompt] if prompt is not None else \
        [ln for ln in _P(prompts_file).read_text().splitlines() if ln.strip()]
    if not prompts:
        _fail(ValueError(f"{prompts_file}: no prompts (one per line)"))
    ekw = engine_kwargs(kw)
    try:
        params = SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"],
                                top_p=kw["top_p"], top_k=kw["top_k"], min_p=kw["min_p"],
                                seed=kw["seed"], presence_penalty=kw["presence_penalty"],
                                frequency_penalty=kw["frequency_penalty"],
                                repetition_penalty=kw["repetition_penalty"], stop=kw["stop"],
                                ignore_eos=kw["ignore_eos"], skip_special_tokens=False)
        run_generate(converted, prompts, params, tp=tp, **ekw)
    except (ValueError, *_user_errors()) as e:
        _fail(e)


@main.command()
@click.argument("converted", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--served-model-name", default="deepseek-v4-flash", show_default=True,
              help="The model id clients see (any requested model name is accepted).")
@click.option("--alias", "aliases", multiple=True, help="Extra model ids listed by /v1/models.")
@click.option("--api-key", default=None, envvar="BACKFIT_API_KEY",
              help="Require this key (Authorization: Bearer or x-api-key) on /v1 paths.")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests admitted beyond --max-num-seqs; more get 429 (529 on Anthropic).")
@click.option("--keepalive", type=float, default=10.0, show_default=True,
              help="Seconds of silence before an SSE keep-alive comment / ping.")
@click.option("--limit-mm-per-prompt", "limit_mm", default=None, metavar="JSON",
              help="Images one request may hold, as vLLM's '{\"image\": N}' (default 96; "
                   "Vision-Exp checkpoints). More are a 400.")
@click.option("--allowed-media-domains", "media_domains", multiple=True, metavar="HOST",
              help="Hosts (and their subdomains) image URLs may be fetched from; repeat or "
                   "comma-separate. Default: any host (data: URLs are always accepted).")
@click.option("--default-max-tokens", type=int, default=None,
              help="Output cap (reasoning included) of a request that sets none (Codex sends "
                   "none). Default: the rest of the context.")
@click.option("--override-generation-config", default=None, metavar="JSON",
              help="vLLM's flag; '{\"max_new_tokens\": N}' is --default-max-tokens N (no other "
                   "key is served).")
@click.option("--default-chat-template-kwargs", default=None, metavar="JSON",
              help="vLLM's flag: '{\"thinking\": false}' (or enable_thinking, "
                   "reasoning_effort) for requests that do not choose (default: thinking on).")
@click.option("--shutdown-timeout", type=float, default=0.0, show_default=True,
              help="On SIGINT/SIGTERM, let admitted requests finish for up to this many seconds "
                   "(/health and new requests answer 503 at once; a second signal ends them). "
                   "0: open streams end with an error event at once.")
@engine_options
def serve(converted, host, port, served_model_name, aliases, api_key, max_queue, keepalive,
          limit_mm, media_domains, shutdown_timeout, default_max_tokens,
          override_generation_config, default_chat_template_kwargs, tp, **kw) -> None:
    """Serve CONVERTED over HTTP: OpenAI Chat Completions, Responses, legacy Completions and
    Anthropic Messages (docs/API.md). /health answers 503 until the model is loaded; SIGINT or
    SIGTERM shuts down cleanly (a drain with --shutdown-timeout; open streams end with an error
    event, rank processes exit). Behind a router: docs/DEPLOY.md."""
    import logging

    from backfit.server.app import chat_template_defaults
    from backfit.server.app import default_max_tokens as resolve_cap
    from backfit.server.app import serve as run_serve
    from backfit.server.images import MediaLimits, parse_limit
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ekw = engine_kwargs(kw)
    try:
        hosts = tuple(h.strip().lower() for d in media_domains for h in d.split(",") if h.strip())
        limit = parse_limit(limit_mm) if limit_mm else MediaLimits.max_images
        media = MediaLimits(max_images=limit, allowed_domains=hosts or None)
        cap = resolve_cap(default_max_tokens, override_generation_config)
        chat_defaults = chat_template_defaults(default_chat_template_kwargs)
        run_serve(converted, host, port, served_model_name=served_model_name, api_key=api_key,
                  max_queue=max_queue, keepalive_s=keepalive, aliases=tuple(aliases),
                  shutdown_timeout=shutdown_timeout, tp=tp, default_max_tokens=cap,
                  chat_defaults=chat_defaults, media=media, **ekw)
    except (ValueError, OSError, *_user_errors()) as e:
        _fail(e)


@main.command()
@click.argument("model")
@click.option("--tp", type=click.Choice(["1", "2", "4", "8"]), default=None,
              help="Tensor-parallel ranks (default: a converted MODEL's tp, else 4).")
@click.option("--gpu-mem", default="80GiB", show_default=True,
              help="Memory of one card (80GiB, 80GB, 81920MiB).")
@click.option("--gpu-memory-utilization", type=float, default=0.90, show_default=True,
              help="Share of the card the engine may use: weights, reserves and KV pools.")
@click.option("--experts", type=click.Choice(["int8", "bf16", "mx4"]), default=None,
              help="Routed-expert scheme (default: a converted MODEL's, else int8); mx4 is the "
                   "4-bit scheme of convert --experts mx4 (0.5 B + 1 exponent byte per 32).")
@click.option("--kv-cache-dtype", type=click.Choice(["bf16", "int8"]), default="bf16",
              show_default=True, help="int8: one FP32 scale per 512-d entry, ~40% fewer bytes.")
@click.option("--max-model-len", type=int, default=None,
              help="Longest sequence (default: the longest that fits, up to the model's limit).")
@click.option("--max-num-seqs", type=int, default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Tokens per step (default: the engine's on CUDA: 8192 where it costs at "
                   "most 10% of the KV capacity, else 2048).")
@click.option("--prefill-graph-tokens", type=int, default=None,
              help="Count prefill graphs up to this many tokens (0: none; default: the "
                   "engine's, up to 2048 where they cost at most 10% of the KV capacity).")
@click.option("--num-snapshot-slots", type=int, default=None,
              help="Prefix-cache snapshot slots (default: max-num-seqs).")
@click.option("--block-size", type=int, default=None,
              help="Tokens per cache block (default: the smallest multiple of every "
                   "compression ratio >= 64, as the engine).")
@click.option("--mtp/--no-mtp", default=False, show_default=True,
              help="Count the MTP draft block's weights and window ring (the engine does not "
                   "load it yet; speculative decoding will).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(model, tp, gpu_mem, gpu_memory_utilization, experts, kv_cache_dtype, max_model_len,
         max_num_seqs, max_num_batched_tokens, prefill_graph_tokens, num_snapshot_slots,
         block_size, mtp, as_json) -> None:
    """Memory plan per rank: weights, activation workspace, CUDA-graph reserve, KV bytes per
    token and per sequence, KV capacity, longest context and concurrency. MODEL is an original
    or converted directory or a bare config.json. Exits 1 when --max-model-len does not fit."""
    import json as _json

    from backfit.capacity import format_plan, parse_bytes
    from backfit.capacity import plan as run_plan
    try:
        p = run_plan(model, tp=int(tp) if tp else None, gpu_mem=parse_bytes(gpu_mem),
                     utilization=gpu_memory_utilization, experts=experts,
                     kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     num_snapshot_slots=num_snapshot_slots, mtp=mtp, block_size=block_size,
                     prefill_graph_tokens=prefill_graph_tokens)
    except (ValueError, *_user_errors()) as e:
        _fail(e)
    click.echo(_json.dumps(p.to_dict(), indent=1) if as_json else format_plan(p))


@main.command()
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to build the demo (default: ~/.cache/backfit/demo).")
@click.option("--serve", is_flag=True, help="Keep the demo server up on 127.0.0.1:8000.")
def demo(workdir: str | None, serve: bool) -> None:
    """Build the tiny built-in DeepSeek-V4 checkpoint, convert, verify, generate and serve it
    (one request per protocol through the SDKs), explaining each step. Exits 1 if a parity
    check fails."""
    from backfit.demo import run_demo
    try:
        report = run_demo(workdir, serve=serve)
    except _user_errors() as e:
        _fail(e)
    if not all(r["ok"] for r in report.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
