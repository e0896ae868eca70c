"""The only doors to ledger files: load, save, append, update and merge (``store``), each write
atomic and locked (``atomic``); where dry-run rows come from (``dry_runs``: the shipped file and the
user's cache).

May import: ``ledger.core``.
"""
