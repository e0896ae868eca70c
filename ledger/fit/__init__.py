"""The fitted ledger: measured peaks and the peak model (``peaks``), pure fits over rows
(``calibration``), one ledger's rows as a predictor uses them (``ledger_fit``) and its held-out views
(``held_out_views``), the dry-run table (``dry_table``) and its calibration per card
(``dry_calibration``), card limits (``limits``), the probe-to-real step and the optimizer's state
(``response_span``), and bounds between recipes (``dominance``).

May import: ``ledger.core``, ``ledger.storage``, ``ledger.vocab``.
"""
