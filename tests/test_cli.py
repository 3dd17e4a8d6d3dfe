"""The command line: instant --help (no torch, no triton), helpful text, demo end to end."""

import os
import subprocess
import sys


def _run(*args, **kw):
    # one OpenMP thread: on a shared 2-core box two threads stall whenever a core is busy
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True,
                          env=env, **kw)


def test_help_imports_neither_torch_nor_triton():
    code = ("import sys; from click.testing import CliRunner; from backfit.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output; "
            "r2 = CliRunner().invoke(main, ['convert', '--help']); assert r2.exit_code == 0; "
            "print(r.output); print(r2.output); "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'heavy import'")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "convert" in r.stdout and "demo" in r.stdout
    for needle in ("--tp", "--linears", "--experts", "--force", "DST.partial", "bit-exact"):
        assert needle in r.stdout, needle


def test_console_script_and_version():
    r = _run("-m", "backfit.cli", "--version")
    assert r.returncode == 0 and "backfit" in r.stdout


def test_demo_runs_on_cpu(tmp_path):
    r = _run("-m", "backfit.cli", "demo", "--dir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr
    assert "converted to backfit-dsv4" in r.stdout and "bit-exact: yes" in r.stdout
    assert "semantics check: PASS" in r.stdout and "[5/7] backfit generate" in r.stdout
    assert "speculative: mean accepted length" in r.stderr        # generate's summary line
    assert "[6/7] backfit serve" in r.stdout and "openai chat.completions: finish=" in r.stdout
    assert "[7/7] an image request" in r.stdout and "with a 320x400 PNG" in r.stdout
    assert (tmp_path / "demo" / "converted-int8-tp4" / "manifest.json").exists()
