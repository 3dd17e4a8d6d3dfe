"""Time mHC's hc_pre / hc_head at prefill sizes on one GPU: today's path (torch FP32 matmul
logits + _collapse_kernel, mhc.PREFILL = "torch") against the tiled path ("tiled":
_mix_tile_kernel + _collapse_tile_kernel) in a few candidate configs.

Real DeepSeek-V4-Flash dims: S 4, d 4096 (K 16384), n_out 24 (hc_pre) and 4 (hc_head);
T = 128 (just past MIX_TORCH_T), 1024 and 8192. Each figure is the median of CUDA-graph replays
of `rot` calls on disjoint X buffers (working set past the 50 MB L2), against the bytes a call
must move: X read once (T·S·d·2) + u written (T·d·2), as a fraction of the copy bandwidth
(read + write of a 2 GiB copy) measured in the same run (the tiled path reads X twice, so its
own floor is ~0.55 of that). Errors against the torch reference (runtime.model.hyper, torch
backend): post / M max abs error over max |reference|; u in test_mhc's ulps (<= 1 passes) and
its excess over one bf16 spacing relative to Σ|terms| (the gates' FP32 noise). `same`: the
fraction of u / post / M elements bit-identical to today's path.
--decode instead times one mHC pair at decode (hc_post of the previous sub-layer + the next
hc_pre + its RMSNorm), T 1 / 8 / 63 (64 = MIX_TORCH_T takes the prefill path): today's 4
launches (mhc._post_kernel, _mix_partial_kernel, _collapse_kernel, rope_norm._rms_kernel)
against kernels.mhc.decode's 2 (_post_mix_kernel, _collapse_norm_kernel) at a few (bd, warps),
and the 3-launch middle (plain hc_post, then hc_pre's own partials + collapse-norm); then the
decode Block's pair as the model runs it (hc_post + hc_pre_async, the Sinkhorn on a side stream)
against the fold (hc_post(pre=): the critical collapse in hc_post's last programs, 2026-12-02)
at a few (bd_u, warps). Each figure:
one CUDA-graph replay of PAIRS pairs on disjoint fn / X sets (fn from HBM, as in a real step),
divided by PAIRS (graph-node gaps included). Errors on set 0, max abs over max |reference|: Y
against hc_post's FP32 value, normed u (FP32 value before the cast), post, M against the torch
hc_pre + RMSNorm on the variant's own Y; `same`: bit-equal fractions against today's path.
Usage: python benchmarks/kernels/bench_mhc.py [--out bench_mhc.json] [--quick] [--decode]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from backfit.runtime.kernels.mhc import core as mhc
from backfit.runtime.model import hyper
from harness import copy_bandwidth, graph_time  # noqa: E402

S, D, ITERS, HC_EPS, NORM_EPS = 4, 4096, 20, 1e-6, 1e-6
L2_BYTES = 200 << 20
FP32_NOISE = 1e-6                           # as tests/runtime/kernels/test_mhc.py
# candidates of the tiled path: tile_config() overrides (None = tile_config's own guess)
CANDIDATES = [None, dict(MMA3=False), dict(BT=64, BK=32, warps=4), dict(BK=128),
              dict(split=3), dict(split=8), dict(split=16), dict(BT=256, BK=32, split=8),
              dict(BTU=1, BD=4096), dict(BTU=4, BD=512)]


def rel_max(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def ulps(u, want, mag) -> float:
    """max (|u - want| - FP32_NOISE·mag) in bf16 spacings at |want| (want the reference's FP32
    value, mag its Σ|terms|), as test_mhc.ulps: <= 1 passes the tests."""
    w = want.double()
    spacing = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    return (((u.double() - w).abs() - FP32_NOISE * mag.double()) / spacing).max().item()


def excess(u, want, mag) -> float:
    """max (|u - want| - one bf16 spacing at |want|) / mag: u's error beyond its own rounding,
    relative to Σ|terms| (the gates' FP32 noise, ~1e-6; ulps blow up where streams cancel)."""
    w = want.double()
    spacing = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)
    return (((u.double() - w).abs() - spacing).clamp_min(0) / mag.double()).max().item()


def same(a, b) -> float:
    return (a == b).float().mean().item()


def case(kind, T, bw, gen, quick):
    n_out = (2 + S) * S if kind == "hc_pre" else S
    fn = (torch.randn(n_out, S * D, generator=gen) * 0.02).cuda()
    scale, base = torch.randn(3, generator=gen).cuda(), torch.randn(n_out, generator=gen).cuda()
    per = T * S * D * 2
    rot = max(1, min(8, round(L2_BYTES / per)))
    Xs = [(torch.randn(T, S, D, device="cuda") * torch.rand(T, S, 1, device="cuda").add(0.2) * 3)
          .bfloat16() for _ in range(rot)]
    X = Xs[0]
    if kind == "hc_pre":
        call = lambda X, **kw: mhc.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, **kw)  # noqa: E731
        _, post_ref, M_ref = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
        m = hyper._mix_logits(X, fn, NORM_EPS)
        pre = torch.sigmoid(m[:, :S] * scale[0] + base[:S]) + HC_EPS
    else:
        call = lambda X, **kw: (mhc.hc_head(X, fn, scale, base, HC_EPS, NORM_EPS, **kw),)  # noqa: E731
        m = hyper._mix_logits(X, fn, NORM_EPS)
        pre = torch.sigmoid(m * scale[0] + base) + HC_EPS
    u32 = torch.einsum("ts,tsd->td", pre, X.float())
    mag = torch.einsum("ts,tsd->td", pre.abs(), X.float().abs())
    today = call(X, prefill="torch")
    rows = []
    for name, kw in [("torch", dict(prefill="torch"))] + [
            (f"tiled {json.dumps(c) if c else 'default'}", dict(prefill="tiled", tile=c))
            for c in (CANDIDATES[:3] if quick else CANDIDATES)]:
        t0 = time.time()
        try:
            out = call(X, **kw)
            t = graph_time(lambda: [call(x, **kw) for x in Xs]) / rot
        except Exception as e:                      # a config that does not compile / fit
            rows.append(dict(kind=kind, T=T, path=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"{kind:7s} T {T:5d} {name:60s} FAILED {rows[-1]['error']}", flush=True)
            continue
        r = dict(kind=kind, T=T, path=name, us=t * 1e6, roofline=(per + T * D * 2) / t / bw,
                 u_ulps=ulps(out[0], u32, mag),
                 u_excess=excess(out[0], u32, mag), u_same=same(out[0], today[0]),
                 wall_s=time.time() - t0)
        if kind == "hc_pre":
            r.update(post_err=rel_max(out[1], post_ref), M_err=rel_max(out[2], M_ref),
                     post_same=same(out[1], today[1]), M_same=same(out[2], today[2]))
        rows.append(r)
        errs = f"u {r['u_ulps']:.2f} ulp {r['u_excess']:.1e} mag"
        if kind == "hc_pre":
            errs += f" post {r['post_err']:.1e} M {r['M_err']:.1e}"
        sm = " ".join(f"{k[:-5]} {v:.3f}" for k, v in r.items() if k.endswith("_same"))
        print(f"{kind:7s} T {T:5d} {name:60s} {r['us']:8.1f} us {100 * r['roofline']:5.1f}% copy-bw"
              f"  {errs}  same as today: {sm}", flush=True)
    return rows


PAIRS = 48                                  # 48 x 1.5 MB of fn: past the 50 MB L2 (H200)
RMS_EPS = 1e-6
# mhc_decode candidates: hc_post's d block (None = post_bd), the collapse-norm (warps, d block,
# scalar Sinkhorn); mhc_decode's defaults: collapse_config(T)
DECODE_CANDIDATES = [(None, 4, 1024, True), (None, 4, 1024, False), (None, 1, 256, True),
                     (None, 1, 1024, True), (None, 2, 1024, True), (None, 8, 4096, True),
                     (None, 8, 4096, False), (16, 4, 1024, True), (64, 4, 1024, True),
                     (128, 4, 1024, True)]


# hc_post(pre=)'s tail (2026-12-02): (bd_u, warps of the post-mix launch); FOLD's first
FOLD_CANDIDATES = [(1024, 4), (4096, 4), (2048, 4), (1024, 8), (4096, 8), (512, 4)]


def decode_case(T, bw, gen, device="cuda", d=D, pairs=PAIRS, timer=graph_time):
    """Rows of the decode pair at T tokens; device, d, pairs, timer: a CPU smoke run."""
    from backfit.runtime.kernels.mhc import decode as mhc_decode
    from backfit.runtime.kernels.rope_norm import rms_norm
    n_out = (2 + S) * S
    sets = []
    for _ in range(pairs):
        X = (torch.randn(T, S, d, device=device) * torch.rand(T, S, 1, device=device).add(0.2)
             * 3).bfloat16()
        sets.append(dict(X=X, f=torch.randn(T, d, device=device).bfloat16(),
                         post=torch.rand(T, S, device=device) * 2,
                         M=torch.softmax(torch.randn(T, S, S, device=device), -1),
                         fn=torch.randn(n_out, S * d, device=device) * 0.02))
    scale = torch.randn(3, generator=gen).to(device)
    base = torch.randn(n_out, generator=gen).to(device)
    w = torch.rand(d, generator=gen).to(device) + 0.5

    def old(z):
        Y = mhc.hc_post(z["f"], z["X"], z["post"], z["M"])
        u, p, M = mhc.hc_pre(Y, z["fn"], scale, base, ITERS, HC_EPS, NORM_EPS)
        return Y, rms_norm(u, w, RMS_EPS), p, M

    def new(z, bd, warps, bd_u, scalar, fused=True):
        if fused:
            Y, part = mhc_decode.hc_post(z["f"], z["X"], z["post"], z["M"], next_fn=z["fn"], bd=bd)
        else:
            Y, part = mhc_decode.hc_post(z["f"], z["X"], z["post"], z["M"], bd=bd), None
        return (Y,) + mhc_decode.hc_pre(Y, z["fn"], scale, base, ITERS, HC_EPS, NORM_EPS,
                                        norm=(w, RMS_EPS), part=part, warps=warps, bd=bd_u,
                                        scalar=scalar)
    z = sets[0]
    Y32 = (z["post"][:, :, None] * z["f"].float()[:, None, :]
           + torch.einsum("tjk,tjd->tkd", z["M"], z["X"].float()))
    today = old(z)

    def pre_ref(Y):
        """torch hc_pre + RMSNorm (FP32, before the cast) on a variant's own streams Y."""
        u, post, M = hyper.hc_pre(Y, z["fn"], scale, base, ITERS, HC_EPS, NORM_EPS)
        uf = u.float()
        return uf * torch.rsqrt(uf.square().mean(-1, keepdim=True) + RMS_EPS) * w, post, M
    # bytes a pair must move: X read, Y written and read back, fn read, u written
    need = 3 * T * S * d * 2 + n_out * S * d * 4 + T * d * 2
    variants = [("old 4 launches", old), ("new 3 (no part)", lambda z: new(z, None, None, None, None, False))]
    variants += [((f"new 2 bd {bd or mhc_decode.post_bd(T, d)} warps {wp} bd_u {bu}"
                   f"{' scalar' if sc else ''}"),
                  lambda z, bd=bd, wp=wp, bu=bu, sc=sc: new(z, bd, wp, bu, sc))
                 for bd, wp, bu, sc in DECODE_CANDIDATES]
    pending = []                                    # side-stream Sinkhorns, joined per replay
    nxt = mhc_decode.NextPre(scale, base, w, RMS_EPS, HC_EPS, NORM_EPS)

    def model_pair(z, fold, bd_u=None, warps=None):
        """The decode Block's pair: hc_post + hc_pre_async (its Sinkhorn beside), with or without
        the fold (hc_post(pre=): the critical collapse in hc_post's last programs)."""
        if fold:
            Y, part, u = mhc_decode.hc_post(z["f"], z["X"], z["post"], z["M"], next_fn=z["fn"],
                                            pre=nxt, bd_u=bd_u, warps=warps)
        else:
            (Y, part), u = mhc_decode.hc_post(z["f"], z["X"], z["post"], z["M"],
                                              next_fn=z["fn"]), None
        u, p, M, wait = mhc_decode.hc_pre_async(Y, z["fn"], scale, base, ITERS, HC_EPS,
                                                NORM_EPS, norm=(w, RMS_EPS), part=part, u=u)
        if wait is not None:
            pending.append(wait[0])
        return Y, u, p, M
    variants += [("model pair: 2 + Sinkhorn beside", lambda z: model_pair(z, False))]
    variants += [(f"model pair: fold bd_u {bu} warps {wp} + Sinkhorn beside",
                  lambda z, bu=bu, wp=wp: model_pair(z, True, bu, wp))
                 for bu, wp in FOLD_CANDIDATES]

    def joined(outs):
        for ev in pending:                          # the capture must rejoin its side stream
            torch.cuda.current_stream().wait_event(ev)
        pending.clear()
        return outs
    rows = []
    for name, call in variants:
        t0 = time.time()
        try:
            out = joined(call(z))
            t = timer(lambda call=call: joined([call(z) for z in sets])) / pairs
        except Exception as e:                      # a config that does not compile / fit
            rows.append(dict(kind="decode", T=T, path=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"decode  T {T:5d} {name:41s} FAILED {rows[-1]['error']}", flush=True)
            continue
        un32, post_ref, M_ref = pre_ref(out[0])
        r = dict(kind="decode", T=T, path=name, us=t * 1e6, roofline=need / t / bw,
                 Y_err=rel_max(out[0], Y32), un_err=rel_max(out[1], un32),
                 post_err=rel_max(out[2], post_ref), M_err=rel_max(out[3], M_ref),
                 Y_same=same(out[0], today[0]), un_same=same(out[1], today[1]),
                 wall_s=time.time() - t0)
        rows.append(r)
        print(f"decode  T {T:5d} {name:41s} {r['us']:7.2f} us/pair {100 * r['roofline']:5.1f}% "
              f"copy-bw  err Y {r['Y_err']:.1e} normed u {r['un_err']:.1e} post "
              f"{r['post_err']:.1e} M {r['M_err']:.1e}  same as today: Y {r['Y_same']:.3f} "
              f"normed u {r['un_same']:.3f}", flush=True)
    return rows


# --collapse: hc_pre_async's critical launch alone (gates + u + RMSNorm from a ready PART, no
# Sinkhorn) at (warps, d block); bd >= d is the one-pass form. mhc_decode.COLLAPSE_U holds the
# default, collapse_config(T) (4 warps / 1024 at T <= 4) the tile it had before 2026-12-01.
COLLAPSE_CANDIDATES = [(4, 1024), (4, 2048), (8, 2048), (2, 4096), (4, 4096), (8, 4096),
                       (16, 4096)]


def collapse_case(T, gen, device="cuda", d=D, pairs=PAIRS, timer=graph_time):
    """Rows: µs per critical collapse at T tokens for each candidate, and the normed u's error
    against the torch reference (hyper.hc_pre + RMSNorm in FP32)."""
    from backfit.runtime.kernels.mhc import decode as mhc_decode
    n_out = (2 + S) * S
    scale = torch.randn(3, generator=gen).to(device)
    base = torch.randn(n_out, generator=gen).to(device)
    w = torch.rand(d, generator=gen).to(device) + 0.5
    sets = []
    for _ in range(pairs):
        X = (torch.randn(T, S, d, device=device) * 3).bfloat16()
        fn = torch.randn(n_out, S * d, device=device) * 0.02
        part = mhc._partials(X, fn, triton.next_power_of_2(n_out + 1), None)
        outs = (torch.empty(T, d, dtype=X.dtype, device=device),
                torch.empty(T, S, device=device), torch.empty(T, S, S, device=device))
        sets.append((X, fn, part, outs))
    X, fn = sets[0][:2]
    u, _, _ = hyper.hc_pre(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    uf = u.float()
    want = uf * torch.rsqrt(uf.square().mean(-1, keepdim=True) + RMS_EPS) * w
    rows = []
    for warps, bd in COLLAPSE_CANDIDATES:
        def call(z, warps=warps, bd=bd):
            X, fn, part, outs = z
            return mhc_decode._collapse_norm(X, fn, scale, base, ITERS, HC_EPS, NORM_EPS, False,
                                             (w, RMS_EPS), part, warps, bd, outs=outs)[0]
        err = rel_max(call(sets[0]), want)
        t = timer(lambda call=call: [call(z) for z in sets]) / pairs
        rows.append(dict(kind="collapse", T=T, warps=warps, bd=bd, us=t * 1e6, un_err=err))
        print(f"collapse T {T:3d} warps {warps:2d} bd {bd:5d}{' one pass' if bd >= d else ''}"
              f" {t * 1e6:7.2f} us  normed u err {err:.1e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_mhc.json")
    ap.add_argument("--quick", action="store_true", help="three tiled candidates only")
    ap.add_argument("--decode", action="store_true",
                    help="the decode pair (old 4 launches vs mhc_decode's 2) instead of prefill")
    ap.add_argument("--collapse", action="store_true",
                    help="hc_pre_async's critical collapse launch alone, at T = 1, 2, 4, 8")
    args = ap.parse_args()
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {torch.cuda.get_device_name()}", flush=True)
    gen = torch.Generator().manual_seed(0)
    if args.collapse:
        rows = [r for T in (1, 2, 4, 8) for r in collapse_case(T, gen)]
    elif args.decode:
        rows = [r for T in (1, 8, 63) for r in decode_case(T, bw, gen)]
    else:
        rows = [r for T in (128, 1024, 8192) for kind in ("hc_pre", "hc_head")
                for r in case(kind, T, bw, gen, args.quick)]
    with open(args.out, "w") as f:
        json.dump(dict(copy_bw=bw, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
