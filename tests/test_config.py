"""Bad input is one line naming the problem, never a stack trace: config values and overrides
(`load_config`, in process), what the machine lacks (`check_launch`), data shards, and the same
through the real command line (a few representative cases: each costs a process start)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moefp8.hydra_config as hydra_config
from moefp8.hydra_config import ConfigError, compose_config, load_config
from moefp8.data import DataError, prepare
from moefp8.launch import check_gpus, check_launch
from moefp8.train import train

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("overrides, error", [
    # unknown or mistyped overrides (Hydra / OmegaConf)
    (["train.foo=1"], "train.foo=1: Key 'foo' not in 'TrainConfig'"),
    (["+train.foo=1"], "train.foo: no such key in the config schema"),
    (["train.steps=abc"], "train.steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    (["train.steps=[1"], "train.steps=[1: cannot parse the override"),
    (["model=huge"], "model=huge: no such option in configs/model/; one of: dsv3_layer, moe3b, small, tiny, v2_lite"),
    (["~train.steps"], "~train.steps: TrainConfig (DictConfig) does not support deletion"),
    (["train.out_dir=${nope}"], "train.out_dir=${nope}: Interpolation key 'nope' not found"),
    (["optim.lr=nan"], "optim.lr=nan: must be finite"),
    # impossible shapes
    (["model.hidden=100"], "model.hidden=100: not a multiple of 128, which recipe=fp8 needs"),
    (["model.moe_inter=200"], "model.moe_inter=200: not a multiple of 128"),
    (["dispatch=all_to_all", "dispatch.ep_size=3"], "dispatch.ep_size=3: does not divide model.n_experts=8"),
    (["model.topk=9"], "model.topk=9: more than model.n_experts=8"),
    (["model.n_groups=3"], "model.n_groups=3: must divide model.n_experts=8"),
    (["model.n_groups=4", "model.topk_groups=5"], "model.topk_groups=5: must be between 1 and model.n_groups=4"),
    (["model.n_groups=4", "model.topk_groups=1", "model.topk=3"],
     "model.topk=3: cannot pick that many experts from model.topk_groups=1 groups of 2"),
    # the dispatch backend
    (["dispatch=nccl"], "dispatch=nccl: no such option in configs/dispatch/; one of: all_to_all, deepep, local"),
    (["dispatch.backend=nccl"], "dispatch.backend='nccl': expected one of 'local', 'all_to_all', 'deepep'"),
    (["dispatch.ep_size=2"], "dispatch.ep_size=2: dispatch=local is EP=1"),
    (["dispatch=all_to_all", "dispatch.transport=nvlink"],
     "dispatch.transport='nvlink': expected one of 'collective', 'copy_engine'"),
    (["dispatch=all_to_all", "dispatch.mode=exact", "dispatch.transport=copy_engine"],
     "dispatch.transport=copy_engine moves the all_to_all backend's capacity-mode blocks only"),
    (["dispatch=all_to_all", "dispatch.slots=1"], "dispatch.slots=1: must be >= 2"),
    (["dispatch=all_to_all", "dispatch.nccl_ctas=65"], "dispatch.nccl_ctas=65: expected 0 (NCCL's choice) to 64"),
    (["train.grad_reduce_ctas=-1"], "train.grad_reduce_ctas=-1: expected 0 (NCCL's choice) to 64 CTAs"),
    (["dispatch=deepep", "dispatch.nccl_ctas=8"], "dispatch.nccl_ctas=8: caps the all_to_all backend's NCCL"),
    (["dispatch=all_to_all", "dispatch.overlap=true", "dispatch.gemm_sm_reserve=-1"],
     "dispatch.gemm_sm_reserve=-1: expected an integer >= 0"),
    (["dispatch=all_to_all", "dispatch.gemm_sm_reserve=8"],
     "dispatch.gemm_sm_reserve=8: SMs left free while an overlapped layer runs; set dispatch.overlap=true or auto"),
    (["train.cuda_graphs_mlp=true"], "train.cuda_graphs_mlp=true: captures the blocks' MLPs beside their attention; "
                                     "set train.cuda_graphs=true too"),
    (["dispatch.rows_factor=0.5"], "dispatch.rows_factor=0.5: below 1 every step would overflow and run twice; use >= 1"),
    (["dispatch.send_factor=0.5", "dispatch.rows_factor=1.25"],
     "dispatch.send_factor=0.5: expected 0 (off) or a factor >= 1 of a rank's average tokens per destination"),
    (["dispatch.send_factor=1.2"], "dispatch.send_factor=1.2: its overflows are caught and run again as "
                                   "dispatch.rows_factor's; set dispatch.rows_factor too"),
    (["dispatch.rows_factor=-1"], "dispatch.rows_factor=-1.0: expected 0 (off) or a factor > 0 of the balanced load"),
    (["dispatch.shared_overlap=true"], "dispatch.shared_overlap=true: the shared experts hide the all_to_all capacity "
                                       "mode's exchanges under EP; got dispatch=local, dispatch.ep_size=1"),
    (["dispatch=all_to_all", "dispatch.mode=exact", "dispatch.shared_overlap=true"],
     "dispatch.shared_overlap=true: the shared experts hide the all_to_all capacity mode's exchanges under EP; got "
     "dispatch=all_to_all, dispatch.ep_size=2, dispatch.mode=exact"),
    # data that is not there and cannot be prepared
    (["data.path=/nonexistent/d", "data.prepare_from="], "data.path='/nonexistent/d': no index.json there and "
                                                         "data.prepare_from is empty"),
    # a mistyped path to prepared data: not made and filled from the preset's source without being asked
    (["data.path=/nonexistent/d"], "data.path='/nonexistent/d' does not exist, and data.prepare_from='stdlib' is the "
                                   "data preset's, not given: correct the path to your prepared data, or add "
                                   "data.prepare_from=stdlib to prepare /nonexistent/d from it"),
    (["data.path=/nonexistent/d", "data.prepare_from='stdlib,/nonexistent/src'"],
     "data.prepare_from='stdlib,/nonexistent/src': '/nonexistent/src' is not a directory (nor 'stdlib' or "
     "'site-packages')"),
])
def test_config_errors_are_one_line(overrides, error):
    with pytest.raises(ConfigError) as e:
        load_config(overrides)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(error), msg


def test_a_new_data_path_is_prepared_when_asked(tmp_path):
    """data.prepare_from given (here the preset's own value), or data.path left at its preset's: the
    config passes, and the run will prepare the folder; an existing folder needs no prepare_from."""
    new = tmp_path / "new"
    assert load_config([f"data.path={new}", "data.prepare_from=stdlib"]).data.path == str(new)
    assert load_config(["data=stdlib"]).data.prepare_from == "stdlib"
    (tmp_path / "made").mkdir()
    assert load_config([f"data.path={tmp_path / 'made'}"]).data.path == str(tmp_path / "made")


def test_malformed_yaml_names_file_and_line(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg_dir)
    (cfg_dir / "experiment" / "broken.yaml").write_text("# @package _global_\ntrain:\n  steps: [1, 2\n")
    monkeypatch.setattr(hydra_config, "CONFIG_DIR", str(cfg_dir))
    with pytest.raises(ConfigError, match=rf"^{cfg_dir / 'experiment' / 'broken.yaml'}:4:1: malformed YAML: "
                                          r"expected ',' or '\]'"):
        load_config(["experiment=broken"])


def test_no_gpu_or_too_few_gpus(monkeypatch):
    cfg = compose_config(["train.device=cuda"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^train.device='cuda': no CUDA device is available"):
            check_launch(cfg, {})
    # torchrun asked for 4 processes per node where 2 GPUs are visible: refused before any CUDA call
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "RANK": "0"}
    with pytest.raises(ValueError, match=r"^train.device=cuda: 4 processes on this node but only 2 GPU\(s\) "
                                         r"visible .*torchrun --nproc_per_node 2\)$"):
        check_launch(cfg, env)
    check_gpus(torch.device("cuda"), 1, 2, 2)  # 2 on 2: fine
    with pytest.raises(ValueError, match="3 processes on this node but only 2"):
        check_gpus(torch.device("cuda"), 2, 2, 1)  # a launcher that sets LOCAL_RANK only


def test_deepep_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` fails even where it is installed
    with pytest.raises(ValueError, match=r"^dispatch=deepep: `import deep_ep` failed .*DeepEP is not on PyPI: build "
                                         r"it by hand from https://github.com/deepseek-ai/DeepEP"):
        check_launch(compose_config(["dispatch=deepep", "train.device=cpu"]), {"WORLD_SIZE": "2"})


def test_deepep_across_nodes_is_refused_naming_all_to_all(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # refused before the import is tried
    cfg = compose_config(["dispatch=deepep", "dispatch.ep_size=4", "train.device=cpu"])
    for env in ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}):
        with pytest.raises(ValueError, match=r"^dispatch=deepep with dispatch.ep_size=4: the EP groups span nodes "
                                             r"\(\d ranks per node\), .* use dispatch=all_to_all for expert parallelism "
                                             r"across nodes"):
            check_launch(cfg, env)
    with pytest.raises(ValueError, match="import deep_ep"):  # one node of 4: past this check
        check_launch(cfg, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})


def test_hierarchical_dispatch_needs_nodes_and_the_exact_all_to_all():
    with pytest.raises(ValueError, match=r"^dispatch.hierarchical=true: a mode of the all_to_all backend's exact "
                                         r"exchange .* dispatch.overlap=True"):
        compose_config(["dispatch=all_to_all", "dispatch.ep_size=4", "dispatch.hierarchical=true", "dispatch.overlap=true"])
    cfg = compose_config(["dispatch=all_to_all", "dispatch.ep_size=4", "dispatch.hierarchical=true", "train.device=cpu"])
    with pytest.raises(ValueError, match=r"^dispatch.hierarchical=true: the EP group of dispatch.ep_size=4 ranks must "
                                         r"span several whole nodes of 4 ranks"):
        check_launch(cfg, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    check_launch(cfg, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})  # 2 nodes of 2: fine


def test_empty_data_path():
    with pytest.raises(ValueError, match=r"^data.path='': the prepared data needs a folder"):
        compose_config(["data.path="])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data") / "d"
    prepare("stdlib", str(d), max_bytes=200_000, shard_tokens=50_000)
    return d


@pytest.mark.parametrize("fault, error", [
    ("missing", r"data: shard .*shard_00001.bin listed in .*index.json is missing"),
    ("empty", r"data: shard .*shard_00001.bin is empty"),
    ("truncated", r"data: shard .*shard_00001.bin has 99990 bytes, index.json says 50000 tokens .*truncated"),
])
def test_bad_data_shards(data_dir, tmp_path, fault, error):
    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    shard = d / "shard_00001.bin"
    if fault == "missing":
        shard.unlink()
    elif fault == "empty":
        shard.write_bytes(b"")
    elif fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
    cfg = compose_config(["train.micro_batch=2", "train.seq_len=32", "logger.mode=disabled", f"data.path={d}",
                          f"train.out_dir={tmp_path / 'run'}", "data.prepare_from=''"])
    with pytest.raises(DataError, match=error):
        train(cfg)


def cli(args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moefp8.train", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_command_line_errors_are_one_line(data_dir, tmp_path):
    """Through `python -m moefp8.train`: stderr is the one line, the exit status non-zero."""
    cfg_dir = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg_dir)
    (cfg_dir / "model" / "broken.yaml").write_text("hidden: 128\n  n_layers: 3\n")
    d = tmp_path / "data"
    shutil.copytree(data_dir, d)
    (d / "shard_00000.bin").write_bytes((d / "shard_00000.bin").read_bytes()[:-2])
    common = ["logger.mode=disabled", f"train.out_dir={tmp_path / 'run'}"]
    cases = [
        (["train.stpes=10"], None, "config error: train.stpes=10: Key 'stpes' not in 'TrainConfig'"),
        (["model=broken"], {"MOEFP8_CONFIG_DIR": str(cfg_dir)},
         f"config error: {cfg_dir / 'model' / 'broken.yaml'}:2:11: malformed YAML: mapping values are not allowed"),
        ([f"data.path={d}", "data.max_bytes=200000", "train.micro_batch=2", "train.seq_len=32"], None,
         f"error: data: shard {d / 'shard_00000.bin'} has 99998 bytes"),
    ]
    if importlib.util.find_spec("deep_ep") is None:
        cases.append((["dispatch=deepep"], None, "config error: dispatch=deepep: `import deep_ep` failed"))
    if not torch.cuda.is_available():
        cases.append((["train.device=cuda"], None, "config error: train.device='cuda': no CUDA device is available"))
    procs = [cli([*args, *common], env) for args, env, _ in cases]  # at once: each is mostly imports
    for (args, _, error), p in zip(cases, procs):
        _, err = p.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith(error), (args, err[-2000:])


def test_gpu_machine_defaults_to_the_small_gpu_experiment(monkeypatch):
    """train.device=auto on a GPU machine: the small model with its tuned settings, unless the
    command line names a model or an experiment (or another device)."""
    import torch

    from moefp8.hydra_config import _auto_model_overrides, compose_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ovs = _auto_model_overrides(["train.steps=500"], "auto")
    assert ovs == ["train.steps=500", "experiment=small_gpu"]
    cfg = compose_config(ovs)
    assert (cfg.model.name, cfg.optim.lr, cfg.train.steps) == ("small", 3e-4, 500)
    for keep in (["model=tiny"], ["experiment=tiny_bf16"]):
        assert _auto_model_overrides(keep, "auto") == keep
    assert _auto_model_overrides([], "cpu") == []
