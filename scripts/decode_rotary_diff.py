"""How far decode attention with its rotary in the launch lands from the two launches,
per case of tests/unit/test_turbo_decode_rotary.py (a GPU check: compiled, the two
kernels' float32 arithmetic may contract or sum in another order; that test's bounds
come from this).

    python3 scripts/decode_rotary_diff.py
"""

from __future__ import annotations

import itertools

import torch

from tests.unit.test_turbo_decode_rotary import KINDS, SHAPES, both_ways


def main() -> None:
    for shape, kind, qk_norm, splits in itertools.product(SHAPES, KINDS, (False, True), (1, 2, 4)):
        (out, kv, _), (fused, fused_kv, _) = both_ways(shape, kind, qk_norm, num_splits=splits)
        err = float((fused.float() - out.float()).abs().max() / out.float().abs().max())
        bytes_differ = int((fused_kv.view(torch.uint8) != kv.view(torch.uint8)).sum())
        print(f"{shape.head_dim:>4} {kind:>9} qk_norm={qk_norm!s:5} splits={splits}: "
              f"output max rel diff {err:.2e}, pool bytes that differ {bytes_differ}")  # fmt: skip


if __name__ == "__main__":
    main()
