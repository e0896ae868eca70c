"""Evidence coming in: trainer logs (``logs``), OOM messages (``oom``), the program's older
format (``legacy``) and real runs appended from logs and the callback (``ingest``).

May import: ``ledger.core``, ``ledger.storage``, ``ledger.vocab``. Nothing that answers imports this
package: only the command line and the probe kit do.
"""
