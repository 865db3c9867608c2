#!/bin/bash
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print('L2', p.L2_cache_size, p)" > $OUT/props.txt 2>&1
timeout 300 python3 -m pytest -q -m gpu -x tests/test_kernels_l2_prefetch.py "tests/test_gpu_engine.py::test_l2_prefetch_decode_equals_default" > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
timeout 280 python3 -m tools.bench_decode_variants --trace --budget-s 220 --only "L2_PREFETCH=o,L2_PREFETCH=q,L2_PREFETCH=oq,L2_PREFETCH=oq MODE=line_last,L2_PREFETCH=oq MODE=bulk,L2_PREFETCH=oq MODE=load" --out $OUT/variants.json > $OUT/variants.log 2>&1
tail -15 $OUT/variants.log
