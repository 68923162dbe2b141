set -u; cd .stage/clean
mkdir -p /tmp/nccl && python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.nccl/libnccl.so.2.xz'),open('/tmp/nccl/libnccl.so.2','wb'))"
python -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
export LD_PRELOAD=/tmp/nccl/libnccl.so.2
timeout 70 python -m tests.gpu.run_all --out $OUT/ra --small-buffers --only core --cycles 3 > $OUT/core.log 2>&1; echo "rc=$?" >> $OUT/core.log
timeout 170 python -m pytest -ra -q -p no:cacheprovider tests/test_bad_input.py tests/test_trl_vllm_driver.py tests/test_vllm_bundle.py tests/test_gpu_drivers_on_cpu.py tests/test_gpu_nvml_reading.py tests/test_gpu_suite_report.py > $OUT/modules.log 2>&1; echo "rc=$?" >> $OUT/modules.log
tail -3 $OUT/core.log; tail -15 $OUT/modules.log
