"""Write ``configs/fedmosaic/*.yaml`` and ``configs/tune/fedmosaic_tau_blocks.yaml``: FedMosaic's offline
benchmark (docs/fedmosaic.md#the-offline-benchmark) and the paper's DRAKE / HFLB settings with real models by name
(docs/fedmosaic.md#the-papers-settings).
Run ``python benchmarks/papers/fedmosaic_configs.py [--repo PATH]`` after changing a setting here (then ``python
benchmarks/papers/offline_twins.py`` for the paper settings' offline twins); tests load every file and regenerate them.

Offline benchmark (DRAKE's shape, reduced): 10 clients, 4 on the small tiny LLaVA (8 layers x 48) and 6 on the
large one (16 x 64), as DRAKE's 4 x 1B + 6 x 3B (Tab. 8); three task groups of 3 / 3 / 4 clients as Tab. 37
(A = {0, 4, 5}, B = {6, 7, 8}, C = {1, 2, 3, 9}; 0-based). Every client holds 4 tasks of its own, arriving one
after another (PFL-Dynamic, 5 rounds each, 20 rounds), all VQA (``task-groups:vqa``) answered with one word through
its group's answer permutation: the groups conflict on every answer, clients of a group share one rule. A
group's images share a render style; a client's tasks ask about colours, shapes and counts of its own subset of
the group's colours and shapes (its position p in the group shifts the subset by 2 of 8), so a group's clients
know overlapping halves of its rule and together all of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml
from repo_argument import configs_of, run_generator

SMALL, LARGE = (0, 1, 2, 3), (4, 5, 6, 7, 8, 9)
GROUPS = {0: (0, 4, 5), 1: (6, 7, 8), 2: (1, 2, 3, 9)}  # Tab. 37: visual relation, reasoning, VQA
GROUP_STYLE = {0: "sketch", 1: "noisy", 2: "textured"}
COLORS = ("red", "green", "blue", "yellow", "purple", "cyan", "orange", "pink")
SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond", "star", "bar")
SAMPLES_PER_TASK = 150  # 120 train / 30 test
TEXT_LENGTH = 26  # 16 image tokens + the question + the answer word and end-of-text
RELEVANCE_MODEL = "tiny-pretrained:llava"  # W_s: the smallest client model

# The offline FedMosaic entry (paper defaults but the tiny-scale learning rates, m and alignment schedule).
MOSAIC = {"name": "fedmosaic", "relevance_model": RELEVANCE_MODEL, "grad_interval": 5, "align_lr": 0.001}


def _cycle(values: tuple[str, ...], start: int, count: int) -> list[str]:
    return [values[(start + i) % len(values)] for i in range(count)]


def client_tasks(client: int) -> list[dict[str, Any]]:
    """Client ``client``'s four tasks, in arrival order."""
    group = next(g for g, members in GROUPS.items() if client in members)
    position = GROUPS[group].index(client)
    rng = np.random.default_rng(100 + group)
    colors = tuple(COLORS[i] for i in rng.permutation(8))
    shapes = tuple(SHAPES[i] for i in rng.permutation(8))
    offset = 2 * position
    own_colors, own_shapes = _cycle(colors, offset, 4), _cycle(shapes, offset, 4)
    shifted_colors = _cycle(colors, offset + 2, 4)
    specs = [
        ("color", [f"{c} {s}" for c in own_colors for s in SHAPES]),
        ("shape", [f"{c} {s}" for c in COLORS for s in own_shapes]),
        ("count", [f"{c} {s}" for c in own_colors for s in own_shapes]),
        ("color", [f"{c} {s}" for c in shifted_colors for s in SHAPES]),
    ]
    return [{
        "name": f"c{client}-t{index}-{question}", "source": "task-groups:vqa", "kind": "text_generation",
        "clients": [client], "partition": {"name": "iid"}, "max_text_length": TEXT_LENGTH, "test_fraction": 0.2,
        "options": {"group": group, "groups": 3, "num_samples": SAMPLES_PER_TASK, "question_types": [question],
                    "styles": [GROUP_STYLE[group]], "classes": classes},
    } for index, (question, classes) in enumerate(specs)]


def offline(name: str, methods: list[Any], stream: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    config = {
        "name": name, "seed": 0,
        "data": {
            "tasks": [task for client in range(10) for task in client_tasks(client)],
            "stream": stream or {"mode": "dynamic", "rounds_per_task": 5},
            # D_p: captions of the backbones' own pretraining distribution (seen classes, pretraining styles).
            "public": {"source": "multimodal:shapes", "kind": "text_generation", "max_text_length": 32,
                       "options": {"num_samples": 2000, "styles": ["plain", "gradient"]}},
        },
        "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 8, "alpha": 16}},
        "architectures": {"small": {"clients": list(SMALL), "backbone": "tiny-pretrained:llava"},
                          "large": {"clients": list(LARGE), "backbone": "tiny-pretrained:llava-large"}},
        "federation": {"rounds": 20, "clients_per_round": 10, "eval_every": 5, "checkpoint_every": 20},
        "train": {"local_steps": 10, "batch_size": 8, "lr": 0.004, "optimizer": "adamw", "eval_batch_size": 256},
        "methods": methods,
        "placement": {"clients_per_actor": 5},  # CPUs per actor: fitted to the cluster
    }
    for path, value in overrides.items():
        node = config
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return config


def mosaic(label: str, **params: Any) -> dict[str, Any]:
    return {**MOSAIC, "label": label, **params}


MAIN = ["local", "fedavg", mosaic("vanilla", pq=False, relevance="equal"), mosaic("pq_lora", relevance="equal"),
        mosaic("fedmosaic")]
BASELINES = ["ditto", "fedsim", "feddpa", "feddat_lora"]
COMPETITORS = ["takfl", "perada", "fedmkt"]  # the distillation baselines of Tab. 2 / 3, on data.public's first 80 rows
RELA_VARIANTS = [mosaic("equal", relevance="equal"), mosaic("training_current", relevance="training_current"),
                 mosaic("frozen_current", relevance="frozen_current"), mosaic("fedmosaic")]
ALIGNMENT = [mosaic("random_basis", align=False), mosaic("fedmosaic")]

HEADER = {
    "offline_dynamic": "PFL-Dynamic offline (docs/fedmosaic.md#the-offline-benchmark): SFT, FedAvg within an "
                       "architecture and Tab. 7's ablation (Vanilla, + PQ-LoRA, FedMosaic)",
    "offline_static": "PFL-Static offline: the same clients with their 4 tasks mixed into one stream from round 0",
    "offline_async": "PFL-Dynamic, asynchronous (Tab. 40): each client's task windows from (5,5,5,5), (3,7,3,7), "
                     "(7,3,7,3)",
    "offline_baselines": "the other baselines of Tab. 2 that need no public-data distillation (Fed-ET: within an "
                         "architecture): Ditto, FedSim, FedDPA, FedDAT-style dual adapters",
    "offline_competitors": "the public-data distillation baselines of Tab. 2 (TAKFL, PerAda, FedMKT) on PFL-Dynamic",
    "offline_competitors_static": "the public-data distillation baselines of Tab. 3 (TAKFL, PerAda, FedMKT) on "
                                  "PFL-Static",
    "offline_rela_variants": "Tab. 30: RELA's weights from equal weights, the trained model's current gradient, the "
                             "frozen W_s's current gradient, the decayed frozen gradient (RELA)",
    "offline_alignment": "Tab. 32: the aligned PQ basis against each architecture's random orthonormal one",
}


def offline_configs() -> dict[str, dict[str, Any]]:
    return {
        "offline_dynamic": offline("fedmosaic-offline-dynamic", MAIN),
        # The static stream at 2 clients per actor (5 actors): a round of these host-bound tiny models spreads over
        # more actors (on one H200 with placement.gpus_per_actor=0.15: 3.8-4.6 s against 5.7-6.3 s with 5); the
        # numbers do not change
        "offline_static": offline("fedmosaic-offline-static", MAIN, {"mode": "static"},
                                  **{"placement.clients_per_actor": 2}),
        "offline_async": offline("fedmosaic-offline-async", MAIN, {"mode": "asynchronous"}),
        "offline_baselines": offline("fedmosaic-offline-baselines", BASELINES),
        "offline_competitors": offline("fedmosaic-offline-competitors", COMPETITORS),
        "offline_competitors_static": offline("fedmosaic-offline-competitors-static", COMPETITORS, {"mode": "static"},
                                              **{"placement.clients_per_actor": 2}),
        "offline_rela_variants": offline("fedmosaic-offline-rela", RELA_VARIANTS),
        "offline_alignment": offline("fedmosaic-offline-alignment", ALIGNMENT),
    }


def tune_config() -> dict[str, Any]:
    """tau (Fig. 17) and N_B (Tab. 29) on the offline PFL-Dynamic setting; one trial per (tau, N_B, seed)."""
    config = offline("fedmosaic-tau-blocks", [mosaic("fedmosaic")])
    config["tune"] = {
        "metric": "fedmosaic/others_token_f1", "mode": "max", "num_samples": 1, "search": "grid", "scheduler": "fifo",
        "max_concurrent_trials": 2,
        "space": {"methods.0.tau": {"grid": [0.02, 0.1, 0.25, 0.5, 1.0, 2.0, 10.0]},
                  "methods.0.blocks": {"grid": [2, 4, 8]}, "seed": {"grid": [0, 1, 2]}},
    }
    return config


# The paper's settings by name (network and GPUs): LLaVA-1.5-style models on Llama-3.2-1B / 3B and Qwen2.5, as the
# authors released them, and DRAKE / HFLB as `rayfed prepare drake` / `hflb` writes them under $DRAKE_ROOT / $HFLB_ROOT
# (methods/fedmosaic/prepare.py): one save_to_disk folder per client's task, columns question, answer, image and
# split, the authors' own train / test files (partition presplit); r = 128, 20 rounds x 100 steps, batch 4, lr 2e-5
# (PQ 5e-5). The clients and which of them run the 1B model are the official scenario files'
# (DRAKE_hetero_llava_llama_1B_3B, HFLB_hetero_llava_llama_1B_3B).
PAPER_MODELS = {
    "llava-llama3.2-1b": "hf:thkim0305/llama3.2_1B_vl", "llava-llama3.2-3b": "hf:thkim0305/llama3.2_3B_vl",
    "llava-llama3.1-8b": "hf:thkim0305/llama3.1_8B_vl", "llava-qwen2.5-0.5b": "hf:thkim0305/qwen2.5_0.5B_vl",
    "llava-qwen2.5-1.5b": "hf:thkim0305/qwen2.5_1.5B_vl", "llava-qwen2.5-3b": "hf:thkim0305/qwen2.5_3B_vl",
}
DRAKE_GROUPS = {"visual_relation": (0, 4, 5), "reasoning": (6, 7, 8), "vqa": (1, 2, 3, 9)}  # Tab. 37, 0-based
DRAKE_SMALL, HFLB_SMALL = (0, 1, 8, 9), (0, 1, 5)  # the scenario files' clients on LLaVA-Llama-3.2-1B (the rest: 3B)
# Tab. 2 / 3's comparison: SFT, FedIT, the other baselines within an architecture, the distillation baselines on
# data.public's first 80 rows (FedMKT's teachers cut to their 128 largest logits, as the original), Tab. 7's ablation.
PAPER_METHODS = ["local", "fedavg", "ditto", "fedsim", "feddpa", "feddat_lora", "takfl", "perada",
                 {"name": "fedmkt", "top_k": 128},
                 {"name": "fedmosaic", "label": "vanilla", "pq": False, "relevance": "equal",
                  "relevance_model": PAPER_MODELS["llava-llama3.2-1b"]},
                 {"name": "fedmosaic", "label": "pq_lora", "relevance": "equal",
                  "relevance_model": PAPER_MODELS["llava-llama3.2-1b"]},
                 {"name": "fedmosaic", "relevance_model": PAPER_MODELS["llava-llama3.2-1b"]}]
# Every method trains the local steps that make its cost SFT's, the server's distillation included (Tab. 15).
PAPER_COMPUTE_MATCH = {"reference": "local"}


def paper(name: str, clients: int, small: tuple[int, ...], folder: str, stream: dict[str, Any]) -> dict[str, Any]:
    large = tuple(c for c in range(clients) if c not in small)
    tasks = [{"name": f"client{c}-task{t}", "source": f"hf:{folder}/client{c}/task{t}", "kind": "text_generation",
              "text_column": "question", "target_column": "answer", "clients": [c], "resize": "backbone",
              "partition": {"name": "presplit", "column": "split"}}
             for c in range(clients) for t in range(4)]
    return {
        "name": name, "seed": 0,
        "data": {"tasks": tasks, "stream": stream,
                 "public": {"source": f"hf:{folder}/public_llava_instruct_5k", "kind": "text_generation",
                            "text_column": "question", "target_column": "answer", "resize": "backbone"}},
        "model": {"backbone": PAPER_MODELS["llava-llama3.2-1b"], "lora": {"rank": 128, "alpha": 256}},
        "architectures": {"llama1b": {"clients": list(small), "backbone": PAPER_MODELS["llava-llama3.2-1b"]},
                          "llama3b": {"clients": list(large), "backbone": PAPER_MODELS["llava-llama3.2-3b"]}},
        "federation": {"rounds": 20, "clients_per_round": clients, "eval_every": 5, "checkpoint_every": 5},
        "train": {"local_steps": 100, "batch_size": 4, "lr": 2e-5, "optimizer": "adamw", "eval_batch_size": 16,
                  "compute_match": PAPER_COMPUTE_MATCH},
        "methods": PAPER_METHODS,
        "placement": {"clients_per_actor": 1, "cpus_per_actor": 4, "gpus_per_actor": 1},
        # A round's payloads and uploads (about 10 GB for the LLaVA mix) cross a local Ray's object store, whose
        # default of 1 GB would spill them to disk (benchmarks/README.md, FedMosaic at paper size).
        "ray": {"object_store_memory": 24 * 10**9},
    }


def paper_configs() -> dict[str, dict[str, Any]]:
    dynamic = {"mode": "dynamic", "rounds_per_task": 5}
    return {
        "paper_drake_dynamic": paper("fedmosaic-drake-dynamic", 10, DRAKE_SMALL, "${DRAKE_ROOT}", dynamic),
        "paper_drake_static": paper("fedmosaic-drake-static", 10, DRAKE_SMALL, "${DRAKE_ROOT}", {"mode": "static"}),
        "paper_hflb_dynamic": paper("fedmosaic-hflb-dynamic", 9, HFLB_SMALL, "${HFLB_ROOT}", dynamic),
    }


def write(repo: Path) -> list[Path]:
    """Write the configs under ``repo``'s ``configs/``; the paths written."""
    configs = configs_of(repo)
    out = configs / "fedmosaic"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    headers = {**HEADER,
               "paper_drake_dynamic": "DRAKE PFL-Dynamic (Tab. 2): 4 x LLaVA-Llama-3.2-1B + 6 x 3B. Data: "
                                      "`rayfed prepare drake --out data/drake` and `export DRAKE_ROOT=data/drake`",
               "paper_drake_static": "DRAKE PFL-Static (Tab. 3). Data: `rayfed prepare drake --out data/drake` and "
                                     "`export DRAKE_ROOT=data/drake`",
               "paper_hflb_dynamic": "HFLB PFL-Dynamic (Tab. 2): 3 x 1B + 6 x 3B. Data: `rayfed prepare hflb --out "
                                     "data/hflb` and `export HFLB_ROOT=data/hflb`"}
    for name, config in {**offline_configs(), **paper_configs()}.items():
        path = out / f"{name}.yaml"
        comment = (f"# {headers[name]}.\n"
                   "# Written by benchmarks/papers/fedmosaic_configs.py; docs/fedmosaic.md has the results.\n")
        comment += f"#   rayfed run configs/fedmosaic/{name}.yaml --seed 0      (then 1, 2)\n"
        path.write_text(comment + yaml.safe_dump(config, sort_keys=False, width=120, default_flow_style=None))
        written.append(path)
    path = configs / "tune" / "fedmosaic_tau_blocks.yaml"
    path.write_text("# FedMosaic's tau (Fig. 17) and N_B (Tab. 29) on the offline PFL-Dynamic benchmark; "
                    "metric: Others.\n"
                    "#   rayfed tune configs/tune/fedmosaic_tau_blocks.yaml [--out DIR]\n"
                    + yaml.safe_dump(tune_config(), sort_keys=False, width=120, default_flow_style=None))
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    run_generator(__doc__.splitlines()[0], write, argv)


if __name__ == "__main__":
    main()
