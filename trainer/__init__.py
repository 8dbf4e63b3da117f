"""spotune: restart-safe LoRA/QLoRA fine-tuning (CONTRIBUTING.md maps the folders)."""

import logging


class _HubKernelFallback(logging.Filter):
    """On import, bitsandbytes' CPU backend (where the CPU has AVX512-BF16) tries to fetch a 4-bit
    matmul from the Hub's kernels-community and, without the optional `kernels` package, warns,
    then uses its own kernel. Nothing is wrong, so the warning is dropped; its others are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_HubKernelFallback())
