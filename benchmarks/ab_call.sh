# One device call (issue 58): GPU tests of the fast paths, then the seed methods' paper-size ideal rounds, each
# stopped by its own limit (what ran comes back in $OUT/ab.tar.gz).
set -u
mkdir -p /tmp/ab
B="python -m rayfed bench --ideal-only --no-reference --rounds 2"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_frozen_weights.py \
  "tests/test_feddat.py::test_a_captured_feddat_update_uploads_the_eager_updates_numbers" \
  "tests/test_fedmosaic.py::test_a_captured_fedmosaic_update_uploads_the_eager_updates_numbers" \
  "tests/test_fedmosaic.py::test_a_captured_feddpa_update_keeps_the_eager_updates_adapters_and_profile" \
  2>&1 | tail -4 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 110 $B --workload feddat --out /tmp/ab/feddat --set train.local_epochs=null train.local_steps=20 > /tmp/ab/feddat.log 2>&1
tar czf $OUT/ab.tar.gz -C /tmp ab
timeout 100 $B --workload tap --out /tmp/ab/tap --set train.local_steps=5 > /tmp/ab/tap.log 2>&1
timeout 160 python -m rayfed.benchmarks.gpu_profile /tmp/ab/fedmosaic_profile --workloads fedmosaic --budget-s 150 \
  > /tmp/ab/fedmosaic.log 2>&1
for w in feddat tap fedmosaic; do echo "== $w"; grep -E "^\| [A-Za-z]|round|captur|warn|Error" /tmp/ab/$w.log | head -8; done
tar czf $OUT/ab.tar.gz -C /tmp ab
