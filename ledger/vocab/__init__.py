"""The recipe vocabulary every answer shares: the typed ``Recipe`` (``recipe``), cards and their
names (``cards``), model configs and what is read off them (``model_configs``), the adapter's
tensors exactly from a config (``adapter``), and each optimizer's state (``optimizers``).

May import: ``ledger.core``, ``ledger.storage``.
"""
