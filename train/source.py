"""Where the trainer's data comes from: the tokenized dataset, the plan and the manifests.

:class:`FileSource` opens the outputs of ``tokenize``, ``analyze`` and ``pack`` through
their public loaders (``dflash_prep.formats.dataset.open_dataset``, ``dflash_prep.formats.plan.load``,
``dflash_prep.formats.manifest.open``). Shards stay memory-mapped; each rank reads only the
samples of its own micro-batches. A missing epoch manifest is packed on the fly by rank 0
with ``dflash_prep.pack.pack.pack_epochs`` (the code behind ``dflash-prep pack``), under the
``PackConfig`` the root's ``pack_config.json`` declares (defaults for this world size when
there is none), while the other ranks wait, or, with ``pack_missing=False``, is an error
that names the command.

The trainer talks to any object with the same four members (``dataset``,
``plan_fingerprint``, ``run_identity``, ``manifest(epoch)``), which is how tests feed it
small in-memory data.
"""

from __future__ import annotations

from pathlib import Path

from dflash_prep.errors import ConfigError, FingerprintMismatch
from dflash_prep.formats import manifest as man
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.pack import config as pack_config
from dflash_prep.pack.pack import pack_epochs

from dflash_prep.train import distributed


def tokenizer_field(ds, name: str, default=None):
    """``ds.tokenizer_info[name]`` whether tokenizer_info is a dict or an object."""
    info = getattr(ds, "tokenizer_info", None)
    if isinstance(info, dict):
        val = info.get(name, default)
    else:
        val = getattr(info, name, default)
    return default if val is None else val


class FileSource:
    """The real pipeline outputs on disk."""

    def __init__(self, data: str | Path, plan: str | Path, manifests: str | Path, *,
                 pack_missing: bool = True, dist: distributed.Dist | None = None):
        self.root = Path(manifests)
        self.plan_path = Path(plan)
        self.data_path = Path(data)
        self.pack_missing = pack_missing
        self.dist = dist
        self.dataset = open_dataset(self.data_path)
        self.plan = plan_mod.load(self.plan_path)
        if str(self.plan.data["fingerprint"]) != str(self.dataset.fingerprint):
            raise FingerprintMismatch(
                f"{self.plan_path} was made for data {self.plan.data['fingerprint']} but {self.data_path} has "
                f"fingerprint {self.dataset.fingerprint}; run `dflash-prep analyze {self.data_path}` to re-plan")

    @property
    def plan_fingerprint(self) -> str:
        return str(self.plan.fingerprint)

    def run_identity(self) -> dict:
        """The plan fields that fix the batches (the trainer adds the manifest's shape and options)."""
        return {"plan": self.plan.identity(), "plan_fingerprint": self.plan_fingerprint,
                "data_fingerprint": str(self.dataset.fingerprint)}

    def manifest(self, epoch: int):
        folder = man.epoch_dir(self.root, epoch)
        missing = not Path(folder).exists()
        if self.dist is not None:   # one decision for every rank: rank 0 may write it before another looks
            missing = distributed.any_rank(missing, self.dist)
        if missing:
            cfg = self._pack_config()
            cmd = (f"dflash-prep pack {self.data_path} --plan {self.plan_path} --out {self.root} --epoch {epoch}"
                   f"{cfg.cli_flags()}")
            if not self.pack_missing:
                raise ConfigError(f"{folder}: no manifest for epoch {epoch}. Pack it first:\n  {cmd}\n"
                                  "(or drop --no-pack-missing to pack it on the fly)")
            self._pack(epoch)
        m = man.open(folder)
        if str(m.plan_fingerprint) != self.plan_fingerprint:
            raise FingerprintMismatch(
                f"{folder}: manifest was packed under plan {m.plan_fingerprint}, but --plan {self.plan_path} is "
                f"{self.plan_fingerprint}; re-pack with `dflash-prep pack ... --epoch {epoch} --overwrite` or point "
                "--plan at the plan the manifests came from")
        if str(m.data_fingerprint) != str(self.dataset.fingerprint):
            raise FingerprintMismatch(f"{folder}: manifest belongs to data {m.data_fingerprint}, not "
                                      f"{self.data_path} ({self.dataset.fingerprint}); re-run `dflash-prep pack`")
        return m

    def _pack_config(self):
        """The PackConfig the epochs under this root were packed with (``pack_config.json``), else
        the defaults for this world size."""
        return pack_config.load(self.root) or pack_config.PackConfig(world_size=self.dist.world_size if self.dist else 1)

    def _pack(self, epoch: int) -> None:
        """Rank 0 packs the epoch with ``pack_epochs`` (as ``dflash-prep pack``); the others wait."""
        d = self.dist
        if d is None or d.is_main:
            cfg = self._pack_config()
            print(f"packing missing epoch {epoch} into {self.root} ({cfg})", flush=True)
            pack_epochs(plan=self.plan, epochs=[epoch], out=self.root, data=self.data_path, config=cfg)
        if d is not None:
            distributed.barrier(d)
