"""dflash-prep: offline length-bucketed batching for LLM and drafter training.

Stages (one module each): ``synth`` -> ``tokenize`` -> ``analyze`` -> ``pack`` ->
``manifest`` (the on-disk format and its loader). ``cli`` sits on top and only parses
and delegates. Importing this package imports neither torch nor triton.
"""

__version__ = "0.1.0"
