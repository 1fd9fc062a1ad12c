#!/usr/bin/env bash
# One prepared check of sled on a borrowed GPU machine (one H100 or H200, at most 10 minutes,
# start-up included), run from the repository root:
#
#   bash lab/gpu/wheels.sh && bash lab/gpu/check.sh OUT      # here, then there (carry .whl)
#   bash lab/gpu/check.sh --dry-run OUT                      # every part on this CPU, tiny
#
# Parts, in order, each under its own time limit; each writes into OUT as soon as it ends, and
# one that fails or runs out of time is recorded in OUT/summary.json and the next one runs:
#   tests       tests/test_engines_on_device.py --device cuda: every engine against generate()
#   engine-llama-8b, engine-gemma3-4b  `python -m lab.bench.engine` on the shape, flex-graph (the
#       server's engine on a GPU): prefill (one row of 512 and of 2,048 new tokens, four rows of
#       512), verify (1, 16, 64 rows of 5 tokens at 512 and 2,048), decode (the same rows, one
#       token each) and SAT rows (a verify row and 4 SAT slots); the floor at the GPU's bandwidth
#       and FLOP/s, the kernels of each kind of step, and the step-cost profile of all of them
#       (each cell tagged with its kind, rewritten after every cell); on llama-8b beside it
#       flex-graph-splits (--flex-splits auto) and flex-graph-overlap (steps overlapped as the
#       scheduler runs them: the step's wall time against its kernels')
#   serve-real, serve-emulated  `sled bench serve`, sled against centralized at N = 1, 4, 16, 64,
#       each mode warmed up at every N before the timed runs: synthetic:gemma3-4b on the GPU
#       itself, then synthetic:gemma3-270m on the GPU held to the gemma3-4b profile just
#       measured (--emulate: the small target keeps every step under the profile's time; where
#       engine-gemma3-4b did not run, the shipped h200-gemma3-4b-sled-forward) with the fleet
#       simulator beside it (--simulate) and the error of both against serve-real per N
#       (--against)
#   sdsat       `sled bench sdsat` of synthetic:gemma3-4b with a random SAT adapter of its shape
#       (4 slots, LoRA rank 8, as the built-in one): tokens per pass and wall time of SAT
#       self-drafting against plain decoding (random weights: the acceptance means nothing, the
#       passes' cost does)
# The limits add up to under 9 minutes; each is cut to what is left of TOTAL_S (10 minutes)
# since the script started, so the whole run, start-up included, ends within it. A second run on
# the same machine can leave out what the first measured:
#   SLED_GPU_SKIP="engine-llama-8b engine-gemma3-4b" bash lab/gpu/check.sh OUT2
# OUT holds at most 10 files: summary.json (device, versions, each part's command, status and
# seconds), engine-*.json, profile-*.json, serve.json ({"real": ..., "emulated": ...}, written
# after each of the two), sdsat.json, tests.log and check.log (every other part's output).
set -u

usage() { echo "usage: bash lab/gpu/check.sh [--dry-run] OUTDIR"; }

DRY=0
OUT=""
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "check.sh: unknown flag $arg" >&2; usage >&2; exit 2 ;;
        *) if [ -n "$OUT" ]; then echo "check.sh: one OUTDIR, not $arg too" >&2; exit 2; fi
           OUT=$arg ;;
    esac
done
if [ -z "$OUT" ]; then usage >&2; exit 2; fi

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}
SITE=${SLED_GPU_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/check.log"
: > "$LOG"
: > "$WORK/parts.tsv"
STARTED=$(date +%s)
TOTAL_S=$([ "$DRY" = 1 ] && echo 1800 || echo 600)     # the whole run, start-up included
KILL_S=5                                                # a part's grace after its limit

say() { echo "[check $(date +%T)] $*" | tee -a "$LOG"; }

# --- the machine: wheels, the built-in tokenizer, its name ------------------------------------
if [ "$DRY" = 0 ]; then
    if compgen -G ".whl/*.whl" > /dev/null; then
        say "installing $(ls .whl/*.whl | wc -l) wheels into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
            .whl/*.whl >> "$LOG" 2>&1 || say "pip install failed (see above)"
    fi
    export SLED_CACHE=${SLED_CACHE:-/tmp/sled-cache}
fi
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 0 ] && [ -f .whl/gemma3-270m-tokenizer.tar.gz ]; then
    folder="$SLED_CACHE/hf/gemma3-270m"
    mkdir -p "$folder"
    tar xzf .whl/gemma3-270m-tokenizer.tar.gz -C "$folder"
    "$PY" -c "import sys; from pathlib import Path; from sled.cache import write_manifest; \
write_manifest(Path(sys.argv[1]))" "$folder" >> "$LOG" 2>&1 \
        && say "the gemma3-270m tokenizer and config are in $folder"
fi

"$PY" - "$WORK/machine.json" "$DRY" >> "$LOG" 2>&1 <<'EOF'
import datetime, json, sys
import torch, transformers
cuda = sys.argv[2] == "0" and torch.cuda.is_available()
json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "transformers": transformers.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "dry_run": sys.argv[2] == "1"}, open(sys.argv[1], "w"))
EOF
DEVICE_NAME=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['device'])" \
              "$WORK/machine.json" 2>/dev/null || echo unknown)
say "device: $DEVICE_NAME"

summary() {
    "$PY" - "$WORK/machine.json" "$WORK/parts.tsv" "$OUT/summary.json" "$STARTED" <<'EOF'
import json, sys, time
try:
    machine = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    machine = {"device": "unknown"}
parts = []
for line in open(sys.argv[2]):
    name, status, seconds, limit, command = line.rstrip("\n").split("\t", 4)
    parts.append({"name": name, "status": int(status), "seconds": int(seconds),
                  "limit_s": int(limit), "command": command})
json.dump({**machine, "seconds": int(time.time()) - int(sys.argv[4]), "parts": parts},
          open(sys.argv[3], "w"), indent=1)
EOF
}

# run_part NAME LIMIT_S LOGFILE COMMAND...: under timeout, its output appended to LOGFILE
# (SLED_GPU_SKIP="NAME ..." leaves parts out, e.g. on a second run what the first measured)
run_part() {
    local name=$1 limit=$2 log=$3
    shift 3
    case " ${SLED_GPU_SKIP:-} " in
        *" $name "*) skip_part "$name" "SLED_GPU_SKIP"; return 0 ;;
    esac
    local left=$((STARTED + TOTAL_S - $(date +%s) - KILL_S))
    if [ "$left" -lt 10 ]; then skip_part "$name" "no time left of ${TOTAL_S}s"; return 0; fi
    [ "$left" -lt "$limit" ] && limit=$left
    say "part $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=$KILL_S "$limit" "$@" >> "$log" 2>&1
    local status=$?
    say "part $name: exit $status after $((SECONDS - start)) s"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$limit" "$*" \
        >> "$WORK/parts.tsv"
    summary
    return 0
}

# skip_part NAME REASON: recorded as exit 3, not run
skip_part() {
    say "part $1 not run: $2"
    printf '%s\t3\t0\t0\t(not run: %s)\n' "$1" "$2" >> "$WORK/parts.tsv"
    summary
}

# --- what each part runs, on the GPU or (--dry-run) on this CPU -------------------------------
# (transformers-graph, the centralized step, and flex-graph-masked and flex-graph-hf, full blocks
# off and transformers' forward under flex, were measured against flex-graph on an H200:
# BENCHMARKS.md "sled's own forward on an H200"; name them in ENGINES to measure them again)
# flex-graph-splits: --flex-splits auto (each row split for four programs a multiprocessor)
# against torch's split count; flex-graph-overlap: flex-graph's steps overlapped as the
# scheduler runs them on CUDA (the step's wall time against its kernels' time)
ENGINES=(flex-graph,flex-graph-splits,flex-graph-overlap flex-graph)
KINDS=prefill,verify,decode,sat
# the data sheet's bandwidth of this GPU (verify_server.roofline's; an unknown one: an H100's)
BANDWIDTH=$("$PY" -c "import sys; from verify_server.roofline import GPUS, gpu_spec
try: print(gpu_spec(sys.argv[1]).bandwidth)
except ValueError: print(GPUS['H100'].bandwidth)" "$DEVICE_NAME" 2>> "$LOG" || echo 3.35e12)
PEAK=7.9e14        # dense bf16 matrix FLOP/s measured on an H200 (the H100's tensor cores match)
if [ "$DRY" = 1 ]; then
    SHAPES=(tiny-llama:llama-8b tiny-gemma3:gemma3-4b)
    ENGINE_FLAGS=(--device cpu --dtype float32 --sessions 2 --contexts 32 --prefill 2x32
                  --reps 3 --bandwidth 2e10 --peak-flops 1e12)
    ENGINE_LIMITS=(150 150)
    TEST_FLAGS=(--device cpu)
    TEST_LIMIT=150
    SERVE_FLAGS=(--dtype float32 --devices 1,2 --prompts 2 --max-new-tokens 6
                 --device-profile instant)
    EMULATED_FLAGS=("${SERVE_FLAGS[@]}")
    SERVE_LIMITS=(150 150)
    TINY=$("$PY" -c "from lab.tiny import cached_pair; print(cached_pair()[0])" 2>> "$LOG")
    SDSAT_FLAGS=(--model "$TINY" --dtype float32 --workload tiny --max-new-tokens 6)
    SDSAT_LIMIT=150
else
    SHAPES=(llama-8b:llama-8b gemma3-4b:gemma3-4b)
    ENGINE_FLAGS=(--device cuda --dtype bfloat16 --sessions 1,16,64 --contexts 512,2048
                  --prefill 1x512,1x2048,4x512 --reps 8 --bandwidth "$BANDWIDTH"
                  --peak-flops "$PEAK")
    ENGINE_LIMITS=(145 80)
    TEST_FLAGS=(--device cuda)
    TEST_LIMIT=45
    SERVE_FLAGS=(--model synthetic:gemma3-4b --dtype bfloat16 --server-args "--device cuda"
                 --devices 1,4,16,64 --prompts 8 --max-new-tokens 24)
    # the same sweep on a small target, its steps held to the gemma3-4b profile
    EMULATED_FLAGS=(--model synthetic:gemma3-270m "${SERVE_FLAGS[@]:2}")
    SERVE_LIMITS=(120 75)     # each starts a server: the target, then its warm-up
    SDSAT_FLAGS=(--model synthetic:gemma3-4b --dtype bfloat16 --server-args "--device cuda"
                 --workload chat --max-new-tokens 32)
    SDSAT_LIMIT=60
fi

# a. the engines against generate() on the device
run_part tests "$TEST_LIMIT" "$OUT/tests.log" "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_engines_on_device.py "${TEST_FLAGS[@]}"

# b. the engine bench, a shape at a time (OUT's files named by the GPU run's shapes)
for i in 0 1; do
    shape=${SHAPES[$i]%%:*}
    named=${SHAPES[$i]##*:}
    run_part "engine-$named" "${ENGINE_LIMITS[$i]}" "$LOG" "$PY" -m lab.bench.engine \
        --shape "$shape" "${ENGINE_FLAGS[@]}" --draft-len 4 --engines "${ENGINES[$i]}" \
        --kinds "$KINDS" --sat-slots 4 --kernels \
        --out "$WORK/engine-$named.json" --write-profile "$OUT/profile-$named.json"
    cp "$WORK/engine-$named.json" "$OUT/" 2>/dev/null     # what was measured, without its plot
done

# serve.json: the real and the emulated sweep's results, as far as they ran
merge_serve() {
    "$PY" - "$WORK" "$OUT/serve.json" <<'EOF'
import json, sys
from pathlib import Path
got = {}
for mode in ("real", "emulated"):
    try:
        got[mode] = json.loads((Path(sys.argv[1]) / f"serve-{mode}.json").read_text())
    except (OSError, ValueError):
        got[mode] = None
Path(sys.argv[2]).write_text(json.dumps(got, indent=1))
EOF
}

# c. the whole server on the GPU, then a small target held to the gemma3-4b profile (the served
# shape) with the simulator beside it, both against the real run
SERVE=("$PY" -m sled_cli.main bench serve --traces calibrated:gemma3-gguf --workload chat
       --draft-len 4)
run_part serve-real "${SERVE_LIMITS[0]}" "$LOG" "${SERVE[@]}" "${SERVE_FLAGS[@]}" \
    --out "$WORK/serve-real.json"
merge_serve
PROFILE="$OUT/profile-gemma3-4b.json"
if [ ! -f "$PROFILE" ] && [ "$DRY" = 0 ]; then   # the engine part left out: the shipped one
    PROFILE=h200-gemma3-4b-sled-forward
    say "serve-emulated is held to the shipped profile $PROFILE"
fi
if [ "$DRY" = 1 ] && [ -f "$PROFILE" ]; then     # a CPU's profile knows no GPU memory: 1 GiB
    "$PY" - "$PROFILE" "$WORK/profile-gemma3-4b.json" <<'EOF'
import json, sys
profile = json.load(open(sys.argv[1]))
profile["gpu"]["memory_bytes"] = 1 << 30
json.dump(profile, open(sys.argv[2], "w"), indent=1)
EOF
    PROFILE="$WORK/profile-gemma3-4b.json"
fi
AGAINST=()
if [ -f "$WORK/serve-real.json" ]; then AGAINST=(--against "$WORK/serve-real.json"); fi
if [ -f "$PROFILE" ] || [ "$DRY" = 0 ]; then
    run_part serve-emulated "${SERVE_LIMITS[1]}" "$LOG" "${SERVE[@]}" "${EMULATED_FLAGS[@]}" \
        --emulate "$PROFILE" --simulate "${AGAINST[@]}" --out "$WORK/serve-emulated.json"
else
    skip_part serve-emulated "engine-gemma3-4b wrote no profile"
fi
merge_serve

# d. SAT self-drafting against plain decoding on the served shape, a random adapter of its shape
run_part sdsat "$SDSAT_LIMIT" "$LOG" "$PY" -m sled_cli.main bench sdsat "${SDSAT_FLAGS[@]}" \
    --sat-adapter random --compare-adapter none --drafters none --temperature 0 \
    --out "$WORK/sdsat.json"
cp "$WORK/sdsat.json" "$OUT/" 2>/dev/null
summary
say "done in $(( $(date +%s) - STARTED )) s: $(ls "$OUT" | tr '\n' ' ')"
