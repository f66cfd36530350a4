"""What each drafter objective reads of its target (dflash_prep.objectives.target_taps): the trainer's
rules, vLLM's ids, and the states-cache size analyze and pack print."""

from __future__ import annotations

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives.target_taps import (dflash_taps, extract_command, repeated_taps, states_estimate, states_need,
                                                vllm_layer_id)


def test_the_rules_are_the_trainers():
    from dflash_prep.train.objectives.dflash.drafter import build_target_layer_ids

    for L, N in ((36, 5), (80, 5), (94, 5), (28, 1), (4, 2), (28, 3)):
        assert dflash_taps(L, N) == build_target_layer_ids(L, N)
    assert states_need("dflash", 36, draft_layers=5).taps == (1, 9, 17, 25, 33)
    assert states_need("dflash2", 4, draft_layers=2).slots() == (1,)            # [1, 1]: one stored slot
    n = states_need("dflash", 36, draft_layers=1, loss="kl")
    assert (n.taps, n.final, n.num_slots()) == ((18,), True, 2)
    assert states_need("dflash", 36, target_layer_ids=(3, 7)).taps == (3, 7)
    e = states_need("eagle3", 36)
    assert (e.taps, e.final) == ((1, 17, 32), True)
    with pytest.raises(ConfigError, match="three distinct"):
        states_need("eagle3", 4)
    with pytest.raises(ConfigError, match="--draft-layers"):
        states_need("dflash", 36)
    with pytest.raises(ConfigError, match="no target hidden states"):
        states_need("lm", 36)
    assert vllm_layer_id(0) == 1


def test_the_estimate_line():
    line = states_estimate("dflash", 36, 4096, 100_000_000, draft_layers=5)
    assert "5 tap(s) x H=4,096 = 40,960 B/token bf16 x 100,000,000 tokens = 4.1 TB (fp8: 2.0 TB; --loss kl: 4.9 TB bf16)" \
        in line, line
    line = states_estimate("eagle3", 80, 8192, 10**8)
    assert "3 tap(s) + the final state x H=8,192 = 65,536 B/token" in line and "(fp8: 3.3 TB)" in line, line


def test_the_command():
    assert extract_command(data="d", target="t", out="o", objective="dflash", draft_layers=2, loss="kl") == \
        "dflash-prep extract d --target t --objective dflash --draft-layers 2 --loss kl --dtype bf16 --out o"
    assert extract_command(data="d", target="t", out="o", objective="eagle3", target_layer_ids=(1, 2, 3),
                           dtype="fp8") == ("dflash-prep extract d --target t --objective eagle3 --target-layer-ids 1 "
                                            "--target-layer-ids 2 --target-layer-ids 3 --dtype fp8 --out o")


def test_repeated_taps_are_named_with_the_fix():
    assert repeated_taps(dflash_taps(36, 5)) == ""
    taps = dflash_taps(4, 2)  # the public rule on a 4-layer target: both draft layers tap layer 1
    assert taps == [1, 1]
    msg = repeated_taps(taps)
    assert msg.startswith("taps [1, 1] repeat layer(s) [1]: vLLM refuses") and "--target-layer-ids with 2 distinct" in msg
