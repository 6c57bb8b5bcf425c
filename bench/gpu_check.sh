#!/usr/bin/env bash
# The GPU check: park and restore real GPU memory through slicerd, with the cuda-checkpoint
# CLI parker and with the driver-API parker, and report GB/s against the host link.
#
#   bench/gpu_check.sh [--sizes 4,16] [--repeats 3] [--parkers cli,driver]   (from the repo)
#   bench/gpu_check.sh --fake [--sizes 0.25,0.5] [--repeats 1]     the same on the test doubles
#
# Needs one NVIDIA GPU with its driver (libcuda.so.1; nvidia-smi optional), a C compiler
# (gcc or cc) and Python 3; no CUDA toolkit, no internet. It builds bench/gpu_check/gpumem.c
# (a holder that dlopens libcuda.so.1 and fills N GiB), probes GPU 0 with it, finds a Python
# with the project's dependencies ($SLICER_VENV, else ./.venv; else it makes ./.venv with
# `python3 -m venv` and `pip install -e .`, from $WHEELS with --no-index when set) and runs
# bench/gpu_check/driver.py, which starts slicerd (nvml backend) once per parker and
# measures. Figures go to stdout and to ${OUT:-.}/gpu_check.json (and gpu_check.md).
# The whole run is bounded (GPU_CHECK_BUDGET seconds for the measurement, default: what is
# left of 280 s), and everything it starts is ended on exit, on failure and ^C too.
#
# Exit: 0 it ran; 77 nothing to check here (no GPU or driver, or neither cuda-checkpoint nor
# the driver's checkpoint API: the line says why); 1 a failed verify, park or restore (or a
# GPU that fails outside the check); 2 a prerequisite is missing (compiler, Python deps).
# Environment: LIBCUDA (the driver library, default: found with ldconfig), CC, SLICER_VENV,
# WHEELS, OUT, GPU_CHECK_BUDGET.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
START=$SECONDS
OUT_DIR=${OUT:-.}
FAKE=0
for a in "$@"; do [ "$a" = --fake ] && FAKE=1; done

say() { echo "gpu_check: $*"; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || { say "cannot make a temp dir"; exit 2; }
DRIVER_PID=

alive() { kill -0 "$1" 2>/dev/null; }
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$DRIVER_PID" ]; then
        # SIGTERM first: the driver quits its holder and stops slicerd, which lets a
        # cuda-checkpoint in flight end (never kill it mid-operation); bounded, then KILL.
        if alive "$DRIVER_PID"; then
            kill -TERM "$DRIVER_PID" 2>/dev/null
            for _ in $(seq 240); do alive "$DRIVER_PID" || break; sleep 0.5; done
        fi
        # The driver leads its own process group: whatever it left behind goes too.
        kill -KILL -- "-$DRIVER_PID" 2>/dev/null
        kill -KILL "$DRIVER_PID" 2>/dev/null
        wait "$DRIVER_PID" 2>/dev/null
    fi
    rm -rf "$TMP"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

find_libcuda() {
    if [ -n "${LIBCUDA:-}" ]; then
        [ -e "$LIBCUDA" ] && echo "$LIBCUDA"
        return
    fi
    local ldc p d
    ldc=$(command -v ldconfig || echo /sbin/ldconfig)
    p=$("$ldc" -p 2>/dev/null | awk '$1 == "libcuda.so.1" { print $NF; exit }')
    if [ -n "$p" ]; then echo "$p"; return; fi
    for d in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib \
        /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/wsl/lib; do
        if [ -e "$d/libcuda.so.1" ]; then echo "$d/libcuda.so.1"; return; fi
    done
}

DRIVER_ARGS=()
if [ "$FAKE" = 0 ]; then
    LIB=$(find_libcuda)
    if [ -z "$LIB" ]; then
        say "no NVIDIA driver here (libcuda.so.1 not found${LIBCUDA:+ at $LIBCUDA}, by ldconfig or in the usual lib dirs): nothing to check"
        exit 77
    fi
    COMPILER=${CC:-}
    [ -n "$COMPILER" ] || COMPILER=$(command -v gcc || command -v cc || true)
    if [ -z "$COMPILER" ] || ! command -v "$COMPILER" >/dev/null; then
        say "no C compiler (gcc or cc) to build the memory holder bench/gpu_check/gpumem.c: install one (e.g. apt-get install gcc) or set CC"
        exit 2
    fi
    # No -Werror here: a newer compiler's new warning must not stop the check (the tests
    # build it with -Werror).
    if ! "$COMPILER" -O2 -std=c11 -Wall -Wextra -o "$TMP/gpumem" bench/gpu_check/gpumem.c -ldl \
        2>"$TMP/cc.err"; then
        say "$COMPILER could not build bench/gpu_check/gpumem.c:"
        cat "$TMP/cc.err" >&2
        exit 2
    fi
    PROBE=$(timeout 120 "$TMP/gpumem" --lib "$LIB" probe 2>"$TMP/probe.err")
    rc=$?
    if [ "$rc" = 77 ]; then
        say "no usable GPU: $(tail -n 1 "$TMP/probe.err")"
        exit 77
    elif [ "$rc" != 0 ]; then
        say "probing GPU 0 failed (rc $rc): $(tail -n 1 "$TMP/probe.err")"
        exit 1
    fi
    say "built gpumem with $COMPILER; driver library $LIB"
    DRIVER_ARGS=(--gpumem "$TMP/gpumem" --probe "$PROBE" --libcuda "$LIB")
fi

# A Python with the project's dependencies (and the test doubles for --fake).
IMPORTS='import trio, psutil, click, pynvml, httpx, gpu_slicer.slicer.daemon'
[ "$FAKE" = 1 ] && IMPORTS="$IMPORTS, stubs.stack"
has_deps() { [ -x "$1" ] && "$1" -c "$IMPORTS" >/dev/null 2>&1; }
PY=
for cand in "${SLICER_VENV:+$SLICER_VENV/bin/python}" ./.venv/bin/python; do
    if [ -n "$cand" ] && has_deps "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
    if [ "$FAKE" = 1 ]; then
        say "--fake needs the test doubles installed: run make test's setup (make .venv/.installed) first"
        exit 2
    fi
    command -v python3 >/dev/null || { say "no python3 here"; exit 2; }
    if [ ! -x ./.venv/bin/python ] && ! python3 -m venv ./.venv >"$TMP/venv.log" 2>&1; then
        say "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv): $(tail -n 1 "$TMP/venv.log")"
        exit 2
    fi
    PIP=(./.venv/bin/python -m pip install -q -e .)
    [ -n "${WHEELS:-}" ] && PIP+=(--no-index --find-links "$WHEELS")
    say "installing the project's dependencies into ./.venv (${WHEELS:+from $WHEELS, }about a minute)"
    if ! timeout 240 "${PIP[@]}" >"$TMP/pip.log" 2>&1 || ! has_deps ./.venv/bin/python; then
        say "missing Python deps (trio, psutil, click, nvidia-ml-py, httpx, ...) and pip could not install them (no network? set WHEELS=DIR of wheels, or SLICER_VENV=a venv that has them): $(tail -n 1 "$TMP/pip.log")"
        exit 2
    fi
    PY=./.venv/bin/python
fi

BUDGET=${GPU_CHECK_BUDGET:-$((280 - (SECONDS - START)))}
[ "$BUDGET" -ge 60 ] || BUDGET=60
mkdir -p "$OUT_DIR" || { say "cannot write to $OUT_DIR"; exit 2; }
"$PY" bench/gpu_check/driver.py "${DRIVER_ARGS[@]}" --budget "$BUDGET" \
    --json "$OUT_DIR/gpu_check.json" --markdown "$OUT_DIR/gpu_check.md" "$@" &
DRIVER_PID=$!
wait "$DRIVER_PID"
rc=$?
DRIVER_PID_DONE=$DRIVER_PID
DRIVER_PID=
# Whatever the driver's process group still holds (it ends its children itself).
kill -KILL -- "-$DRIVER_PID_DONE" 2>/dev/null
say "done in $((SECONDS - START)) s (rc $rc); figures in $OUT_DIR/gpu_check.json"
exit "$rc"
