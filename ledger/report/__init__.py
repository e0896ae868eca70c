"""What the answers are scored against and how they are reported: the outside estimators
(``estimators``), the predictor fitted without one row (``held_out``), the scoreboard
(``scoreboard``), the outside estimators against this project's dry runs where no card has
measured (``dry_board``: mixtures of experts), the calibration report (``calibration_report``).

May import: ``ledger.core`` … ``ledger.answer``.
"""
