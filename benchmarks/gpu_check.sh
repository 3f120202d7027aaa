#!/usr/bin/env bash
# Flare's device check (issue 42), in one go: under 8 minutes on an H200 host with Python 3.12 and
# torch 2.11 + CUDA 13 preinstalled and no network. Everything it reports lands in $OUT:
#   summary.json  each step's exit status and seconds, every step's JSON results, the issue's targets
#   log.txt       every step's output, in order
#   server.log    helios serve's log
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh [--device cuda] [--wheels .whl] [--budget 450]
#   OUT=/tmp/out PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --device cpu   # CPU smoke test
#
# Steps (each under its own time limit; a step that fails is recorded and the next one runs; a step
# that would start past --budget seconds is skipped, so the most telling results come first):
#   wheels     the carried wheels (benchmarks/gpu_wheels.sh fetches them) installed into a scratch
#              site directory on PYTHONPATH; the repository itself runs from its checkout
#   env        python, torch, CUDA, triton, transformers versions and the GPU
#   cores      on this host, random-weight checkpoints and their cores (benchmarks/gpu_models.py): the
#              llama test model in fp32 and a SmolLM2-135M-shaped one in bf16; later a ~1B-shaped one
#   cuda_check benchmarks/cuda_check.py on the fp32 core: every bucket captured, CUDA against CPU
#              logprobs within 1e-3, batching invariance with graphs on
#   engine     benchmarks/engine_bench.py --device D at 1, 8, 32, 128, 256 rows, graphs on and off
#   serve      helios serve on the SmolLM2-shaped core, driven by benchmarks/serve_bench.py at 1 and
#              64 streams
#   hf         the same checkpoints under plain transformers generate, bf16, batch 1 and 32
# --device cpu is a smoke test of this script: small shapes (gpu_models.py cores --small), fewer rows and
# tokens, and no graphs-off runs (graphs are a CUDA thing); its figures mean nothing.
set -u -o pipefail

DEVICE=cuda
WHEELS=.whl
BUDGET=450
while (($#)); do
    case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    *) echo "usage: OUT=DIR $0 [--device cuda|cuda:N|cpu] [--wheels DIR] [--budget SECONDS]" >&2; exit 2 ;;
    esac
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:?set OUT to the directory the results go to}
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d /tmp/flare-gpu-check.XXXXXX)}
PORT=${PORT:-8765}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/log.txt
STEPS=$WORK/steps.tsv
: >"$LOG"
: >"$STEPS"
START=$(date +%s)
export PYTHONPATH=$REPO PYTHONUNBUFFERED=1
cd "$REPO" || exit 1

if [[ $DEVICE == cpu ]]; then
    SMALL=--small ROWS=1,8 TOKENS=16 LEVELS=1,8 HF_BATCHES=1,4 HF_TOKENS=8
else
    SMALL= ROWS=1,8,32,128,256 TOKENS=64 LEVELS=1,64 HF_BATCHES=1,32 HF_TOKENS=64
fi

# step NAME LIMIT COMMAND...: run it (output to the log) within LIMIT seconds and what is left of
# the budget; its status and milliseconds go to steps.tsv (124: it ran past its limit; skipped: no
# time). COMMAND may be one of the functions below (exported: it runs under timeout in a new bash,
# whose process group, a started server included, timeout ends).
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 15)); then
        printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
        echo "=== $name: skipped, the budget is spent" >>"$LOG"
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s, $((BUDGET - left))s into the check): $*" >>"$LOG"
    local began rc
    began=$(date +%s%N)
    timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >>"$LOG" 2>&1
    rc=$?
    printf '%s\t%s\t%d\n' "$name" "$rc" $((($(date +%s%N) - began) / 1000000)) >>"$STEPS"
    echo "=== $name: exit $rc" >>"$LOG"
    return $rc
}

install_wheels() {
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$WHEELS"/*.whl || return
        echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $WORK/site"
    else
        echo "no wheels in $WHEELS: using what this python has"
    fi
}

show_env() {
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("triton", "transformers", "msgspec", "litestar", "llguidance"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # reported, not fatal: the step that needs it fails on its own
        print(name, "missing:", exc)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), torch.cuda.mem_get_info())
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    return 0
}

# serve CORE: helios serve on the device, driven by serve_bench.py at $LEVELS streams, then stopped.
serve() {
    cat >"$WORK/server.toml" <<EOF
[server]
device = "$DEVICE"
max_concurrency = 64
kv_memory_mb = 4096
EOF
    "$PY" -m helios serve "$1" --config "$WORK/server.toml" --port "$PORT" >"$OUT/server.log" 2>&1 &
    local server=$! rc=1
    for _ in $(seq 240); do
        if "$PY" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2>/dev/null; then
            "$PY" benchmarks/serve_bench.py "http://127.0.0.1:$PORT" --scenario sweep --levels "$LEVELS" \
                --device "$DEVICE" --json "$WORK/serve.json"
            rc=$?
            break
        fi
        kill -0 $server 2>/dev/null || { echo "helios serve exited (server.log)"; break; }
        sleep 1
    done
    kill $server 2>/dev/null
    wait $server 2>/dev/null
    return $rc
}

engine() {  # engine NAME: engine_bench on cores/NAME, graphs on (and off, on CUDA)
    "$PY" benchmarks/engine_bench.py "$WORK/cores/$1/core" --device "$DEVICE" --batches "$ROWS" \
        --tokens "$TOKENS" --json "$WORK/engine_$1.json" || return
    [[ $DEVICE == cpu ]] && return 0
    "$PY" benchmarks/engine_bench.py "$WORK/cores/$1/core" --device "$DEVICE" --batches "$ROWS" \
        --tokens "$TOKENS" --no-graphs --json "$WORK/engine_$1_eager.json"
}

hf() {  # hf NAME: transformers generate on cores/NAME's checkpoint
    "$PY" benchmarks/gpu_models.py generate "$WORK/cores/$1/checkpoint" --device "$DEVICE" --batches "$HF_BATCHES" \
        --tokens "$HF_TOKENS" --json "$WORK/hf_$1.json"
}

export DEVICE WHEELS OUT PY WORK PORT SMALL ROWS TOKENS LEVELS HF_BATCHES HF_TOKENS
export -f install_wheels show_env serve engine hf
step wheels 120 install_wheels && [[ -d $WORK/site ]] && export PYTHONPATH=$WORK/site:$REPO
step env 60 show_env
step cores 240 "$PY" benchmarks/gpu_models.py cores "$WORK/cores" --shapes tiny,smollm2 $SMALL --json "$WORK/cores.json"
step cuda_check 150 "$PY" benchmarks/cuda_check.py "$WORK/cores/tiny/core" --device "$DEVICE" --json "$WORK/cuda_check.json"
step engine_smollm2 150 engine smollm2
step serve_smollm2 150 serve "$WORK/cores/smollm2/core"
step hf_smollm2 90 hf smollm2
step cores_1b 240 "$PY" benchmarks/gpu_models.py cores "$WORK/cores" --shapes 1b $SMALL --json "$WORK/cores_1b.json"
step engine_1b 150 engine 1b
step hf_1b 90 hf 1b

# The summary runs whatever time is left: every result file, and the issue's targets where measured.
"$PY" - "$WORK" "$OUT/summary.json" "$DEVICE" "$(($(date +%s) - START))" <<'EOF' >>"$LOG" 2>&1
import json, sys
from pathlib import Path

work, out, device, seconds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, took = line.split("\t")
    steps[name] = {"exit": status, "seconds": round(int(took) / 1e3, 1)}
results = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))}


def rate(name, batch):
    rows = {r["batch"]: r["tokens_per_s"] for r in results.get(name, {}).get("rows", [])}
    return rows.get(batch)


targets = {}
on, off = rate("engine_smollm2", 1), rate("engine_smollm2_eager", 1)
if on and off:
    targets["graphs_on_over_off_1_row (>= 3)"] = round(on / off, 2)
if on:
    targets["smollm2_bf16_ms_per_token_1_row (< 1.5)"] = round(1e3 / on, 3)
cores = {c["name"]: c for key in ("cores", "cores_1b") for c in results.get(key, [])}
one_b = rate("engine_1b", 1)
if one_b and "1b" in cores:
    bound_ms = cores["1b"]["decode_weight_bytes"] / 4.8e12 * 1e3  # H200 HBM: 4.8 TB/s
    targets["1b_ms_per_token_1_row"] = round(1e3 / one_b, 3)
    targets["1b_hbm_bound_ms"] = round(bound_ms, 3)
    targets["1b_over_hbm_bound (<= 2)"] = round(1e3 / one_b / bound_ms, 2)
for name in ("smollm2", "1b"):
    for batch in (1, 32):
        ours, theirs = rate(f"engine_{name}", batch), rate(f"hf_{name}", batch)
        if ours and theirs:
            targets[f"{name}_over_transformers_batch_{batch} (>= 5)"] = round(ours / theirs, 2)
summary = {"device": device, "seconds": seconds, "steps": steps, "targets": targets, "results": results}
out.write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({"device": device, "seconds": seconds, "steps": steps, "targets": targets}, indent=2))
EOF
echo "gpu_check: $(($(date +%s) - START))s; results in $OUT (summary.json, log.txt, server.log)"
tail -n 40 "$LOG"
awk -F'\t' '$2 != "0" { failed = 1 } END { exit failed }' "$STEPS"
