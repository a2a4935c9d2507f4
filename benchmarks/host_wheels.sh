#!/usr/bin/env bash
# Wheels for the GPU host (CPython 3.12, manylinux x86-64, no dependencies resolved: name each one):
#   bash benchmarks/host_wheels.sh DIR NAME[==VERSION] ...
# The device tool carries DIR; the host installs it with pip --no-index --no-deps --target.
set -u
dir=${1:?DIR}; shift
mkdir -p "$dir"
for w in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$w" || exit 1
done
