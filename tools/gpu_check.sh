#!/usr/bin/env bash
# The prepared GPU check (issue 19): equivalence of the engine with the single-device
# reference on the real GPU (K = 1, and K = 2, 4 as logical GPUs split from it), then
# `python -m owt_tf.bench` of the paper's AlexNet, single vs data vs owt-a/b/c at K = 2, 4,
# --jit off and on, fp32 and (when bench has --precision) bf16; one table at the end.
# Never runs past 8 minutes. Exit 0 passed, 1 a failure or a part that ran out of time,
# 2 no NVIDIA GPU.
#
#   tools/gpu_check.sh                     # on the GPU machine
#   tools/gpu_check.sh --allow-cpu --quick # the same code on logical CPUs, tiny sizes
set -u
cd "$(dirname "$0")/.."
# The parts bound themselves (tools/gpu_check.py); this is the backstop for the whole.
timeout --kill-after=10 480 python tools/gpu_check.py "$@"
code=$?
if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
    echo "tools/gpu_check.sh: error: stopped at the 8-minute limit" >&2
    exit 1
fi
exit "$code"
