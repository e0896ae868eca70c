"""The probe kit: everything that touches torch.

Known noise is silenced here, each by its exact message, so real warnings still show:
bitsandbytes logs, on importing its CPU backend on a machine without the optional ``kernels``
package, that a faster CPU 4-bit kernel could not be fetched; the probe step does not use it.
"""

import logging


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropMessage("Failed to load CPU gemm_4bit_forward"))
