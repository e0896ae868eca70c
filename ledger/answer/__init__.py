"""The answers: the evidence ladder (``rungs``), its combiner and the verdict (``predictor``), the
ceiling search (``ceilings``), the verdict over an array of ranks for the fit table (``rank_judge``),
the fit table (``fits``) and stored predictions (``predictions``).

May import: ``ledger.core`` … ``ledger.fit``.
"""
