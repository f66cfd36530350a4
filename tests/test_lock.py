"""The lock (constraints.txt) covers what pyproject asks for, inside pyproject's ranges.

Every venv the Makefile builds installs with ``-c constraints.txt`` (docs/reliability.md#reproducible-installs).
A dependency added to pyproject without ``make lock`` would install unpinned, the newest release of the
day; a range narrowed past the lock would make pip refuse the install. Both are caught here, before a
fresh clone meets them.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
NOT_LOCKED = {"torch"}  # the Makefile's TORCH_SPEC decides torch (a user's CUDA build is kept)


def _lock() -> dict[str, str]:
    pins = {}
    for n, line in enumerate((ROOT / "constraints.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        assert m, f"constraints.txt:{n}: not a `name==version` pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt:{n}: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"^EXTRAS \?= (\S+)$", makefile, re.M).group(1).split(",")
    extras += re.search(r"^LOCK_EXTRAS := \$\(EXTRAS\),(\S+)$", makefile, re.M).group(1).split(",")
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate()]


def test_every_requirement_of_every_installed_extra_is_pinned_inside_its_range():
    pins = _lock()
    assert {"pip", "setuptools"} <= set(pins), "the lock pins the installer and the build backend too"
    missing, outside = [], []
    for req in _requirements():
        name = canonicalize_name(req.name)
        if name in NOT_LOCKED:
            assert name not in pins, f"{name} is TORCH_SPEC's, not the lock's"
            continue
        if name not in pins:
            missing.append(str(req))
        elif not req.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{req} but the lock has {pins[name]}")
    assert not missing, f"not in constraints.txt (run `make lock`, then `make test`): {missing}"
    assert not outside, f"constraints.txt is outside pyproject's range (run `make lock`): {outside}"


def test_the_build_backend_in_the_lock_satisfies_the_build_requirement():
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    pins = _lock()
    for req in map(Requirement, build):
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), (str(req), pins.get(req.name))
