"""`mlx-spec convert`: a Hugging Face checkpoint or a GGUF file into an MLX directory."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint or a GGUF file into an MLX model directory",
        description="Convert a Hugging Face checkpoint (hub id or local directory) or a GGUF "
        "file (local, or --gguf FILE of a hub repo) into an MLX "
        "directory that mlx_spec.load and mlx_lm.load open. GGUF: Q4_0, Q4_1 and Q8_0 "
        "tensors stay quantized (exactly), other quantized types are dequantized to float16, "
        "--dtype turns every tensor into that float type. MTP layers that mlx-lm drops are "
        "written beside the target as a drafter directory (<mlx-path>/mtp). Output is written "
        "to a temporary directory and renamed only when complete.",
    )
    p.add_argument(
        "--hf-path",
        required=True,
        help="hub id (org/name), local directory, or local .gguf file (llama.cpp's format)",
    )
    p.add_argument(
        "--gguf",
        metavar="FILE",
        help="convert this GGUF file of the hub repo (or local directory) --hf-path",
    )
    p.add_argument("--mlx-path", required=True, help="output directory")
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        help="weight dtype (default: the checkpoint's; GGUF: every tensor, quantized ones "
        "included, dequantized to it)",
    )
    p.add_argument("-q", "--quantize", action="store_true", help="quantize linear weights")
    p.add_argument("--q-bits", type=int, default=4, help="bits per weight (default 4)")
    p.add_argument("--q-group-size", type=int, default=64, help="group size (default 64)")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)


def run(args) -> int:
    from convert import Quantization, convert_checkpoint

    quant = Quantization(args.q_bits, args.q_group_size) if args.quantize else None
    result = convert_checkpoint(
        args.hf_path,
        args.mlx_path,
        dtype=args.dtype,
        quantization=quant,
        force=args.force,
        revision=args.revision,
        gguf_file=args.gguf,
    )
    print(f"wrote {result.path}")
    if result.mtp_path is not None:
        print(f"wrote MTP drafter {result.mtp_path}")
    return 0
