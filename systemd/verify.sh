#!/usr/bin/env bash
# Check every unit and snippet in this directory the way systemd will load them; silent
# and exit 0 when all is well, otherwise print what systemd said and exit 1.
#
#   systemd/verify.sh [BIN]     BIN: where slicerd, slicer-launch, slicer-dispatch are
#                               (default: the checkout's .venv/bin)
#
# The units name /usr/local/bin/...; `systemd-analyze verify` checks that each ExecStart
# binary exists and is executable, so the units are checked from a copy whose
# /usr/local/bin/ is rewritten to BIN: the installed console scripts, not stand-ins.
# Any output of systemd-analyze (warnings included) fails the check.
# SLICER_UNITS_DIR overrides the directory checked (the tests use a broken copy).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
src=${SLICER_UNITS_DIR:-$here}
bin=$(cd "${1:-$here/../.venv/bin}" && pwd)

if ! command -v systemd-analyze >/dev/null; then
    echo "verify.sh: systemd-analyze not found: unit verification skipped" >&2
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

units=()
for f in "$src"/*.service "$src"/*.socket; do
    [ -e "$f" ] || continue
    sed "s#/usr/local/bin/#$bin/#g" "$f" >"$tmp/$(basename "$f")"
    units+=("$tmp/$(basename "$f")")
    for exe in $(grep -o '/usr/local/bin/[A-Za-z0-9_.-]*' "$f" | sort -u); do
        if [ ! -x "$bin/${exe##*/}" ]; then
            echo "verify.sh: $(basename "$f"): ${exe##*/} is not installed in $bin (pip install -e .)"
            fail=1
        fi
    done
done
[ "$fail" = 0 ] || exit 1

# The command this check is about. Units are loaded from their directory (a template
# such as slicer-vllm@.service is checked as the instance slicer-vllm@i.service);
# --man=no: Documentation= man pages need not be installed here.
out=$(cd "$tmp" && systemd-analyze verify --man=no "${units[@]}" 2>&1) || fail=1
if [ -n "$out" ]; then
    printf 'systemd-analyze verify --man=no %s\n%s\n' "${units[*]##*/}" "$out"
    fail=1
fi

# sysusers and tmpfiles snippets: applied to an empty root, they must create the group and
# the directories with the modes the units rely on, without a notice or warning (their
# info lines, "Creating group ...", are what they are supposed to do).
root="$tmp/root"
mkdir -p "$root/etc"
for step in "systemd-sysusers --root=$root $src/sysusers.d/slicer.conf" \
    "systemd-tmpfiles --root=$root --create $src/tmpfiles.d/slicer.conf"; do
    out=$(SYSTEMD_LOG_LEVEL=notice $step 2>&1) || fail=1
    if [ -n "$out" ]; then
        printf '%s\n%s\n' "${step//$tmp/TMP}" "$out"
        fail=1
    fi
done
grep -q '^slicer:' "$root/etc/group" 2>/dev/null || { echo "sysusers: no group slicer"; fail=1; }
for want in "/run/slicer 755" "/var/lib/slicer 750"; do
    set -- $want
    got=$(stat -c %a "$root$1" 2>/dev/null || echo missing)
    [ "$got" = "$2" ] || { echo "tmpfiles: $1 is $got, want $2"; fail=1; }
done
exit "$fail"
