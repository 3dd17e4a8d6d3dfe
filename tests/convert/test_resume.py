"""Atomic and resumable: a converter killed mid-way resumes to byte-identical output."""

import filecmp
import os
import signal
import subprocess
import sys
import time

import pytest

from backfit.convert.run import ConvertError, convert
from backfit.formats import rank_dir


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _same_tree(a, b):
    files = _tree(a)
    assert files == _tree(b)
    for f in files:
        assert filecmp.cmp(a / f, b / f, shallow=False), f


@pytest.fixture(scope="module")
def clean(tiny_flash, tmp_path_factory):
    dst = tmp_path_factory.mktemp("clean") / "dst"
    convert(tiny_flash, dst, tp=2, progress=False)
    return dst


def test_killed_converter_resumes_byte_identical(tiny_flash, clean, tmp_path):
    dst = tmp_path / "dst"
    journal = tmp_path / "dst.partial" / ".journal"
    proc = subprocess.Popen([sys.executable, "-m", "backfit.cli", "convert", str(tiny_flash), str(dst),
                             "--tp", "2", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(list(journal.glob("model-*.json"))) >= 3:
            break
        time.sleep(0.005)
    assert proc.poll() is None, "converter finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dst.exists() and (tmp_path / "dst.partial").exists()
    r = subprocess.run([sys.executable, "-m", "backfit.cli", "convert", str(tiny_flash), str(dst),
                        "--tp", "2", "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming: 3 of 9" in r.stdout or "resuming: 4 of 9" in r.stdout, r.stdout
    _same_tree(dst, clean)
    assert not (tmp_path / "dst.partial").exists()


def test_stale_tmp_files_are_overwritten(tiny_flash, clean, tmp_path):
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        calls = {"n": 0}

        def interrupt(n):
            calls["n"] += 1
            if calls["n"] == 40:
                raise KeyboardInterrupt
        import backfit.convert.run as run_mod
        orig = run_mod.convert_shard
        run_mod.convert_shard = lambda *a, **k: orig(*a[:4], on_progress=interrupt)
        try:
            convert(tiny_flash, dst, tp=2, progress=False)
        finally:
            run_mod.convert_shard = orig
    assert list(rank_dir(tmp_path / "dst.partial", 0).glob("*.tmp"))
    convert(tiny_flash, dst, tp=2, progress=False)
    _same_tree(dst, clean)


def test_partial_with_other_options_restarts(tiny_flash, clean, tmp_path):
    partial = tmp_path / "dst.partial"
    rank_dir(partial, 0).mkdir(parents=True)
    (rank_dir(partial, 0) / "junk.safetensors").write_bytes(b"junk")
    convert(tiny_flash, tmp_path / "dst", tp=2, progress=False)
    _same_tree(tmp_path / "dst", clean)


def test_hf_repo_id_from_local_cache(tiny_flash, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = cache / "models--deepseek-ai--DeepSeek-V4-Flash" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in tiny_flash.iterdir():
        os.symlink(f, snap / f.name)
    (cache / "models--deepseek-ai--DeepSeek-V4-Flash" / "refs").mkdir()
    (cache / "models--deepseek-ai--DeepSeek-V4-Flash" / "refs" / "main").write_text("a" * 40)
    import huggingface_hub.constants as hfc
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(cache))      # read once at import by the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    m = convert("deepseek-ai/DeepSeek-V4-Flash", tmp_path / "dst", tp=1, progress=False)
    assert m["tp"] == 1
    with pytest.raises(ConvertError, match="not in the local Hugging Face cache"):
        convert("deepseek-ai/DeepSeek-V4-Pro", tmp_path / "dst2", tp=1, progress=False)
