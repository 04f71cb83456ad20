"""`rayfed bench` on a CPU-sized workload: it runs end to end and writes what the docs describe."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rayfed.benchmarks import flower_side
from rayfed.benchmarks.method_bench import METHOD_WORKLOADS
from rayfed.benchmarks.overhead import (
    LLM_CPU_WORKLOAD, LLM_WORKLOAD, WORKLOADS, IdealLoop, Workload, median_ratios, round_breakdown, run_bench,
    workload_named,
)
from rayfed.cli import build_parser
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.models import build_backbone, build_client_model
from rayfed.seeding import sample_clients


@pytest.mark.usefixtures("ray_local")
def test_bench_writes_json_and_markdown_with_overhead_ratios(tmp_path):
    workload = Workload(num_clients=4, clients_per_round=2, local_steps=2, samples_per_client=16, rounds=3)
    results = run_bench(workload, (1, 2), tmp_path)

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [run["actors_per_gpu"] for run in saved["runs"]] == [1, 2]
    assert [run["num_actors"] for run in saved["runs"]] == [1, 2]
    for run in results["runs"]:
        assert len(run["round_s"]) == len(run["ideal_round_s"]) == workload.rounds - 1  # the warm-up round is left out
        assert run["overhead_ratio"] == pytest.approx(run["mean_round_s"] / run["mean_ideal_round_s"])
        assert run["peak_host_mib_per_actor"] > 0
        assert [part["round"] for part in run["breakdown"]] == list(range(1, workload.rounds))
        for part, wall in zip(run["breakdown"], run["round_s"]):
            assert 0 < part["update_s"] < wall and part["actor_rest_s"] >= 0 and part["after_actors_s"] > 0
    # every packing trains the same clients with the same seeds
    assert results["runs"][0]["local_metrics"] == results["runs"][1]["local_metrics"]
    [memory] = saved["client_memory"]  # no GPU: host memory only
    assert memory["state_device"] == "cpu" and memory["state_bytes_per_client"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| 0 |") == 2 and "overhead ratio" in table


def test_a_round_splits_into_local_updates_the_rest_on_the_actors_and_the_time_around_them():
    # two actors: one trains 0.5 s of its 0.6 s call from t=10.1, the other 0.7 of 0.8 s from t=10.2
    actor_times = [[{"round": 0, "start": 10.1, "end": 10.7, "update_s": 0.5}],
                   [{"round": 0, "start": 10.2, "end": 11.0, "update_s": 0.7}]]
    [part] = round_breakdown([1.2], [11.1], actor_times)  # the round took 1.2 s and its callback ran at t=11.1
    assert part["update_s"] == 0.7
    assert part["actor_rest_s"] == pytest.approx(0.2)  # first start to last end is 0.9 s
    assert part["after_actors_s"] == pytest.approx(0.1) and part["before_actors_s"] == pytest.approx(0.2)


def test_each_packing_gets_the_median_of_its_ratios_over_the_repeats():
    runs = [{"num_gpus": 1, "actors_per_gpu": per_gpu, "overhead_ratio": ratio}
            for per_gpu, ratio in [(1, 1.3), (2, 0.9), (1, 1.0), (2, 0.8), (1, 1.1)]]
    runs.append({"num_gpus": 2, "actors_per_gpu": 1, "overhead_ratio": None})  # no 1-GPU ideal for 2 GPUs
    assert median_ratios(runs) == {"1x1": 1.1, "1x2": pytest.approx(0.85)}


def test_the_ideal_round_trains_the_round_s_sampled_clients_from_the_same_start(monkeypatch):
    workload = Workload(num_clients=6, clients_per_round=2, local_steps=1, samples_per_client=16)
    ideal = IdealLoop(workload)
    trained = []
    original_train = type(ideal.host._context(0, 0)).train

    def spy(context, params, **kwargs):
        trained.append((context.client_id, context.round, params is ideal.shared))
        return original_train(context, params, **kwargs)

    monkeypatch.setattr(type(ideal.host._context(0, 0)), "train", spy)
    assert ideal.run_round(3) > 0
    expected = sample_clients(ideal.config.seed, 3, workload.num_clients, workload.clients_per_round)
    assert len(expected) == 2
    assert trained == [(cid, 3, True) for cid in expected]


def test_bench_needs_at_least_one_repeat(tmp_path):
    with pytest.raises(ConfigError, match="--repeats 0"):
        run_bench(Workload(), (1,), tmp_path, repeats=0)


@pytest.mark.usefixtures("ray_local")
def test_the_llm_workload_on_a_tiny_llama_reports_tokens_and_tflops_for_rayfed_and_the_ideal(tmp_path):
    workload = LLM_CPU_WORKLOAD
    results = run_bench(workload, (1,), tmp_path)

    work = results["step_work"]
    steps = workload.clients_per_round * workload.local_steps
    assert work["steps_per_round"] == steps
    assert work["tokens"] == workload.batch_size * workload.seq_len  # every synthetic sequence is full
    [run] = results["runs"]
    for prefix, seconds in (("", run["mean_round_s"]), ("ideal_", run["mean_ideal_round_s"])):
        assert run[f"{prefix}tokens_per_s"] == pytest.approx(work["tokens"] * steps / seconds)
        assert run[f"{prefix}tflops_per_s"] == pytest.approx(work["flops"] * steps / seconds / 1e12)
    assert "local_token_f1" in run["local_metrics"] and results["client_memory"] == []
    table = (tmp_path / "bench.md").read_text()
    assert "| tokens/s | ideal tokens/s | TFLOP/s | ideal TFLOP/s | MFU | ideal MFU |" in table
    assert run["mfu"] is run["ideal_mfu"] is None and "MFU is blank: no GPU" in table  # a CPU has no bf16 peak
    assert f"{steps} client steps of" in table and f"on {work['tokens']} tokens each" in table


def _linear_flops(tokens: int, lora_rank: int, linears: list[tuple[int, int]], needs_input_grad: bool) -> int:
    """Forward + backward FLOPs of one block's frozen linear layers with LoRA (2 per multiply-add); the
    gradient of their input is computed only where ``needs_input_grad``."""
    total = 0
    for inputs, outputs in linears:
        forward = 2 * tokens * inputs * outputs + 2 * tokens * lora_rank * (inputs + outputs)
        lora_backward = 2 * tokens * lora_rank * (2 * outputs + inputs)  # dB, d(xA), dA
        input_backward = 2 * tokens * inputs * outputs + 2 * tokens * lora_rank * inputs if needs_input_grad else 0
        total += forward + lora_backward + input_backward
    return total


def test_a_counted_step_has_the_analytic_flops_of_the_tiny_llama_with_lora():
    workload = LLM_CPU_WORKLOAD
    ideal = IdealLoop(workload)
    work = ideal.step_work()
    config = ideal.host.backbone.encoder.config
    d, f, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention, mlp = [(d, q), (d, kv), (d, kv)], [(q, d), (d, f), (d, f), (f, d)]
    tokens, rank = workload.batch_size * workload.seq_len, workload.lora_rank
    # Block 0's q/k/v read the frozen embeddings: no gradient of their input. The LM head: forward and input grad.
    expected = (_linear_flops(tokens, rank, attention, False) + _linear_flops(tokens, rank, mlp, True)
                + (config.num_hidden_layers - 1) * _linear_flops(tokens, rank, attention + mlp, True)
                + 2 * (2 * tokens * d * vocab))
    # torch counts no FLOPs for the CPU's fused attention kernel (on a GPU it counts flash / memory-efficient
    # attention's), so on the CPU the count is the matrix products alone, exactly.
    assert work.flops == expected
    assert work.tokens == tokens


def test_the_llm_workload_builds_llama_3_2_1b_with_bf16_weights_and_fp32_lora_r16_on_every_linear(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the weights' dtype on a GPU host
    config = LLM_WORKLOAD.config(clients_per_actor=20, gpus_per_actor=1)
    [task] = build_federation(config.data, config.seed).tasks
    with torch.device("meta"):
        backbone = build_backbone(config.model, 0)
        base = sum(p.numel() for p in backbone.encoder.parameters())
        model = build_client_model(backbone, config.model, task, seed=0, private_copy=False)
    llama = backbone.encoder.config
    shape = (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
             llama.intermediate_size, llama.vocab_size, llama.tie_word_embeddings)
    assert shape == (2048, 16, 32, 8, 8192, 128256, True)
    # embeddings (tied with the LM head) 128256 x 2048 + 16 blocks of 60,821,504 + the final norm
    assert base == 1_235_814_400
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    # r (in + out) per linear: q 2048+2048, k and v 2048+512, o 2048+2048, gate and up 2048+8192, down 8192+2048
    assert sum(p.numel() for p in trainable.values()) == 16 * 16 * (4096 + 2560 + 2560 + 4096 + 3 * 10240) == 11_272_192
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for name, p in model.named_parameters() if name not in trainable} == {torch.bfloat16}
    assert config.train.batch_size * config.data.max_text_length == 8 * 512


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_bench_workload_trains_whole_batches_of_its_batch_size(name):
    workload = WORKLOADS[name]
    config = workload.config(clients_per_actor=workload.num_clients, gpus_per_actor=0)
    [holding] = build_federation(config.data, config.seed).holdings
    assert min(len(train) for train, _ in holding.splits) >= workload.batch_size


def test_the_bench_workloads_are_the_same_for_the_cli_and_the_flower_side_by_side():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    [workload_option] = [a for a in bench._actions if a.dest == "workload"]
    generic = [name for name in workload_option.choices if name not in METHOD_WORKLOADS]
    assert generic == list(flower_side.WORKLOADS) == list(WORKLOADS)
    assert [name for name in workload_option.choices if name in METHOD_WORKLOADS] == list(METHOD_WORKLOADS)
    with pytest.raises(ConfigError, match=r"--workload = 'llm-gpu' is not known \(did you mean 'llm-cpu'\?\); "
                                          r"allowed: cpu, gpu, llm, llm-cpu\."):
        workload_named("llm-gpu")


def test_the_cli_parser_imports_the_seed_methods_workloads_only_for_bench_workload():
    """rayfed.cli names no paper: the seed methods' workloads come from benchmarks/method_bench.py, looked up when
    --workload is given, so building the parser (every command) imports no benchmark."""
    import subprocess
    import sys

    probe = ("import sys; from rayfed.cli import build_parser; parser = build_parser(); "
             "parser.parse_args(['run', 'x']); "
             "print('rayfed.benchmarks.method_bench' in sys.modules, parser.parse_args(['bench', '--workload', "
             "'fedyolo']).workload, 'rayfed.benchmarks.method_bench' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split() == [
        "False", "fedyolo", "True"]


def test_a_workload_names_its_bad_field_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"Workload.task = 'text' is not known; allowed: image_classification, "
                                          r"text_generation\."):
        Workload(task="text")
    with pytest.raises(ConfigError, match=r"Workload.target_words = 40 is invalid: .* in 1\.\.31 for seq_len = 64\."):
        dataclasses.replace(LLM_CPU_WORKLOAD, target_words=40)


def test_attention_flops_of_grouped_query_attention_count_every_query_head():
    from rayfed.benchmarks.overhead import _sdpa_backward_flops, _sdpa_flops

    batch, query_heads, kv_heads, length, head_dim = 2, 8, 2, 16, 4
    query, grouped = (batch, query_heads, length, head_dim), (batch, kv_heads, length, head_dim)
    # Q K^T and the weights times V: two products of 2 * length * length * head_dim per query head.
    assert _sdpa_flops(query, grouped, grouped) == 2 * 2 * batch * query_heads * length * length * head_dim
    assert _sdpa_backward_flops(query, query, grouped, grouped) == 2.5 * _sdpa_flops(query, grouped, grouped)


def test_many_clients_puts_memory_growth_per_added_client_beside_what_a_client_owns():
    from rayfed.benchmarks.many_clients import HEADER, memory_rows

    def result(clients, pss_mib):
        return {"clients": clients, "median_round_s": 2.0, "pss_bytes": pss_mib * 2**20, "state_bytes": clients * 2**10,
                "data_bytes": clients * 2**10, "dataset_bytes": 0, "total_s": 1.0}

    rows = memory_rows([result(100, 1000), result(1100, 1010)])
    assert len(rows[0]) == len(HEADER)
    assert rows[0][4] == "-"
    assert rows[1][4] == "10.2"  # 10 MiB over 1,000 added clients
    assert rows[1][5] == "2.0"  # 1 KiB of state and 1 KiB of data each
