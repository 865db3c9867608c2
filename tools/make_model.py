"""Write an HF-format checkpoint directory from a preset.

    python tools/make_model.py --preset tiny-moe --out DIR [--layers N] [--seed S]
        [--dtype D] [--shard-size-mb M] [--config-only] [--mtp N] [--quant fp8]

--quant fp8 (or an -fp8 preset) writes HF's fp8 layout: e4m3 weights with fp32
*.weight_scale_inv per 128 x 128 block (the random weights block-quantized),
quantization_config listing lm_head and the routers as not converted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ftserve.models.checkpoint import QUANTS, write_checkpoint
from ftserve.models.presets import PRESETS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None, help="cut the depth to N layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                    help="stored weight dtype (default: the preset's)")
    ap.add_argument("--shard-size-mb", type=float, default=1024.0)
    ap.add_argument("--config-only", action="store_true",
                    help="config + tokenizer files only, for --load-format dummy at real shapes")
    ap.add_argument("--mtp", type=int, default=None, metavar="N",
                    help="ship N multi-token-prediction layers (mtp.*, for --speculative mtp); "
                         "0 drops a preset's")
    ap.add_argument("--quant", choices=QUANTS, default=None,
                    help="store the weights quantized (fp8: HF's block-scaled e4m3 layout)")
    args = ap.parse_args(argv)
    overrides = None if args.mtp is None else {"num_nextn_predict_layers": args.mtp}
    out = write_checkpoint(
        args.preset, args.out, layers=args.layers, seed=args.seed, dtype=args.dtype,
        shard_size_mb=args.shard_size_mb, config_only=args.config_only, overrides=overrides,
        quant=args.quant,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
