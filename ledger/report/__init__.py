"""What the answers are scored against and how they are reported: the outside estimators
(``estimators``), the predictor fitted without one row (``held_out``), the scoreboard
(``scoreboard``), the calibration report (``calibration_report``).

May import: ``ledger.core`` … ``ledger.answer``.
"""
