#!/usr/bin/env bash
# Builds the Horovod wheel the TensorFlow variant uses (gloo controller, TensorFlow ops, no MPI, no
# PyTorch), with the two fixes Horovod 0.28.1 needs on TensorFlow 2.21:
#   * its optional XLA ops (xla_mpi_ops.cc) include XLA headers TF no longer ships (highwayhash): left out;
#   * TF ≥ 2.10 headers need C++17, which its CMake already picks for TF (kept as is).
# The same script runs in the image build (training/images/Dockerfile) and for the local tests (Makefile),
# so both train with the same Horovod.
#
#   training/images/tensorflow/build-horovod.sh PYTHON WHEEL_DIR
set -euo pipefail

PYTHON=${1:?python interpreter that has tensorflow installed}
WHEEL_DIR=${2:?directory to put the wheel in}
VERSION=0.28.1
SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "horovod==$VERSION" -d "$work"
echo "$SHA256  $work/horovod-$VERSION.tar.gz" | sha256sum --check --quiet
tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"
sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"

# With a CUDA build of TensorFlow (the GPU DLC), gradients are all-reduced by NCCL on the GPUs; gloo
# still coordinates the ranks and reduces CPU tensors. A CPU build (the local tests) gets gloo only.
if [ "$("$PYTHON" -c 'import tensorflow as tf; print(tf.test.is_built_with_cuda())' 2>/dev/null)" = "True" ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
fi

mkdir -p "$WHEEL_DIR"
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
MAKEFLAGS="-j$(nproc)" \
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$WHEEL_DIR" "$src"
