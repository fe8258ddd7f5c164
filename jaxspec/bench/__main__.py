"""`python -m jaxspec.bench {decode,spec,heads,replay,gpu,serve,lower,ablate,sps,train,lmeval,adaptive,prefill,shared,trace} ...`: benchmarks that print ratios measured side by side."""

from __future__ import annotations

import importlib
import sys

SUITES = {"decode": "jaxspec.bench.decode", "spec": "jaxspec.bench.spec", "gpu": "jaxspec.bench.gpu",
          "serve": "jaxspec.bench.serve", "replay": "jaxspec.bench.replay",
          "heads": "jaxspec.bench.heads", "lower": "jaxspec.bench.lower",
          "ablate": "jaxspec.bench.ablate", "sps": "jaxspec.bench.sps", "train": "jaxspec.bench.train",
          "lmeval": "jaxspec.bench.lmeval", "adaptive": "jaxspec.bench.adaptive",
          "prefill": "jaxspec.bench.prefill", "shared": "jaxspec.bench.shared_prefix",
          "trace": "jaxspec.bench.trace"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m jaxspec.bench {{{','.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
