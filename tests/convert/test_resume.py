"""Atomic and resumable: a converter killed mid-way resumes to byte-identical output, a journal
from other options is never mixed in, a journal entry whose files changed is redone, and the
parallel converter writes the same bytes as one worker."""

import filecmp
import hashlib
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time

import pytest
from safetensors import safe_open

import backfit.convert.run as run_mod
from backfit.convert.run import ConvertError, convert
from backfit.formats import load_manifest, rank_dir

from support import clone_checkpoint, materialize


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
    convert(tiny_flash, dst, tp=2, progress=False, workers=3)      # parallel, even on one core
    return dst


def test_one_worker_writes_the_same_bytes(tiny_flash, clean, tmp_path):
    convert(tiny_flash, tmp_path / "dst", tp=2, progress=False, workers=1)
    _same_tree(tmp_path / "dst", clean)


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
    done = re.search(r"resuming: (\d) of 9 shards", r.stdout)          # parallel: 3 or a few more
    assert done and 3 <= int(done.group(1)) < 9, r.stdout
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


def _interrupted(monkeypatch, src, dst, shards, **opts) -> list[str]:
    """Run a conversion (one worker) that is interrupted once `shards` shards are journaled;
    returns their file names in the order they were done."""
    orig, done = run_mod.convert_shard, []

    def stop_after(*a, **k):
        if len(done) == shards:
            raise KeyboardInterrupt
        entry = orig(*a, **k)
        done.append(a[0].name)
        return entry
    with monkeypatch.context() as m:
        m.setattr(run_mod, "convert_shard", stop_after)
        with pytest.raises(KeyboardInterrupt):
            convert(src, dst, progress=False, workers=1, **opts)
    journal = dst.with_name(dst.name + ".partial") / ".journal"
    assert sorted(p.stem for p in journal.glob("model-*.json")) == sorted(done)
    return done


@pytest.mark.parametrize("opts", [{"tp": 2, "linears": "bf16"}, {"tp": 1}])
def test_real_journal_from_other_options_restarts(tiny_flash, clean, tmp_path, monkeypatch, opts):
    dst = tmp_path / "dst"
    _interrupted(monkeypatch, tiny_flash, dst, 3, **opts)
    out = io.StringIO()
    convert(tiny_flash, dst, tp=2, progress=False, out=out)
    assert "starting over" in out.getvalue() and "resuming" not in out.getvalue(), out.getvalue()
    _same_tree(dst, clean)                                   # nothing of the other run is left


def test_journal_entry_whose_files_changed_is_redone(tiny_flash, clean, tmp_path, monkeypatch):
    src, dst = clone_checkpoint(tiny_flash, tmp_path / "src"), tmp_path / "dst"
    a, b, c = _interrupted(monkeypatch, src, dst, 3, tp=2)
    partial = tmp_path / "dst.partial"
    out_a = rank_dir(partial, 1) / a                          # a done output, truncated
    out_a.write_bytes(out_a.read_bytes()[:-100])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(n for n, f in index["weight_map"].items()
                if f == b and n.endswith("attn_norm.weight"))
    raw = bytearray(materialize(src / b).read_bytes())       # source changed, same size
    (hlen,) = struct.unpack("<Q", raw[:8])
    off = 8 + hlen + json.loads(raw[8:8 + hlen])[name]["data_offsets"][0]
    raw[off:off + 2] = b"\xc0\x3f"                              # bf16 1.5 at element 0
    (src / b).write_bytes(bytes(raw))
    out = io.StringIO()
    convert(src, dst, tp=2, progress=False, out=out)
    log = out.getvalue()
    assert f"redoing {a}" in log and f"redoing {b}" in log and f"redoing {c}" not in log, log
    assert "resuming: 1 of 9" in log, log
    m = load_manifest(dst)
    assert m["source"]["files"][b]["sha256"] == hashlib.sha256(raw).hexdigest()
    with safe_open(rank_dir(dst, 0) / b, framework="pt") as f:
        assert f.get_tensor(name)[0].item() == 1.5               # b was converted again
    changed = {"manifest.json", f"rank0/{b}", f"rank1/{b}"}
    assert _tree(dst) == _tree(clean)
    for f in _tree(dst):
        if f not in changed:
            assert filecmp.cmp(dst / f, clean / f, shallow=False), f


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
