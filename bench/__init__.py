"""The repository's ``bench/`` folder, the benchmarks: this project's ``dflash_prep.bench``.

Imported under the bare name ``bench`` (the repository root on ``sys.path``), it loads the
package of that name installed elsewhere, or an empty module (nothing of the folder): the name
belongs to other distributions (:mod:`dflash_prep.bare_name`, docs/reliability.md#one-import-name).
"""

if __name__ == "bench":
    from dflash_prep.bare_name import hand_over

    hand_over(__name__, __file__)
