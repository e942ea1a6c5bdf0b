#!/usr/bin/env bash
# The GPU figures of issues 26-28 on a lent GPU machine, one stage (or a few) per device call:
#
#     bash bench/gpu_session.sh STAGE...    # STAGE: issue27 env tests decode-sweep prefill-sweep profile prefill-b1 decode
#                                           #        captured captured-evict captured-merge prefill prefill-rest kernels train
#                                           #        train-dms cpu-threads
#
# A session has 15 minutes of device time (the machine's start, a minute or two, and every idle wait included),
# 10 minutes a call, and at most 8 files come back from $OUT: two calls, `issue27` (its stages' limits add up to
# 655 s, the call's 570 s cutting the last; about 230 s on stop 59's H200), then at once, while the machine is
# warm (it goes back after 30 s idle), `tests` (the default suite, 520 s; 246 s on stop 48's H100), with
# GPU_SESSION_SECONDS set to the seconds the
# session has left less a margin: every stage ends within that many seconds of the call's start (570 by default), a
# stage that would run past it gets what is left, and one with under 10 s left is skipped. Every stage of a call
# logs to one file, `$OUT/session.log`, which ends with each stage's exit status and seconds; the tests' report is
# `$OUT/tests.xml`, the profiles' Chrome traces one archive, `$OUT/traces.tar.gz`, and the prefill sweep's fastest
# pair `$OUT/prefill-best.json`: at most four files, whatever the stages. `issue27` is the first: what the open
# issue's GPU targets still lack after stop 60's H200 (docs/results.md), each part killed at its own limit and
# printing as it goes, so that a call cut short still leaves the figures before it:
#
#   issue27         env; the tests of the kernels and of KVMerger, and the five that failed on stop 60's H200 for the
#                   machine (`tests`, 120 s: the prefill's default attention is now cuDNN's on Hopper); the batch-1
#                   prefill of h2o (control), d2o, kvmerger and dynamickv, 8B shape, 16 layers, 8K, three interleaved
#                   rounds, under that default (`prefill-changed`, 90 s: 1.13x, 1.22x, 1.38x and 1.17x on stop 60's
#                   H200 with KVGATES_PREFILL_CONFIG '{"attention": "sdpa"}'); the same under the Triton forward
#                   (`prefill-triton`, 90 s: '{"attention": "triton"}'; 1.18x, 1.27x, 1.43x and 1.24x at stop 60);
#                   their batch-8 prefill at 8K (`prefill-b8`, 90 s), the 16K prefill with snapkv, two rounds
#                   (`prefill-16k`, 90 s), the kernels at one shape (`kernels-8k`, 45 s: bf16, head dim 128, batch 1,
#                   8K) and a profile with Chrome traces of d2o's and kvmerger's (`profile`, 100 s)
#   tests           the default test suite on the GPU machine, in parallel processes where pytest-xdist travelled
#                   with the wheels
#   decode-sweep    decode attention under each launch configuration of a grid (bench/kernels.py --sweep-decode)
#   prefill-sweep   (245 s) the scoring prefill's two passes under each launch configuration of a grid, bf16,
#                   head dim 128, batch 1, 8K (bench/kernels.py --sweep-prefill, each configuration printed as it is
#                   measured, 170 s; stop 59's H200: the column pass's default now its fastest, the forward's kept).
#                   Then the batch-1 prefill of h2o, d2o and kvmerger (16 layers, 8K, two rounds) under the fastest
#                   pair (`prefill-tuned`, 75 s; KVGATES_PREFILL_CONFIG from $OUT/prefill-best.json)
#   profile         the GPU's own check that a pageable host-to-device copy syncs and `on_device` does not (20 s); a
#                   profile (with Chrome traces) of the batch-1 prefill of the policies over 1.3x at stop 44 (100 s)
#   prefill-b1      every policy's batch-1 prefill vs plain sdpa, 8B shape, 16 layers, 8K, three interleaved rounds
#                   (the same code moved D2O 1.70x -> 2.04x between two one-round runs; 200 s); the batch-8 prefill
#                   of the policies over or on the 1.3x line at stop 44 (90 s)
#
# The other stages measure the rest, one per later session (minutes are estimates on an H100 until measured):
#
#   decode          (~6 min) issue 26: eager decode of every policy vs DynamicCache at the budget and at 16K
#   captured        (~8 min) issue 26: snapkv's decode compiled and captured as CUDA graphs (reduce-overhead) vs a
#                            captured StaticCache of the budget's size, DynamicCache and the HBM roofline
#   captured-evict  (~8 min) issue 26: the same for h2o and trimkv, which evict while decoding
#   captured-merge  (~8 min) issue 27: the same for d2o (merges while decoding) and kvmerger (merges the prompt)
#   prefill         (~8 min) issue 27: every policy's prefill vs plain sdpa, 8B shape, 16 and 32 layers, batch 1 and 8
#   prefill-rest    (~8 min) issue 27: the same (16 layers) for the policies the prefill stage leaves out: KVzip's
#                            reconstruction kernel, KVMerger's merges, the learned policies' gates
#   kernels         (~4 min) issue 27: decode attention at batch 1-32 and 4K-32K vs sdpa and HBM peak (stop 59: past 240 s
#                            while the prefill's torch reference was timed at every shape)
#   train           (~8 min) issue 28: gate-training step vs a teacher forward, 135M at 1K-16K, 8B at 8K
#   train-dms       (~8 min) issue 28: the same for DMS (dms_attention_fused), the DMS recipe's memory
#   cpu-threads     (~1 min) issue 27, on the machine's CPU (no GPU needed): the scoring prefill's attention under
#                            each split of its batched products at 16, 8, 4 and 2 threads (bench/cpu_attention.py),
#                            SmolLM2-135M's heads and Llama-3.1-8B's at 4K: the split is timed on 2 cores only
#
# The machine has no network: the packages kvgates needs beyond what it has travel as wheels in the checkout's
# git-ignored .whl/ (`make gpu-wheels` downloads them; ../shared/GPU.md) and are installed once per machine into
# /tmp/site, before the first stage, where the interpreter lacks transformers. Pass `carry: [".whl"]` to the device tool.
# GPU_SESSION_SMOKE=1 runs every stage at toy sizes (on the CPU too): it checks this script, not speed; issue27's and
# prefill-sweep's on the paths a GPU takes (GPU_PATHS below), the kernels' tests collected, not run.
set -euo pipefail
case ${OUT:-} in "" | /*) ;; *) OUT="$PWD/$OUT" ;; esac  # a relative OUT is the caller's, not the repository root's
cd "$(dirname "$0")/.."
# Every stage named is checked before any runs: a misspelt one is refused before a GPU's minutes go to the others.
STAGES=(issue27 env tests decode-sweep prefill-sweep profile prefill-b1 decode captured captured-evict captured-merge prefill
    prefill-rest kernels train train-dms cpu-threads)
USAGE="usage: bash bench/gpu_session.sh STAGE... (stages: ${STAGES[*]}; what each does: the comments at the top of this script)"
if [ "$#" = 0 ]; then
    echo "$USAGE" >&2
    exit 2
fi
case "$1" in -h | --help)
    echo "$USAGE"
    exit 0
    ;;
esac
for name in "$@"; do
    known=0
    for stage_name in "${STAGES[@]}"; do
        [ "$name" = "$stage_name" ] && known=1
    done
    if [ "$known" = 0 ]; then
        echo "unknown stage '$name': choose from ${STAGES[*]}" >&2
        exit 2
    fi
done
# The seconds the call's stages end within (`stage` below), a whole number, checked before anything is made.
DEADLINE=${GPU_SESSION_SECONDS:-570}
if ! [[ $DEADLINE =~ ^[0-9]+$ ]]; then
    echo "GPU_SESSION_SECONDS=$DEADLINE: give the seconds the call's stages may take as a whole number (570 by default)" >&2
    exit 2
fi
DEADLINE=$((10#$DEADLINE))  # (a leading 0 is not octal)
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
SMOKE=${GPU_SESSION_SMOKE:-0}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The embedded model's tokenizer, which `make gpu-wheels` writes beside the wheels: the tests that need it run here.
if [ -d .whl/smollm2-135m-tokenizer ]; then
    export KVGATES_TEST_TOKENIZER="$PWD/.whl/smollm2-135m-tokenizer"
fi

# Stages other than env, tests and cpu-threads measure a GPU: without one (and not a smoke run) the call ends here,
# before an 8B random model is built on the host (32 GB in float32 for the decode stage), and before any wheel is installed.
MEASURING=()
for name in "$@"; do
    [ "$name" != env ] && [ "$name" != tests ] && [ "$name" != cpu-threads ] && MEASURING+=("$name")
done
if [ "$SMOKE" != 1 ] && [ "${#MEASURING[@]}" != 0 ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA device here, and these stages measure a GPU: ${MEASURING[*]} (GPU_SESSION_SMOKE=1 runs every stage at toy sizes, to check this script)" >&2
    exit 2
fi

# The wheels go in where the interpreter lacks the wheel's transformers (a GPU machine of stop 43 had transformers
# 5.17 of its own, which kvgates refuses), never over an installed environment that has it.
TRANSFORMERS_WHEEL=$(compgen -G ".whl/transformers-*.whl" | head -n 1 || true)
WANTED=$(basename "${TRANSFORMERS_WHEEL:-none}" | cut -d- -f2)
if [ -n "$TRANSFORMERS_WHEEL" ] && { [ -f /tmp/site/.kvgates-wheels ] \
    || ! "$PY" -c "import sys, transformers; sys.exit(transformers.__version__ != '$WANTED')" 2> /dev/null; }; then
    if [ ! -f /tmp/site/.kvgates-wheels ]; then
        echo "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
        touch /tmp/site/.kvgates-wheels
    fi
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# Sizes: the issues' shapes, or toy ones for the smoke run. The kernels' tests run on the GPU; a smoke run collects
# them only (the CPU suite runs them), so that a test file renamed fails there, not on a lent GPU. GPU_PATHS: what a
# smoke run puts before the commands of the first two calls' stages (issue27, prefill-sweep), so that they take the
# paths a GPU takes (the Triton kernels under the interpreter, the launch-bound tiles and host reads): a minute a
# stage at these sizes, not the seconds the CPU's paths take, so the other stages keep the CPU's.
KERNEL_TESTS="tests/test_kernels.py tests/test_seed_policies.py tests/test_runtime_on_kernels.py" GPU_PATHS=""
# The tests that failed on stop 60's H200 for the machine (its HF_HUB_OFFLINE, the embedded model's absent package, a
# GPU's prefill defaults, its torch 2.11), since mended.
KERNEL_TESTS="$KERNEL_TESTS tests/test_gates.py::test_a_hub_id_is_refused_at_once_when_the_hub_cannot_be_reached
    tests/test_models.py::test_the_embedded_models_skeleton_keeps_its_short_name_without_converting_it
    tests/test_eval_harness.py::test_a_gpu_run_on_a_machine_without_one_is_one_sentence_and_its_report_renders_anywhere
    tests/test_bench_scripts.py::test_best_json_is_the_prefill_sweeps_and_a_bad_prefill_config_is_one_sentence
    tests/test_compiled_decode.py::test_generate_with_chunked_prefill_compiles_only_the_decode_steps_of_a_static_cache"
if [ "$SMOKE" = 1 ]; then
    BIG="--model random --layers 2" DEEP="$BIG" SMALL="--model random --layers 2"
    DECODE="--configs 160:64 --batch 2 --steps 2 --rounds 1 --slack 4"
    CAPTURE="--contexts 160 --budget 64 --batch 2 --steps 2 --rounds 1 --slack 0 --peak-gbps 50"
    PREFILL="--contexts 160 --budget 64 --batch 1 --steps 2 --rounds 1"
    KERNELS="--smoke" KERNELS_8K="--smoke" SWEEP="--smoke" SWEEP_PREFILL="--smoke" TESTS="tests/test_host_copies.py" TRAIN_SMALL="--lengths 160 256 --budget 64" TRAIN_BIG="--lengths 160 --budget 64"
    PREFILL_FIRST="--contexts 96 --budget 48 --batch 2 --steps 1 --rounds 1 --slack 0"  # (160: 107 s on the GPU's paths)
    PROFILE="--model random --layers 2 --context 160 --budget 64 --batch 1 --steps 2"
    PREFILL_ONE="--contexts 160 --budget 64 --batch 1 --steps 1 --rounds 1 --slack 0" PREFILL_TUNED="$PREFILL_ONE"
    PREFILL_16K="--contexts 96 --budget 48 --batch 1 --steps 1 --rounds 1 --slack 0"  # (five policies at 160: past 180 s)
    CPU_SMALL="--contexts 128 --threads 1 2 --rounds 1" CPU_BIG="$CPU_SMALL"
    KERNEL_TESTS="--collect-only $KERNEL_TESTS" GPU_PATHS="env KVGATES_KERNELS=triton KVGATES_LAUNCH_BOUND=1"
    export TRITON_INTERPRET=1
else
    BIG="--model random:llama-3.1-8b --layers 32" DEEP="--model random:llama-3.1-8b --layers 16"
    SMALL="--model random --layers 30"
    DECODE="--configs 16384:1024 --batch 8 --steps 16 --rounds 2 --slack 32"
    CAPTURE="--contexts 16384 --budget 1024 --batch 8 --steps 16 --rounds 2 --slack 0"
    PREFILL="--contexts 8192 16384 --budget 1024 --batch 1 8 --steps 4 --rounds 1"
    KERNELS="--budgets 4096 16384 32768 --batch 1 4 8 32 --head-dim 128 --dtype bf16"
    SWEEP="--budgets 16384 4096 32768 --batch 1 --head-dim 128 --dtype bf16" TESTS=""
    SWEEP_PREFILL="--budgets 8192 --batch 1 --head-dim 128 --dtype bf16" KERNELS_8K="$SWEEP_PREFILL"
    TRAIN_SMALL="--lengths 1024 4096 8192 16384 --budget 256" TRAIN_BIG="--lengths 8192 --budget 1024"
    PREFILL_FIRST="--contexts 8192 --budget 1024 --batch 8 --steps 1 --rounds 1 --slack 0"
    PROFILE="--model random:llama-3.1-8b --layers 4 --context 8192 --budget 1024 --batch 1 --steps 3"
    PREFILL_ONE="--contexts 8192 --budget 1024 --batch 1 --steps 1 --rounds 3 --slack 0"
    PREFILL_TUNED="--contexts 8192 --budget 1024 --batch 1 --steps 1 --rounds 2 --slack 0"
    PREFILL_16K="--contexts 16384 --budget 1024 --batch 1 --steps 1 --rounds 2 --slack 0"
    CPU_SMALL="--contexts 4096 --threads 16 8 4 2 --parts 1 2 3 4 6 --rounds 5"  # (6 parts of a 192-row tile: 32 rows, MIN_PART_ROWS)
    CPU_BIG="--shape llama-3.1-8b --contexts 4096 --threads 16 8 --parts 1 2 4 --rounds 3"
fi

# stage NAME SECONDS COMMAND...: run COMMAND with a time limit (then 20 s of grace), its output to the terminal and
# $OUT/session.log between a header and a footer that name the stage; a failure or a timeout (status 124) makes the
# script's exit status 1. The footers are summed up at the end. The call's stages end within GPU_SESSION_SECONDS of
# its start (570 by default, the wheels' install included; a device call is cut at 600): a stage gets at most what
# is left, and one with less than 10 s left is skipped (a failure too). A smoke run doubles the limits, a GPU's
# seconds: its stages on the GPU's paths run the kernels under the interpreter (issue27's prefill-b8 took 66 s of 90).
FAILED=0
LOG="$OUT/session.log"
SUMMARY=()
stage() {
    local name=$1 limit=$2 began=$SECONDS left=$((DEADLINE - SECONDS))
    shift 2
    if [ "$left" -lt 10 ]; then
        echo "=== $name skipped: ${left} s left of the call's ${DEADLINE} s" | tee -a "$LOG"
        SUMMARY+=("$name: skipped, ${left} s left")
        FAILED=1
        return
    fi
    if [ "$SMOKE" = 1 ]; then
        limit=$((2 * limit))
    fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" | tee -a "$LOG"
    local status=0
    timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG" || status=$?
    echo "=== $name done, exit status $status ($(date -u +%H:%M:%S))" | tee -a "$LOG"
    SUMMARY+=("$name: exit status $status, $((SECONDS - began)) s")
    [ "$status" = 0 ] || FAILED=1
}

# profile_stage SECONDS POLICY...: the batch-1 prefill and decode of each policy profiled (after $GPU_PATHS), its
# Chrome traces in a folder of their own under $TRACES, all packed into one archive after each profile
# ($OUT/traces.tar.gz: a device call brings back 8 files at most, and a call cut short keeps the traces of the
# profiles before).
TRACES=$(mktemp -d)
trap 'rm -rf "$TRACES"' EXIT
profile_stage() {
    local limit=$1
    shift
    local dir
    dir=$(mktemp -d "$TRACES/profile-XXXX")
    # shellcheck disable=SC2086
    stage profile "$limit" $GPU_PATHS "$PY" bench/policy_profile.py $PROFILE --trace "$dir" --policies "$@"
    if [ -n "$(ls -A "$dir")" ]; then
        tar -czf "$OUT/traces.tar.gz" -C "$TRACES" .
    fi
}

# The versions and the kernel backend this machine runs.
env_stage() {
    stage env 30 "$PY" -c "import torch, transformers, kvgates, kvgates.kernels as k; \
device = 'cuda' if torch.cuda.is_available() else 'cpu'; \
print('torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__); \
print('device', torch.cuda.get_device_name() if device == 'cuda' else 'cpu', '| kernels', k.backend(torch.empty(0, device=device)))"
}

# The default test suite, with the GPU (no TRITON_INTERPRET: the kernels compile for it), in eight processes where
# pytest-xdist is installed (16 cores; tests handed out one by one, workers taking from the busiest: the training
# tests alone ran past 300 s in one process), in one where it is not.
tests_stage() {
    local parallel=()
    if "$PY" -c "import xdist" 2> /dev/null; then
        parallel=(-n "${GPU_SESSION_WORKERS:-8}" --dist worksteal)
    fi
    # shellcheck disable=SC2086
    stage tests "$1" "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" --junitxml "$OUT/tests.xml" $TESTS
}

for name in "$@"; do
    case $name in
    issue27)
        env_stage
        TESTS=$KERNEL_TESTS tests_stage 120
        # shellcheck disable=SC2086
        stage prefill-changed 90 $GPU_PATHS "$PY" bench/gpu_policies.py $DEEP $PREFILL_ONE --policies h2o d2o kvmerger dynamickv
        # shellcheck disable=SC2086
        stage prefill-triton 90 $GPU_PATHS env 'KVGATES_PREFILL_CONFIG={"attention": "triton"}' "$PY" bench/gpu_policies.py \
            $DEEP $PREFILL_ONE --policies h2o d2o kvmerger dynamickv
        # shellcheck disable=SC2086
        stage prefill-b8 90 $GPU_PATHS "$PY" bench/gpu_policies.py $DEEP $PREFILL_FIRST --policies h2o d2o kvmerger
        # shellcheck disable=SC2086
        stage prefill-16k 90 $GPU_PATHS "$PY" bench/gpu_policies.py $DEEP $PREFILL_16K --policies snapkv h2o d2o kvmerger dynamickv
        # shellcheck disable=SC2086
        stage kernels-8k 45 "$PY" bench/kernels.py $KERNELS_8K
        profile_stage 100 d2o kvmerger
        ;;
    tests)
        tests_stage 520
        ;;
    decode-sweep)
        # shellcheck disable=SC2086
        stage decode-sweep 240 "$PY" bench/kernels.py $SWEEP --sweep-decode
        ;;
    prefill-sweep)
        rm -f "$OUT/prefill-best.json"  # (an earlier call's, where $OUT persists)
        # shellcheck disable=SC2086
        stage prefill-sweep 170 "$PY" bench/kernels.py $SWEEP_PREFILL --sweep-prefill --best-json "$OUT/prefill-best.json"
        if [ -s "$OUT/prefill-best.json" ]; then  # the fastest pair (or the forward's, if cut short) in whole prefills
            # shellcheck disable=SC2086
            stage prefill-tuned 75 $GPU_PATHS env "KVGATES_PREFILL_CONFIG=$(cat "$OUT/prefill-best.json")" \
                "$PY" bench/gpu_policies.py $DEEP $PREFILL_TUNED --policies h2o d2o kvmerger
        fi
        ;;
    profile)
        stage copies 20 "$PY" -m pytest -q -p no:cacheprovider tests/test_host_copies.py
        GPU_PATHS="" profile_stage 100 h2o d2o dynamickv adakv locret kvmerger  # (six policies: the CPU's paths in a smoke run)
        ;;
    prefill-b1)
        # Every registered policy but full (the runtime's own row) and merge (a wrapper that needs a base), read from
        # the registry so that a new policy is measured without an edit here; where that fails (its error in the log),
        # the stage fails and the call goes on.
        listed=0
        ALL_POLICIES=$( { "$PY" -c "import kvgates; print(' '.join(p for p in kvgates.POLICIES if p not in ('full', 'merge')))" \
            2>&1 >&3 3>&- | tee -a "$LOG" >&2; } 3>&1) || listed=$?
        if [ "$listed" = 0 ]; then
            # shellcheck disable=SC2086
            stage prefill-b1 200 "$PY" bench/gpu_policies.py $DEEP $PREFILL_ONE --policies $ALL_POLICIES \
                locret:gate_dtype=bfloat16
        else
            echo "=== prefill-b1 not run: listing the registered policies failed, exit status $listed" | tee -a "$LOG"
            SUMMARY+=("prefill-b1: exit status $listed, listing the registered policies")
            FAILED=1
        fi
        # shellcheck disable=SC2086
        stage prefill-b8 90 "$PY" bench/gpu_policies.py $DEEP $PREFILL_FIRST --policies d2o dynamickv adakv locret kvmerger
        ;;
    env)
        env_stage
        ;;
    decode)
        # shellcheck disable=SC2086
        stage decode 500 "$PY" bench/decode_speed.py $BIG $DECODE \
            --policies full snapkv streaming_llm h2o tova morphkv trimkv adakv
        ;;
    captured)
        # shellcheck disable=SC2086
        stage captured 500 "$PY" bench/gpu_policies.py $BIG $CAPTURE \
            --policies snapkv --compile inductor --compile-mode reduce-overhead
        ;;
    captured-evict)
        # shellcheck disable=SC2086
        stage captured-evict 500 "$PY" bench/gpu_policies.py $BIG $CAPTURE \
            --policies h2o trimkv --compile inductor --compile-mode reduce-overhead
        ;;
    captured-merge)
        # shellcheck disable=SC2086
        stage captured-merge 500 "$PY" bench/gpu_policies.py $BIG $CAPTURE \
            --policies d2o kvmerger --compile inductor --compile-mode reduce-overhead
        ;;
    prefill)
        # shellcheck disable=SC2086
        stage prefill 250 "$PY" bench/gpu_policies.py $DEEP $PREFILL
        # shellcheck disable=SC2086
        stage prefill 250 "$PY" bench/gpu_policies.py $BIG $PREFILL --batch 8 --policies snapkv h2o d2o trimkv
        ;;
    prefill-rest)
        # shellcheck disable=SC2086
        stage prefill-rest 500 "$PY" bench/gpu_policies.py $DEEP $PREFILL \
            --policies kvzip kvmerger locret kvzap dms trimkv-global trimkv-morph trimkv-snap
        ;;
    kernels)
        # shellcheck disable=SC2086
        stage kernels 240 "$PY" bench/kernels.py $KERNELS
        ;;
    train)
        # shellcheck disable=SC2086
        stage train 250 "$PY" bench/train_step.py $SMALL $TRAIN_SMALL --kinds trimkv locret
        # shellcheck disable=SC2086
        stage train 250 "$PY" bench/train_step.py $BIG $TRAIN_BIG --kinds trimkv --checkpoint-layers \
            --dtype bfloat16
        ;;
    train-dms)
        # shellcheck disable=SC2086
        stage train-dms 250 "$PY" bench/train_step.py $SMALL $TRAIN_SMALL --kinds dms
        # shellcheck disable=SC2086
        stage train-dms 250 "$PY" bench/train_step.py $BIG $TRAIN_BIG --kinds dms --checkpoint-layers --dtype bfloat16
        ;;
    cpu-threads)
        # shellcheck disable=SC2086
        stage cpu-threads 90 "$PY" bench/cpu_attention.py $CPU_SMALL
        # shellcheck disable=SC2086
        stage cpu-threads 90 "$PY" bench/cpu_attention.py $CPU_BIG
        ;;
    esac
done
printf '%s\n' "=== summary" ${SUMMARY[@]+"${SUMMARY[@]}"} | tee -a "$LOG"
exit "$FAILED"
