"""moefp8.state: a checkpoint of the training state restores in place, also one written before the
dense layers' MLP became `moefp8.mlp.MLP` (its weights were `mlp.w1.weight`, `mlp.w2.weight`)."""

import torch

from moefp8 import checkpoint
from moefp8.config import ModelConfig, OptimConfig
from moefp8.data import Loader, prepare
from moefp8.model import Transformer
from moefp8.optim import AdamW
from moefp8.recipe import Recipe
from moefp8.state import restore, train_state


def setup(tmp_path, seed):
    src = tmp_path / "src"
    if not src.exists():
        src.mkdir()
        (src / "a.txt").write_text("".join(f"line {i}\n" for i in range(300)))
        prepare(str(src), str(tmp_path / "d"), glob="*.txt", shard_tokens=1000)
    model = Transformer(ModelConfig(), Recipe("bf16"), seed=seed)
    opt = AdamW(model.named_parameters(), OptimConfig())
    return model, opt, Loader(str(tmp_path / "d"), 2, 16, seed=0)


def test_restore_reads_the_dense_mlp_of_older_checkpoints(tmp_path):
    model, opt, loader = setup(tmp_path, seed=1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(1e-3)
    loader.next()
    st = train_state(model, opt, loader, torch.device("cpu"), 7)
    dense = ["layers.0.mlp.w1", "layers.0.mlp.w2"]
    for d in (st["model"], st["optim"]["exp_avg"], st["optim"]["exp_avg_sq"]):
        for n in dense:
            d[f"{n}.weight"] = d.pop(n)  # the layout before moefp8.mlp.MLP
    ckpt = checkpoint.save(tmp_path / "run", 7, st)
    fresh, fopt, floader = setup(tmp_path, seed=2)
    assert not torch.equal(fresh.layers[0].mlp.w1, model.layers[0].mlp.w1)
    assert restore(ckpt, fresh, fopt, floader, torch.device("cpu")) == 7
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    for n in dense:
        assert torch.equal(opt.state_dict()["exp_avg"][n], fopt.state_dict()["exp_avg"][n])
    assert torch.equal(loader.next()[0], floader.next()[0])
