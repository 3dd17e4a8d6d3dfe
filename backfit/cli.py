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
    return ConvertError, CheckpointError, ConfigError


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
@click.option("--experts", type=click.Choice(["int8", "bf16"]), default="int8", show_default=True,
              help="MXFP4 routed experts: int8 = bit-exact INT8 with per-(row, 32) power-of-two "
                   "scales; bf16 = lossless too, 2x bytes (verification / big machines).")
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
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="Where to build the demo (default: ~/.cache/backfit/demo).")
def demo(workdir: str | None) -> None:
    """Build the tiny built-in DeepSeek-V4 checkpoint and convert it, explaining each step."""
    from backfit.demo import run_demo
    try:
        run_demo(workdir)
    except _user_errors() as e:
        _fail(e)


if __name__ == "__main__":
    main()
