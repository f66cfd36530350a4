"""Registers and spills of the DFlash kernels' sm_90 cubins, compiled ahead of time on a CPU.

    PYTHONPATH=. python -m dflash_prep.bench.dflash_resources                      # the fixed tiles, D 64 and 128
    PYTHONPATH=. python -m dflash_prep.bench.dflash_resources --d 128 fwd:128:64:8:3 dq:64:64:4:2   # candidates
    PYTHONPATH=. python -m dflash_prep.bench.dflash_resources --windowed           # the sliding-window variant

Each kernel is compiled for sm_90 (bf16, B = 16) by the installed Triton, and the bundled
``cuobjdump -res-usage`` reads the cubin's registers and stack bytes (spills live on the
stack). This is how ``kernels/dflash.py``'s ``FIXED_BLOCKS`` were picked without a GPU: a
spilling kernel is slow, a non-spilling one is only a candidate, and GPU timing decides.
About 10 s per kernel on one core. Prints one line per kernel; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

KERNELS = ("fwd", "dq", "dkdv_blk", "dkdv_ctx")
def resources(name: str, head_dim: int, block_m: int, block_n: int, warps: int, stages: int,
              block_size: int = 16, windowed: bool = False) -> dict:
    """Compile kernel ``name`` for sm_90 and return its registers and stack bytes."""
    import triton
    from dflash_prep.kernels.dflash import compile_sm90

    consts = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size, UPCAST=False,
                  PRECISION="tf32", WINDOWED=windowed)
    compiled = compile_sm90(name, consts, warps=warps, stages=stages)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for {name}:\n{usage}")
    return dict(kernel=name, head_dim=head_dim, windowed=windowed, tiles=(block_m, block_n, warps, stages),
                regs=int(found[1]),
                stack=int(found[2]), shared=compiled.metadata.shared, triton=triton.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_prep.bench.dflash_resources", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, action="append", help="head dim (repeatable; default 64 and 128)")
    parser.add_argument("--windowed", action="store_true", help="the sliding-window variant (WINDOWED=True)")
    parser.add_argument("candidates", nargs="*", help="KERNEL:BLOCK_M:BLOCK_N:WARPS:STAGES (default: FIXED_BLOCKS)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter
    from dflash_prep.kernels.dflash import FIXED_BLOCKS

    for d in args.d or (64, 128):
        jobs = [(c.split(":")[0], *map(int, c.split(":")[1:])) for c in args.candidates] or [
            (name, *FIXED_BLOCKS[128 if d > 64 else 64][name]) for name in KERNELS]
        for name, bm, bn, warps, stages in jobs:
            if name not in KERNELS:
                print(f"unknown kernel {name!r}; use one of {', '.join(KERNELS)}", file=sys.stderr)
                return 2
            r = resources(name, d, bm, bn, warps, stages, windowed=args.windowed)
            print(f"{name:9s} D={d:<3d} {'windowed ' if args.windowed else ''}tiles={r['tiles']} regs={r['regs']} stack={r['stack']} B "
                  f"shared={r['shared']} B (triton {r['triton']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
