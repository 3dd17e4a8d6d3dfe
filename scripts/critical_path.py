"""The critical path of a traced step, layer by layer, from a profile_step.py trace log (CPU only):

    python3 scripts/critical_path.py TRACE.txt [--section plain] [--marker _post_mix_kernel]
                                     [--per-layer 2] [--skip 0]

TRACE.txt: what `profile_step.py --trace` or `--spec` writes with --out (lines "start gap G dur
D  name", µs, one section per "== name" header; --section picks the one whose header holds that
text, default the first). The critical path is walked back from the kernel that ends last: each
step goes to the kernel that ended last before the current one started (in a CUDA graph a
kernel starts right after its last dependency ends, so that is the one it waited for; a side
stream's kernel that overlaps it is not on the path). The path is cut into layers at every
--per-layer-th --marker kernel (mHC's post_mix: two a decode layer, the attention's and the
MoE's hc_post), after --skip markers; a layer's launches are those from one cut to the next.
Prints each layer's launches and µs (span, and busy: the sum of its kernels' durations), then
the median, min and max over the layers, and the kernels of the median layer. For each of
those, its wait (its start less the previous one's end) and, where the wait passes --late µs,
the kernels off the path that started after the previous one did and before it: launched
ahead of it, they can hold its SMs or its launch slot (in a replayed graph the nodes that
become ready together start in capture order), and the walk may have taken one of them for
its dependency while the true one ended earlier.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+) gap\s+(-?[\d.]+) dur\s+([\d.]+)  (.*)")


def read_section(text: str, section: str | None) -> list[tuple[float, float, str]]:
    """The (start, end, name) kernels of one "== ..." section of a trace log (section None: the
    first; else the first whose header holds `section`)."""
    out, on, seen = [], section is None, False
    for line in text.splitlines():
        if line.startswith("== "):
            if seen and on:
                break
            on = section is None or section in line
            seen = seen or on
            continue
        m = LINE.match(line)
        if m and on:
            s, d = float(m[1]), float(m[3])
            out.append((s, s + d, m[4].strip()))
            seen = True
    return out


def critical_path(ev: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The chain of kernels each started after the previous one ended (module notes), in order."""
    if not ev:
        return []
    cur = max(ev, key=lambda e: e[1])
    path = [cur]
    while True:
        before = [e for e in ev if e[1] <= cur[0] + 1e-6 and e is not cur]
        if not before:
            return path[::-1]
        cur = max(before, key=lambda e: (e[1], e[0]))
        path.append(cur)


def layers(path, marker: str, per: int, skip: int = 0) -> list[list[tuple[float, float, str]]]:
    """path cut before every per-th marker kernel (after `skip` of them): the layers' kernels."""
    cuts, n = [], 0
    for i, e in enumerate(path):
        if e[2].startswith(marker):
            if n >= skip and (n - skip) % per == 0:
                cuts.append(i)
            n += 1
    return [path[a:b] for a, b in zip(cuts, cuts[1:])]


def ahead(ev: list[tuple[float, float, str]], path: list[tuple[float, float, str]]
          ) -> list[tuple[float, list[tuple[float, float, str]]]]:
    """For each kernel of path: (its wait after the previous one ended, in µs (0 for the
    first), the kernels of ev off the path that started after the previous one did and
    before it)."""
    on = {id(e) for e in path}
    out = [(0.0, [])]
    for prev, cur in zip(path, path[1:]):
        out.append((cur[0] - prev[1],
                    [e for e in ev if prev[0] <= e[0] < cur[0] and id(e) not in on]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--section", default=None)
    ap.add_argument("--marker", default="_post_mix_kernel")
    ap.add_argument("--per-layer", type=int, default=2)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--late", type=float, default=1.0,
                    help="µs of wait past which the kernels started in it are named")
    a = ap.parse_args()
    ev = read_section(Path(a.trace).read_text(), a.section)
    path = critical_path(ev)
    ls = layers(path, a.marker, a.per_layer, a.skip)
    if not ls:
        raise SystemExit(f"critical_path: no layers ({len(ev)} kernels, {len(path)} on the path; "
                         f"marker {a.marker!r})")
    print(f"{len(ev)} kernels, {len(path)} on the critical path "
          f"({path[-1][1] - path[0][0]:.1f} µs from the first to the last)")
    rows = []
    for i, L in enumerate(ls):
        span, busy = L[-1][1] - L[0][0], sum(e[1] - e[0] for e in L)
        rows.append((len(L), span, busy))
        print(f"  layer {i:3d}: {len(L):3d} launches, span {span:7.1f} µs, busy {busy:7.1f}")
    for what, k in (("launches", 0), ("span µs", 1), ("busy µs", 2)):
        v = [r[k] for r in rows]
        print(f"{what:9s} a layer: median {statistics.median(v):.1f}, min {min(v):.1f}, "
              f"max {max(v):.1f}")
    med = sorted(range(len(rows)), key=lambda i: rows[i][1])[len(rows) // 2]
    print(f"layer {med} (the median span), its kernels (µs: duration, wait before it):")
    for (s, e, name), (wait, gap) in zip(ls[med], ahead(ev, ls[med])):
        late = ", ".join(f"{n[:30]} {b - a:.1f}" for a, b, n in gap) if wait > a.late else ""
        print(f"  {e - s:6.1f} {wait:5.1f}  {name[:60]}" + (f"  (ahead: {late})" if late else ""))


if __name__ == "__main__":
    main()
