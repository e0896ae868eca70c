"""The ledger's foundations: the format (``models``, generated into the JSON Schema), what it must
also be (``checks``), reading JSON strictly (``strict_json``), located errors (``errors``), where the
bundled files are (``paths``), units, the typed results and answers every layer returns.

May import: nothing of the project's (the standard library, pydantic, jsonschema).
"""
