#!/usr/bin/env bash
# Real cuda-checkpoint park/restore time against bytes and the host link (needs a GPU).
#
#   bench/gpu_check.sh [OUT.md] [SIZES_GIB...]      default: bench/gpu_check.md, 1 2 4 8 16 32
#
# For each size N it starts a torch process holding N GiB on GPU 0 (filled, so the pages
# are real), then times `cuda-checkpoint --action lock`, `checkpoint` (park: device ->
# host), `restore` (host -> device) and `unlock` (or `--toggle` on drivers whose tool has
# no --action), checks with torch that the data survived, and measures the host link
# itself: pinned device->host and host->device copies of the same N GiB with torch. It
# writes the same table as BENCHMARKS.md's switch table uses (park / restore time, bytes /
# link bound, ratio) to OUT.md, which `make bench` includes in BENCHMARKS.md.
#
# Environment: PYTHON (default .venv/bin/python, else python3; needs torch with CUDA),
# CUDA_CHECKPOINT (default: cuda-checkpoint on PATH).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT=${1:-bench/gpu_check.md}
shift || true
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(1 2 4 8 16 32)
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
CC=${CUDA_CHECKPOINT:-cuda-checkpoint}

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: no GPU here" >&2; exit 2; }
command -v "$CC" >/dev/null || { echo "gpu_check: $CC not found" >&2; exit 2; }
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    { echo "gpu_check: torch sees no CUDA device" >&2; exit 2; }

if "$CC" --help 2>&1 | grep -q -- '--action'; then MODE=action; else MODE=toggle; fi
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader -i 0)
TMP=$(mktemp -d)
HOLDER_PID=
cleanup() {
    [ -n "$HOLDER_PID" ] && kill "$HOLDER_PID" 2>/dev/null || true
    rm -rf "$TMP"
}
trap cleanup EXIT

# The holder: allocates N GiB, measures the pinned copy bandwidth, then waits for lines on
# stdin: "check" verifies the data (after a restore), "quit" exits.
cat >"$TMP/holder.py" <<'EOF'
import sys, time, torch
n = int(float(sys.argv[1]) * (1 << 30))
x = torch.empty(n, dtype=torch.uint8, device="cuda")
x.fill_(7)
torch.cuda.synchronize()
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
t0 = time.perf_counter(); host.copy_(x); torch.cuda.synchronize(); d2h = time.perf_counter() - t0
t0 = time.perf_counter(); x.copy_(host); torch.cuda.synchronize(); h2d = time.perf_counter() - t0
del host
print(f"ready {d2h:.6f} {h2d:.6f}", flush=True)
for line in sys.stdin:
    if line.strip() == "check":
        ok = bool((x[:: 1 << 20] == 7).all().item())
        print("ok" if ok else "corrupt", flush=True)
    elif line.strip() == "quit":
        break
EOF

now() { date +%s.%N; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) * 1000 }'; }
cc() { "$CC" "$@" >/dev/null; }

ROWS=()
for N in "${SIZES[@]}"; do
    mkfifo "$TMP/in.$N"
    "$PYTHON" "$TMP/holder.py" "$N" <"$TMP/in.$N" >"$TMP/out.$N" 2>"$TMP/err.$N" &
    HOLDER_PID=$!
    exec 3>"$TMP/in.$N"
    for _ in $(seq 600); do grep -q '^ready' "$TMP/out.$N" 2>/dev/null && break; sleep 0.1; done
    read -r _ D2H H2D < <(grep '^ready' "$TMP/out.$N") ||
        { echo "gpu_check: holder for $N GiB did not start:" >&2; cat "$TMP/err.$N" >&2; exit 1; }
    if [ "$MODE" = action ]; then
        t0=$(now); cc --action lock --pid "$HOLDER_PID"; t1=$(now)
        cc --action checkpoint --pid "$HOLDER_PID"; t2=$(now)
        USED=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader |
            awk -F, -v p="$HOLDER_PID" '$1 == p { print $2 }')
        cc --action restore --pid "$HOLDER_PID"; t3=$(now)
        cc --action unlock --pid "$HOLDER_PID"; t4=$(now)
        LOCK=$(ms "$t0" "$t1"); PARK=$(ms "$t1" "$t2"); REST=$(ms "$t2" "$t3"); UNL=$(ms "$t3" "$t4")
    else
        t0=$(now); cc --toggle --pid "$HOLDER_PID"; t2=$(now)
        USED=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader |
            awk -F, -v p="$HOLDER_PID" '$1 == p { print $2 }')
        cc --toggle --pid "$HOLDER_PID"; t4=$(now)
        LOCK=-; PARK=$(ms "$t0" "$t2"); REST=$(ms "$t2" "$t4"); UNL=-
    fi
    echo check >&3
    for _ in $(seq 100); do grep -qE '^(ok|corrupt)' "$TMP/out.$N" && break; sleep 0.1; done
    DATA=$(grep -E '^(ok|corrupt)' "$TMP/out.$N" || echo "no answer")
    echo quit >&3
    exec 3>&-
    wait "$HOLDER_PID" || true
    HOLDER_PID=
    ROWS+=("$(awk -v n="$N" -v lock="$LOCK" -v park="$PARK" -v rest="$REST" -v unl="$UNL" \
        -v d2h="$D2H" -v h2d="$H2D" -v used="${USED:-?}" -v data="$DATA" 'BEGIN {
        b = n * 1073741824
        printf "| %g GiB | %s | %s | %s | %s | %.1f / %.1f | %.0f / %.0f | %.2f / %.2f | %s | %s |",
            n, lock, park, rest, unl, b / (park / 1000) / 1e9, b / (rest / 1000) / 1e9,
            d2h * 1000, h2d * 1000, park / (d2h * 1000), rest / (h2d * 1000), used, data }')")
    echo "gpu_check: ${N} GiB done" >&2
done

{
    echo "Run on $(date -u +%Y-%m-%dT%H:%MZ): GPU ${GPU}; cuda-checkpoint mode: ${MODE}."
    echo "Bound: the same bytes copied with torch between the GPU and pinned host memory."
    echo
    echo "| held | lock ms | park (checkpoint) ms | restore ms | unlock ms | park / restore GB/s |" \
        "bound D2H / H2D ms | park / bound, restore / bound | GPU memory while parked | data after restore |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
} >"$OUT"
cat "$OUT"
