#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
timeout 120 python3 -m tools.probe_topk $OUT/probe_topk.json > $OUT/probe_topk.log 2>&1
cat $OUT/probe_topk.log
timeout 500 python3 -m pytest -q -m gpu --continue-on-collection-errors tests/ > $OUT/gpu_tests.txt 2>&1
tail -8 $OUT/gpu_tests.txt
