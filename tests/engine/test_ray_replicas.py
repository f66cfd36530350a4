"""``extract --engine ray``'s driver (dflash_prep/engine/ray_replicas.py) against a stand-in for the
part of Ray's API it uses, with a clock: each replica finishes at a set time, with a summary, an
error returned as a value, or a crash that ``ray.get`` raises. The driver must see the first
failure when it happens, whatever the replica's rank, and cancel every replica still running then,
for a replica's error and for a Ray worker's crash alike. The real Ray and vLLM build is
test_extract_nodes.py's Ray test."""

from __future__ import annotations

import pytest

from dflash_prep.engine import ray_replicas
from dflash_prep.engine.extract import ExtractConfig
from dflash_prep.errors import ConfigError, DflashError


class _RayError(Exception):
    pass


class _Exceptions:
    RayError = _RayError

    class RayActorError(_RayError):
        pass

    class WorkerCrashedError(_RayError):
        pass


class _Ref:
    def __init__(self, rank: int):
        self.rank = rank


class FakeRay:
    """``outcomes[i]``: ``(finish time, what ray.get gives)`` of replica i, where what it gives is a
    dict (the replica's return value) or an exception (raised by ``ray.get``). ``ray.wait`` and
    ``ray.get`` move the clock to the time the replica they return finishes; ``cancelled`` lists the
    replicas cancelled while still running."""

    exceptions = _Exceptions

    def __init__(self, outcomes: dict):
        self.outcomes, self.clock, self.cancelled, self.down = outcomes, 0.0, [], False
        self.configs = []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kw) -> None:
        pass

    def shutdown(self) -> None:
        self.down = True

    def cluster_resources(self) -> dict:
        return {"CPU": 8.0}

    def remote(self, **resources):
        fake = self

        class _Task:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, cfg):
                fake.configs.append(cfg)
                return _Ref(cfg.node_rank)

        return _Task

    def _at(self, ref: _Ref) -> float:
        return self.outcomes[ref.rank][0]

    def wait(self, refs, num_returns: int = 1):
        assert num_returns == 1
        first = min(refs, key=self._at)
        self.clock = max(self.clock, self._at(first))
        return [first], [r for r in refs if r is not first]

    def get(self, ref: _Ref):
        self.clock = max(self.clock, self._at(ref))    # blocks until the replica is done
        got = self.outcomes[ref.rank][1]
        if isinstance(got, Exception):
            raise got
        return got

    def cancel(self, ref: _Ref, force: bool = False) -> None:
        if self._at(ref) > self.clock:
            self.cancelled.append(ref.rank)


def _summary(rank: int, *, complete: bool) -> dict:
    return {"summary": {"node_rank": rank, "share": 2, "shards_written": 2, "complete": complete, "out": "o"}}


def _fake(monkeypatch, outcomes: dict) -> FakeRay:
    fake = FakeRay(outcomes)
    monkeypatch.setattr(ray_replicas, "_import_ray", lambda: fake)
    return fake


def _extract(replicas: int) -> dict:
    cfg = ExtractConfig(data="d", target="t", out="o", objective="dflash", python="/engine/python")
    return ray_replicas.extract_on_ray(cfg, replicas=replicas, log=lambda s: None)


def test_the_first_replica_to_fail_is_seen_first_and_the_others_cancelled(monkeypatch):
    fake = _fake(monkeypatch, {0: (5.0, _summary(0, complete=False)), 1: (9.0, _summary(1, complete=False)),
                               2: (1.0, {"error": ConfigError("the engine refused its arguments")})})
    with pytest.raises(ConfigError) as e:
        _extract(3)
    assert str(e.value) == "replica 2 of 3: the engine refused its arguments"
    assert fake.clock == 1.0, f"the failure at t=1 was raised at t={fake.clock}"
    assert sorted(fake.cancelled) == [0, 1] and fake.down


def test_a_crashed_ray_worker_cancels_the_others_and_names_its_replica(monkeypatch):
    crash = _Exceptions.WorkerCrashedError("The worker died unexpectedly while executing this task.\nmore")
    fake = _fake(monkeypatch, {0: (5.0, _summary(0, complete=False)), 1: (2.0, crash),
                               2: (9.0, _summary(2, complete=True))})
    with pytest.raises(DflashError) as e:
        _extract(3)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("replica 1 of 3: its Ray worker died (WorkerCrashedError: The worker "
                                              "died unexpectedly") and "rerun the same command" in msg, msg
    assert fake.clock == 2.0 and sorted(fake.cancelled) == [0, 2] and fake.down
    fake = _fake(monkeypatch, {0: (1.0, _Exceptions.RayActorError("The actor died.")),
                               1: (3.0, _summary(1, complete=True))})
    with pytest.raises(DflashError, match=r"^replica 0 of 2: its Ray worker died \(RayActorError: The actor died\.\)"):
        _extract(2)
    assert fake.cancelled == [1]


def test_replicas_finishing_out_of_order_report_in_rank_order(monkeypatch):
    fake = _fake(monkeypatch, {0: (5.0, _summary(0, complete=False)), 1: (9.0, _summary(1, complete=True)),
                               2: (1.0, _summary(2, complete=False))})
    got = _extract(3)
    assert [c.node_rank for c in fake.configs] == [0, 1, 2] and {c.num_nodes for c in fake.configs} == {3}
    assert got["complete"] and got["node_rank"] == 1 and [r["node_rank"] for r in got["replicas"]] == [0, 1, 2]
    assert fake.cancelled == [] and fake.down
