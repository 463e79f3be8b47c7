"""Is a restore bit-identical to recompute on this GPU? (run by scripts/gpu_check.sh)

For tiny-gqa in bf16 and fp32 on CUDA: each restore method's logits, step by step, against the
engine recomputing the same prompt, as the largest absolute difference (0.0: bit-identical), and
whether the greedy tokens agree. On the CPU the batch-invariant kernels make every difference 0
(tests/test_exact.py); this prints what the CUDA path gives.

    python scripts/gpu_exactness.py [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "tests")
from test_restore import GREEDY, _engine, _ids, cases, restore_after_saving  # noqa: E402

from kvtier.models.loading import load_model  # noqa: E402

from kvtier_testlib import spy_logits  # noqa: E402


def main() -> None:
    rows = []
    for dtype in ("bf16", "fp32"):
        model = load_model("tiny-gqa", dtype=dtype, device="cuda", tokenizer=False)
        ids = _ids(model)
        plain = _engine(model, None)
        ref = spy_logits(plain)
        ref_tokens = plain.generate([ids], GREEDY)[0].output_ids
        plain.close()
        for name, (method, layout) in cases(model.config.num_layers).items():
            engine = _engine(model, "memory:256MB", method, layout)
            got = spy_logits(engine)
            out = restore_after_saving(engine, ids)
            # The last len(ref) steps are the restored request's (the save's steps come first); each
            # step's last row is the newest token's logits.
            diff = max((a[-1].float() - b[-1].float()).abs().max().item() for a, b in zip(got[-len(ref):], ref))
            rows.append(dict(dtype=dtype, method=name, max_logit_diff=diff, tokens_equal=out.output_ids == ref_tokens))
            print(rows[-1], flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
