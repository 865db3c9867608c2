#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
timeout 300 python3 -m pytest -q -m gpu tests/test_kernels_filter.py tests/test_sampler.py tests/test_kernels_greedy.py tests/test_gpu_engine.py > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
timeout 60 python3 -m tools.bench_sampler --top-k 20 --temperature 0.6 --logit-scale 3 --out $OUT/bench_sampler_qwen3.json > $OUT/bench_sampler_qwen3.log 2>&1
cat $OUT/bench_sampler_qwen3.log
timeout 60 python3 -m tools.bench_sampler --top-k 0 --out $OUT/bench_sampler.json > $OUT/bench_sampler.log 2>&1
cat $OUT/bench_sampler.log
