"""``--init-layers target``: the draft layers start as the target's last layers (train/objectives/dflash/warm_start.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_prep.errors import ConfigError, FormatError

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target
from dflash_prep.tests.train.train_fakes import FakeSource


def _target_tensors(target) -> dict:
    from safetensors.torch import load_file

    return load_file(str(target / "model.safetensors"))


def _objective(tmp_path, **kw):
    from dflash_prep.train.objectives import build_objective

    src = FakeSource(n=48, world_size=1, grad_accum=1, layout="varlen")
    torch.manual_seed(0)
    return build_objective(dflash_cfg(tmp_path, tiny_target(), **kw), src.dataset, torch.device("cpu")), src


def test_the_draft_layers_start_as_the_targets_last_layers(tmp_path):
    obj, _ = _objective(tmp_path, draft_layers=2, init_layers="target")
    t = _target_tensors(tiny_target())
    d = dict(obj.model.named_parameters())
    L = json.loads((tiny_target() / "config.json").read_text())["num_hidden_layers"]   # 4: layers 2, 3 are copied
    for i, src in enumerate((L - 2, L - 1)):
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            assert torch.equal(d[f"layers.{i}.{name}"].detach(), t[f"model.layers.{src}.{name}"].float()), (i, name)
    assert torch.equal(d["norm.weight"].detach(), t["model.norm.weight"].float())
    k, H = obj.model.config.num_taps, obj.model.config.hidden
    assert torch.allclose(d["fc.weight"].detach(), torch.eye(H).repeat(1, k) / k)   # the mean of the k taps
    assert obj.contract()["init_layers"] == "target"
    assert "start as the target's layers [2, 3]" in obj.describe()


def test_a_random_init_is_unchanged_and_its_contract_too(tmp_path):
    """The default draws the same weights as before the option existed, and its contract has no new key
    (a run started before it resumes)."""
    from dflash_prep.train.objectives.dflash.drafter import Drafter

    obj, _ = _objective(tmp_path, draft_layers=2)
    assert "init_layers" not in obj.contract()
    torch.manual_seed(0)
    fresh = Drafter(obj.model.config)
    t = _target_tensors(tiny_target())
    assert not torch.equal(obj.model.layers[1].mlp.up_proj.weight, t["model.layers.3.mlp.up_proj.weight"])
    assert obj.model.fc.weight.shape == fresh.fc.weight.shape


def test_one_training_step_from_the_copy_moves_the_weights(tmp_path):
    from dflash_prep.train.loop import train

    s = train(dflash_cfg(tmp_path, tiny_target(), max_steps=2, init_layers="target"),
              source=FakeSource(n=48, world_size=1, grad_accum=1, layout="varlen"))
    assert s["global_step"] == 2 and math.isfinite(s["loss_last"])


def test_bad_values_and_conflicts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--init-layers must be one of random, target"):
        dflash_cfg(tmp_path, tiny_target(), init_layers="middle")
    with pytest.raises(ConfigError, match="--init-from-drafter and --init-layers target"):
        dflash_cfg(tmp_path, tiny_target(), objective="dflash2", init_layers="target", init_from_drafter=str(tmp_path))


def test_a_target_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
    from dflash_prep.train.objectives.dflash.warm_start import copy_target_layers
    from dflash_prep.formats.target import load_target_config

    hc = load_target_config(tiny_target())
    hc.intermediate_size = 128   # the drafter's MLP, not the target's
    d = Drafter(DrafterConfig.from_target_config(hc, 1, 4, 1))
    with pytest.raises(FormatError, match=r"mlp\.gate_proj\.weight is \(96, 64\), the drafter's .* is \(128, 64\)"):
        copy_target_layers(d, tiny_target())
