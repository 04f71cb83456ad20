"""issue 58's bench tooling: MFU's peaks, the profile's kernel families and breakdown, time to result, and the
one-command GPU profile's budget (benchmarks/{mfu,update_profile,time_to_result,gpu_profile}.py)."""

from __future__ import annotations

import json
import sys
import tarfile
import time

import pytest
import yaml

from rayfed.benchmarks import gpu_profile
from rayfed.benchmarks.method_bench import METHOD_WORKLOADS, REPO
from rayfed.benchmarks.mfu import bf16_peak, mfu, mfu_footnote
from rayfed.benchmarks.time_to_result import (first_round_setup, first_round_setup_markdown, paper_schedule, sweep_size,
                                             time_to_result, time_to_result_markdown)
from rayfed.benchmarks.update_profile import (TraceEvent, breakdown, host_phase_ranges, kernel_family, phase_seconds,
                                              profile_local_update, union_us)
from rayfed.config import load_config
from rayfed.errors import ConfigError

KERNELS = [  # names as torch.profiler reports them on H100 / H200 / A100
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
     "cublas", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
     "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>, false>("
     "Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<pytorch_flash::Flash_bwd_kernel_traits<64, "
     "128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, true>(pytorch_flash::Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
     "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, "
     "2> >(int, ...)", "elementwise"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
     "float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, ...)", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, "
     "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)",
     "normalization"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4, 4> >(...)", "reduction"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#3}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, "
     "unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(...)", "copy"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float*, float*>(...)",
     "optimizer"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>", "elementwise"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>",
     "other"),
    # a CPU's ops, for the profile without a GPU
    ("aten::addmm", "gemm"), ("aten::_to_copy", "copy"), ("aten::native_layer_norm", "normalization"),
    ("aten::_foreach_add_", "optimizer"), ("aten::mul_", "elementwise"), ("aten::sum", "reduction"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"), ("aten::view", "other"),
]


@pytest.mark.parametrize("name, family", KERNELS)
def test_each_kernel_or_op_falls_in_its_family(name, family):
    assert kernel_family(name) == family


@pytest.mark.parametrize("device, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0)])
def test_the_peak_is_the_named_gpu_models_dense_bf16(device, peak):
    assert bf16_peak(device)[0] == peak


def test_an_unknown_gpu_a_cpu_or_an_h100_of_unnamed_form_get_no_mfu_and_say_why():
    assert bf16_peak("NVIDIA L40") == (None, "no dense bf16 peak is on record for 'NVIDIA L40' "
                                             "(benchmarks/mfu.py's BF16_PEAKS)")
    assert bf16_peak("NVIDIA A10G")[0] is None and bf16_peak(None) == (None, "no GPU: MFU is a share of a GPU's bf16 "
                                                                              "peak")
    peak, reason = bf16_peak("NVIDIA H100")
    assert peak is None and "SXM (989 TFLOP/s) or PCIe (756)" in reason
    assert mfu(247.25, 989.0) == 0.25 and mfu(247.25, None) is None and mfu(None, 989.0) is None
    assert "MFU is blank: no GPU" in mfu_footnote({"bf16_peak_tflops": None, "peak_note": bf16_peak(None)[1]})


def test_the_breakdown_counts_busy_time_once_and_splits_families_copies_waits_and_host_time():
    events = [
        TraceEvent("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", True, 0, 400),
        TraceEvent("flash_fwd_kernel<...>", True, 300, 500),  # overlaps the gemm on another stream
        TraceEvent("Memcpy HtoD (Pageable -> Device)", True, 600, 700),
        TraceEvent("Memcpy DtoH (Device -> Pinned)", True, 800, 850),
        TraceEvent("gpu annotation", True, 0, 1000, annotation=True),  # not a kernel
        TraceEvent("aten::addmm", False, 0, 100, self_us=60),
        TraceEvent("aten::mm", False, 20, 60, self_us=40),  # a child of addmm
        TraceEvent("cudaLaunchKernel", False, 50, 55, self_us=5),
        TraceEvent("cudaStreamSynchronize", False, 700, 860, self_us=160),
        TraceEvent("rayfed phase: batch building", False, 0, 900, annotation=True),
    ]
    result = breakdown(events, wall_s=1e-3, phases={"batch building": 9e-4})
    cuda = result["cuda"]
    assert cuda["busy_s"] == pytest.approx(650e-6) and cuda["kernel_s"] == pytest.approx(750e-6)
    assert cuda["idle_fraction"] == pytest.approx(0.35)
    families = cuda["families"]
    assert families["gemm"]["s"] == pytest.approx(400e-6) and families["attention"]["count"] == 1
    assert families["copy"]["s"] == pytest.approx(150e-6) and families["copy"]["share"] == pytest.approx(0.2)
    assert result["copies"]["h2d"] == {"s": pytest.approx(100e-6), "count": 1}
    assert result["copies"]["d2h"]["count"] == 1 and result["copies"]["d2d"]["count"] == 0
    assert result["waits"]["cudaStreamSynchronize"] == {"s": pytest.approx(160e-6), "count": 1}
    host = result["host"]
    assert host["ops_self_s"] == pytest.approx(100e-6) and host["in_ops_s"] == pytest.approx(100e-6)
    assert host["between_ops_s"] == pytest.approx(900e-6) and host["cuda_runtime_s"] == pytest.approx(165e-6)
    assert host["phases_s"] == {"batch building": 9e-4} and cuda["top"][0]["family"] == "gemm"
    assert union_us([(0, 2), (1, 3), (5, 6)]) == 4
    mirrored = [TraceEvent("rayfed phase: batch building", False, 0, 300, annotation=True),
                TraceEvent("rayfed phase: batch building", False, 100, 200, annotation=True),  # a nested call
                TraceEvent("rayfed phase: batch building", True, 0, 900, annotation=True)]  # the GPU's mirror
    assert phase_seconds(mirrored) == {"batch building": pytest.approx(300e-6)}


def test_host_phases_are_wrapped_while_profiled_then_restored_and_a_missing_one_is_named():
    from rayfed.training.client_context import ClientContext

    original = ClientContext.__dict__["batch_order"]
    phases = {"batch building": ("rayfed.training.client_context:ClientContext.batch_order",
                                 "rayfed.training.client_context:ClientContext.gone", "no_such_module:f")}
    with host_phase_ranges(phases) as missing:
        assert ClientContext.__dict__["batch_order"] is not original
        assert ClientContext.batch_order.__name__ == "batch_order"
    assert missing == ["rayfed.training.client_context:ClientContext.gone", "no_such_module:f"]
    assert ClientContext.__dict__["batch_order"] is original


def test_a_cpu_profile_of_a_training_loop_gives_op_families_and_the_files(tmp_path):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

    def update():
        for _ in range(3):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(16, 32)), torch.randint(0, 4, (16,))).backward()
            optimizer.step()

    result = profile_local_update(update, tmp_path)
    families = result["cpu_families"]
    assert "cuda" not in result and result["device"] == "CPU" and result["wall_s"] > 0
    for family in ("gemm", "normalization", "elementwise", "optimizer"):
        assert families[family]["count"] > 0 and families[family]["s"] > 0, family
    assert sum(f["share"] for f in families.values()) == pytest.approx(1.0)
    assert 0 < result["host"]["in_ops_s"] <= result["wall_s"]
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["cpu_families"]["gemm"]["count"] == families["gemm"]["count"]
    table = (tmp_path / "profile.md").read_text()
    assert "| gemm |" in table and "CPU ops' self time (no GPU)" in table and "aten::addmm" in table
    assert not (tmp_path / "trace.json").exists()


def test_the_paper_schedule_and_the_named_sweeps_come_from_the_configs():
    tap = paper_schedule(load_config(REPO / METHOD_WORKLOADS["tap"].config))
    assert (tap.rounds, tap.clients_per_round, tap.evaluations, tap.local_steps) == (200, 2, 4, 20)
    feddat = paper_schedule(load_config(REPO / METHOD_WORKLOADS["feddat"].config))
    assert feddat.local_steps is None and feddat.evaluations == 4  # local_epochs: the clients' data sets the steps

    def tune(workload):
        return sweep_size(yaml.safe_load((REPO / METHOD_WORKLOADS[workload].sweep).read_text())["tune"])

    margins = tune("tap")  # random search of 6 trials over 4 margins x 2 temperatures x 2 KD weights
    assert (margins["trials"], margins["settings"], margins["scheduler"]) == (6, 16, "asha")
    assert "methods.0.kd_temperature" in margins["parameters"]
    mosaic = tune("fedmosaic")  # a grid of 7 tau x 3 N_B x 3 seeds
    assert (mosaic["trials"], mosaic["settings"], mosaic["search"]) == (63, 63, "grid")
    assert sweep_size({"num_samples": 4, "search": "random", "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}}) == {
        "search": "random", "trials": 4, "settings": None, "scheduler": "fifo", "parameters": ["train.lr"]}
    assert METHOD_WORKLOADS["fedyolo"].sweep is None


def test_time_to_result_scales_the_updates_to_the_papers_steps_and_counts_the_evaluations():
    tap = paper_schedule(load_config(REPO / METHOD_WORKLOADS["tap"].config))
    sweep = {"config": "configs/tune/tap_margins.yaml", "search": "random", "trials": 6, "settings": 16,
             "scheduler": "asha", "parameters": ["methods.0.margins"]}
    # a measured round of 20 s, 18 of them the 2 clients' updates at 5 steps; the paper's 20 steps: 20 + 3 x 18 = 74 s
    estimate = time_to_result(tap, round_s=20.0, update_s=18.0, bench_steps=5, paper_steps=20, bench_clients=2,
                              evaluation_s=30.0, sweep=sweep)
    assert estimate["paper_round_s"] == pytest.approx(74.0)
    assert estimate["schedule_s"] == pytest.approx(200 * 74.0 + 4 * 30.0)
    assert estimate["trials_per_gpu_hour"] == pytest.approx(3600 / 14920)
    assert estimate["sweep"]["gpu_hours"] == pytest.approx(6 * 14920 / 3600)
    assert estimate["sweep"]["gpu_hours_every_setting"] == pytest.approx(16 * 14920 / 3600)
    text = time_to_result_markdown(estimate)
    assert "**4.14 GPU-hours**" in text and "an upper bound: ASHA" in text
    # one client of two measured: the paper's round trains twice the updates; no evaluation measured
    half = time_to_result(tap, 10.0, 9.0, 20, 20, 1)
    assert half["paper_round_s"] == pytest.approx(19.0) and not half["evaluations_included"]
    unknown = time_to_result(tap, 10.0, 9.0, 20, None, 1)
    assert unknown["schedule_s"] is None and "no estimate" in time_to_result_markdown(unknown)


def test_the_first_rounds_setup_is_its_updates_beyond_the_later_rounds_rate_a_client(tmp_path):
    # a first round of 2 clients in 5 s, later rounds at 1 s a client (3 s for 3 clients): 3 s of setup; a 20-round
    # run at the later rounds' 2.5 s: 3 / (3 + 50)
    rounds = [{"clients": [0, 1], "update_s": 5.0, "round_s": 6.0}, {"clients": [0, 1], "update_s": 2.0, "round_s": 3.0},
              {"clients": [2], "update_s": 1.0, "round_s": 2.0}]
    setup = first_round_setup(rounds)
    assert setup["setup_s"] == pytest.approx(3.0) and setup["share_of_run"] == pytest.approx(3 / 53)
    assert "3.0 s, 5.7% of a 20-round run" in first_round_setup_markdown(setup)
    assert first_round_setup(rounds[:1]) is None and first_round_setup_markdown(None) == ""
    (tmp_path / "bench.json").write_text(json.dumps({"machine": {"gpu": "NVIDIA H100 80GB HBM3"},
                                                     "method": {"first_round_setup": setup}}))
    row = gpu_profile.workload_summary("tap", tmp_path, "done", 60.0)
    assert "| tap | done | 60 |" in gpu_profile.summary_markdown([row], 600.0) and "| 3.0 | 5.7 |" in \
        gpu_profile.summary_markdown([row], 600.0)


def test_the_gpu_profile_shares_its_budget_stops_an_overrunning_workload_and_skips_the_rest(tmp_path, monkeypatch):
    assert gpu_profile.share_s(700.0, "tap", ["tap", "fedmosaic"]) == pytest.approx(700 * 200 / 320)
    fedmosaic = gpu_profile.workload_overrides("fedmosaic")
    assert "train.local_steps=5" in fedmosaic and "data.tasks.39.options.num_samples=40" in fedmosaic

    def sleeper(name, out_dir, rounds, extra, trace):  # a workload that overruns its share
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(gpu_profile, "bench_command", sleeper)
    started = time.perf_counter()
    rows = gpu_profile.run_all(tmp_path / "out", budget_s=2.0, workloads=["fedyolo", "feddat"], min_s=1.5,
                               bundle_dir=tmp_path / "bundle")
    assert time.perf_counter() - started < 20
    assert rows[0]["workload"] == "fedyolo" and rows[0]["status"].startswith("stopped at its")
    assert rows[1] == {"workload": "feddat", "status": rows[1]["status"], "seconds": 0.0}
    assert rows[1]["status"].startswith("skipped")
    assert sorted(p.name for p in (tmp_path / "bundle").iterdir()) == ["results.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(tmp_path / "bundle" / "results.tar.gz") as archive:
        assert "out/fedyolo/log.txt" in archive.getnames()
    assert "| fedyolo | stopped at its" in (tmp_path / "bundle" / "summary.md").read_text()
    with pytest.raises(ConfigError, match="--workloads = 'fedmosiac' is not known"):
        gpu_profile.run_all(tmp_path, 10.0, ["fedmosiac"])


def test_the_bench_command_asks_for_the_ideal_with_mfu_and_a_profile_at_paper_size(tmp_path):
    command = gpu_profile.bench_command("feddat", tmp_path, 2, ("train.cuda_graphs=true",), trace=False)
    assert command[1:6] == ["-m", "rayfed", "bench", "--workload", "feddat"]
    assert {"--ideal-only", "--no-reference", "--profile"} <= set(command)
    assert command[command.index("--set") + 1:] == ["train.local_epochs=null", "train.local_steps=20",
                                                   "train.cuda_graphs=true"]


def test_profile_is_refused_for_a_generic_workload(capsys):
    from rayfed.cli import main

    assert main(["bench", "--workload", "cpu", "--profile"]) == 2
    assert "--profile profiles a seed method's local update" in capsys.readouterr().err
