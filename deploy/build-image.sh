#!/bin/bash
# Build the gpu-slicer image (Containerfile) with buildah where no image registry is
# reachable: the base is bootstrapped from Debian's packages (debootstrap), pip still uses
# the configured Python package index. As root, on Debian/Ubuntu:
#
#   apt-get install -y buildah debootstrap
#   deploy/build-image.sh [WORKDIR]          # default WORKDIR: build/image
#
# WORKDIR keeps the bootstrapped root file system and buildah's storage (vfs, chroot
# isolation: it works inside a container too); a second run reuses the base. The image is
# left as localhost/gpu-slicer:VERSION in that storage and as WORKDIR/gpu-slicer.tar (a
# docker archive: `ctr -n k8s.io images import`, `kind load image-archive`).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(realpath -m "${1:-build/image}")
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
mkdir -p "$work"
B=(buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs)
export BUILDAH_ISOLATION=chroot

if ! "${B[@]}" images --quiet localhost/debian-python:bookworm >/dev/null 2>&1; then
    if [ ! -x "$work/rootfs/usr/bin/python3" ]; then
        debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian
        cp /etc/resolv.conf "$work/rootfs/etc/resolv.conf"
        chroot "$work/rootfs" sh -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
            && apt-get clean && rm -rf /var/lib/apt/lists/*'
    fi
    c=$("${B[@]}" from scratch)
    "${B[@]}" copy "$c" "$work/rootfs" /
    "${B[@]}" commit "$c" localhost/debian-python:bookworm
    "${B[@]}" rm "$c"
fi

# A host whose package index needs its own CA bundle (PIP_CERT, or pip's `cert`) lends it
# to the build's RUN steps; nothing of it lands in the image.
mounts=()
cert=${PIP_CERT:-$(pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    printf '[global]\ncert = /etc/pip-ca.crt\n' >"$work/pip.conf"
    mounts=(-v "$cert:/etc/pip-ca.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
fi
"${B[@]}" build --isolation chroot "${mounts[@]}" \
    --build-arg BASE=localhost/debian-python:bookworm \
    -f Containerfile -t "localhost/gpu-slicer:$version" .
# A smoke check of what was built: the tools run, and nothing of a build or a test is in it.
c=$("${B[@]}" from "localhost/gpu-slicer:$version")
trap '"${B[@]}" rm "$c" >/dev/null' EXIT
"${B[@]}" run --isolation chroot "$c" -- slicerd --version
"${B[@]}" run --isolation chroot "$c" -- slicer-dispatch --help >/dev/null
"${B[@]}" run --isolation chroot "$c" -- sh -c \
    '! command -v gcc && ! command -v cc && ! python3 -c "import stubs" 2>/dev/null'
rm -f "$work/gpu-slicer.tar"
# A docker archive keeps the name `gpu-slicer:VERSION`, which `ctr images import` turns into
# docker.io/library/gpu-slicer:VERSION, the name the kubelet looks up for `image:`.
"${B[@]}" push "localhost/gpu-slicer:$version" "docker-archive:$work/gpu-slicer.tar:gpu-slicer:$version"
echo "built localhost/gpu-slicer:$version ($work/gpu-slicer.tar)"
