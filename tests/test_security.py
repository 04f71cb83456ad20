"""Secure defaults: the local Ray that rayfed starts is private (loopback only, no dashboard,
token authentication left on), and no input file - config, override or checkpoint - can make
rayfed run code."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rayfed.results.checkpoint import load_checkpoint, save_checkpoint
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.simulation import Simulation

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
DASHBOARD_PORT = 8265

# Runs a tiny Simulation with no Ray address and, after round 1, records what that Ray instance
# exposes. Its own process: no other Ray instance or test setting leaks in.
LOCAL_RAY_PROBE = textwrap.dedent("""
    import json, sys
    import psutil, ray
    from rayfed.simulation import Simulation

    config, out_dir, facts_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]


    class Seen(Exception):
        pass


    def inspect(sim, label, rounds_done):
        procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
        listening = []
        for proc in procs:
            try:
                listening += [[proc.name(), c.laddr.ip, c.laddr.port]
                              for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:  # a worker that exited meanwhile
                pass
        facts = {
            "node_ips": [node["NodeManagerAddress"] for node in ray.nodes()],
            "listening": listening,
            "webui_url": ray._private.worker._global_node.webui_url,
            "token_auth": ray._raylet.get_authentication_mode() == ray._raylet.AuthenticationMode.TOKEN,
        }
        with open(facts_path, "w") as handle:
            json.dump(facts, handle)
        raise Seen  # the rest of the run shows nothing new


    try:  # without the model check in this process, which starts no Ray and imports the model libraries (~12 s)
        Simulation(config, out_dir=out_dir, callbacks=[inspect], progress=False, check_model=False).run()
    except Seen:
        pass
""")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory) -> dict:
    """What a rayfed run without ``ray.address`` exposes, seen from inside the run."""
    from conftest import TINY_RUN

    config = {**TINY_RUN, "placement": {**TINY_RUN["placement"], "clients_per_actor": 4}, "ray": {"num_cpus": 1}}
    root = tmp_path_factory.mktemp("local_ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    # Ray 2.60 turns token auth on for new local clusters and writes ~/.ray/auth_token: keep that
    # token away from the user's home.
    env["HOME"] = str(root / "home")
    facts_path = root / "facts.json"
    done = subprocess.run(
        [sys.executable, "-c", LOCAL_RAY_PROBE, json.dumps(config), str(root / "run"), str(facts_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(facts_path.read_text()), "root": root}


def test_local_ray_listens_on_loopback_only(local_ray):
    assert local_ray["node_ips"] == ["127.0.0.1"]
    exposed = sorted({(name, ip, port) for name, ip, port in local_ray["listening"] if ip not in LOOPBACK})
    assert not exposed, f"local Ray listens beyond loopback: {exposed}"


def test_local_ray_serves_no_dashboard(local_ray):
    # Ray still runs its API-server process without a dashboard, but serves no web UI from it:
    # nothing on 8265 or the 50 ports Ray would retry after it.
    assert not local_ray["webui_url"]
    dashboard_ports = set(range(DASHBOARD_PORT, DASHBOARD_PORT + 51))
    assert not dashboard_ports & {port for _, _, port in local_ray["listening"]}


def test_local_ray_keeps_token_authentication_on(local_ray):
    assert local_ray["token_auth"] is True
    assert (local_ray["root"] / "home" / ".ray" / "auth_token").is_file()


# Configs ----------------------------------------------------------------------------------
CODE_TAGS = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:os.system ['touch {marker}']",
    "!!python/object/apply:builtins.open ['{marker}', 'w']",
    "!!python/name:os.system",
]


@pytest.mark.parametrize("tag", CODE_TAGS)
def test_config_file_with_a_python_tag_is_refused_not_run(tag, tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "evil.yaml"
    path.write_text(f"name: {tag.format(marker=marker)}\nseed: 1\n")
    with pytest.raises(ConfigError, match="evil.yaml"):
        load_config(path)
    assert not marker.exists()


def test_override_with_a_python_tag_is_refused_not_run(tiny_run, tmp_path):
    marker = tmp_path / "executed"
    with pytest.raises(ConfigError, match="name"):
        load_config(tiny_run, overrides=[f"name={CODE_TAGS[0].format(marker=marker)}"])
    assert not marker.exists()


def test_resuming_a_run_with_a_poisoned_config_is_refused_not_run(tmp_path):
    marker = tmp_path / "executed"
    (tmp_path / "config.yaml").write_text(f"name: {CODE_TAGS[0].format(marker=marker)}\n")
    with pytest.raises(ConfigError, match="config.yaml"):
        Simulation.resume(tmp_path, progress=False)
    assert not marker.exists()


# Checkpoints ------------------------------------------------------------------------------
class _CreatesFileWhenUnpickled:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def _pickle_bytes(marker: Path) -> bytes:
    return pickle.dumps({"personal/weight": _CreatesFileWhenUnpickled(marker)})


def _torch_save_bytes(marker: Path) -> bytes:
    path = marker.with_name("torch_save.pt")
    torch.save({"personal/weight": torch.zeros(2), "hook": _CreatesFileWhenUnpickled(marker)}, path)
    return path.read_bytes()


def test_the_pickled_payloads_would_run_code_if_unpickled(tmp_path):
    pickle.loads(_pickle_bytes(tmp_path / "by_pickle"))
    assert (tmp_path / "by_pickle").exists()
    torch_file = tmp_path / "payload.pt"
    torch_file.write_bytes(_torch_save_bytes(tmp_path / "by_torch"))
    torch.load(torch_file, weights_only=False)
    assert (tmp_path / "by_torch").exists()


@pytest.fixture
def checkpoint_dir(tmp_path) -> Path:
    server = {"global": {"head.weight": torch.arange(6.0).reshape(2, 3)}}
    clients = {cid: {"personal": {"head.bias": torch.full((3,), float(cid))}} for cid in range(3)}
    save_checkpoint(tmp_path / "checkpoints", "fedavg", 2, server, clients, {"counters": {}})
    return tmp_path / "checkpoints"


def test_a_genuine_checkpoint_loads(checkpoint_dir):
    checkpoint = load_checkpoint(checkpoint_dir, "fedavg")
    assert checkpoint.round == 2
    assert torch.equal(checkpoint.clients[1]["personal"]["head.bias"], torch.ones(3))


@pytest.mark.parametrize("make_payload", [_pickle_bytes, _torch_save_bytes], ids=["pickle", "torch.save"])
@pytest.mark.parametrize("file_name", ["clients.safetensors", "server.safetensors"])
def test_a_pickled_checkpoint_file_is_refused_not_unpickled(make_payload, file_name, checkpoint_dir, tmp_path):
    marker = tmp_path / "unpickled"
    target = checkpoint_dir / "fedavg" / "round_2" / file_name
    target.write_bytes(make_payload(marker))

    with pytest.raises(ConfigError) as raised:
        load_checkpoint(checkpoint_dir, "fedavg")
    assert str(target) in str(raised.value)
    assert "safetensors" in str(raised.value)
    assert not marker.exists()
