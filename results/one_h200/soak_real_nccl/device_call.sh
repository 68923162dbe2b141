#!/usr/bin/env bash
# This soak was started by the same device calls as the GPU-host suite run beside it:
# ../suite_on_gpu_host/attempt_2026-12-02/device_call.sh (call 1 starts both; calls 2-3 poll and collect).
exec bash "$(dirname "$0")/../suite_on_gpu_host/attempt_2026-12-02/device_call.sh" "$@"
