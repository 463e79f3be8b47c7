"""A returning context's context read in place (the pool slots past it zeroed, `ModelRunner.clearable`)
against copied into a padded buffer every layer (the code before), paired per context in one process,
beside HF's floor on the same weights (the harness: scripts/paired_ab.py).

    cd scripts && python context_in_place_ab.py [--history 4096] [--dtype fp32] [--contexts 10] [--json out.json]
"""

from __future__ import annotations

import contextlib
from unittest import mock

import paired_ab  # scripts/ is on the path of a script run from it

from kvtier.engine.runner.model_runner import ModelRunner


def main() -> None:
    args = paired_ab.arguments(__doc__.split("\n\n")[0])
    copied = lambda: mock.patch.object(ModelRunner, "_tail", lambda self, it, ctx: None)  # noqa: E731
    paired_ab.run({"in place": contextlib.nullcontext, "copied": copied}, args)


if __name__ == "__main__":
    main()
