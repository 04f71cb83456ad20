# One device call (issue 58): GPU tests of the fast paths, then each seed method's paper-size ideal rounds.
set -u
mkdir -p /tmp/ab
B="python -m rayfed bench --ideal-only --no-reference --rounds 2"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_frozen_weights.py tests/test_fused_attention.py \
  "tests/test_feddat.py::test_a_captured_feddat_update_uploads_the_eager_updates_numbers" 2>&1 | tail -6 > $OUT/gpu_tests.txt
cat $OUT/gpu_tests.txt
timeout 130 $B --workload feddat --out /tmp/ab/feddat --set train.local_epochs=null train.local_steps=20 > /tmp/ab/feddat.log 2>&1
timeout 120 $B --workload tap --out /tmp/ab/tap --set train.local_steps=5 > /tmp/ab/tap.log 2>&1
timeout 70 $B --workload pfedmma --out /tmp/ab/pfedmma --set train.local_epochs=null train.local_steps=5 > /tmp/ab/pfedmma.log 2>&1
for w in feddat tap pfedmma; do echo "== $w"; grep -E "^\| [A-Za-z]|round|captur|warn|Error" /tmp/ab/$w.log | head -8; done
tar czf $OUT/ab.tar.gz -C /tmp ab
