"""Generate a synthetic llama-architecture GGUF model with random F16 weights.

Real small models keep almost every tensor under llama.cpp's 10 MiB RPC hash
threshold, so they cannot exercise the rpc-server weight cache. This model is
shaped like a slice of a 3B model instead: with the defaults (2 layers, hidden
2560, FFN 6912, 20 heads) it is about 321 MB and 99% of its bytes sit in 14
tensors over 10 MiB. llama.cpp loads it like any model and generates (noise).

Everything is a pure function of the arguments: the same seed gives a
byte-identical file.

    python -m llamafleet.bench.synth OUT.gguf [--layers 2] [--hidden 2560] [--ffn 6912] ...

Needs the ``gguf`` and ``numpy`` packages (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from dataclasses import dataclass

# A tensor goes through rpc-server's hash cache when it is larger than RPC_HASH_THRESHOLD (ggml-rpc.cpp).
from llamafleet.core.constants import RPC_HASH_THRESHOLD

_SPACE = "\u2581"  # SentencePiece's word-boundary marker


@dataclass(frozen=True)
class SynthSpec:
    """Shape of the synthetic model."""

    layers: int = 2
    hidden: int = 2560
    ffn: int = 6912
    heads: int = 20
    kv_heads: int = 20
    context: int = 4096
    seed: int = 0
    scale: float = 0.02

    def check(self) -> None:
        """Reject shapes llama.cpp would refuse."""
        if self.layers < 1 or self.hidden < 1 or self.ffn < 1 or self.context < 1:
            raise ValueError("layers, hidden, ffn and context must be positive")
        if self.heads < 1 or self.hidden % self.heads:
            raise ValueError("hidden (%d) must be a multiple of heads (%d)" % (self.hidden, self.heads))
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ValueError("heads (%d) must be a multiple of kv_heads (%d)" % (self.heads, self.kv_heads))
        if (self.hidden // self.heads) % 2:
            raise ValueError("head size hidden/heads must be even for RoPE")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: specials, all 256 byte tokens, then single characters.

    With byte fallback every input text tokenizes, so llama.cpp accepts any prompt.
    Returns (tokens, scores, token types) with types as in gguf.TokenType.
    """
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens = ["<unk>", "<s>", "</s>"]
    types = [unknown, control, control]
    tokens += ["<0x%02X>" % value for value in range(256)]
    types += [byte] * 256
    pieces = [_SPACE] + list(string.ascii_letters + string.digits + string.punctuation)
    pieces += [_SPACE + c for c in string.ascii_letters + string.digits]
    tokens += pieces
    types += [normal] * len(pieces)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def tensor_shapes(spec: SynthSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, dtype) of every tensor, in file order.

    numpy shapes are the reverse of ggml's: token_embd is ggml [hidden, vocab].
    """
    head_dim = spec.hidden // spec.heads
    kv_width = head_dim * spec.kv_heads
    shapes: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, spec.hidden), "f16")]
    for i in range(spec.layers):
        shapes += [
            ("blk.%d.attn_norm.weight" % i, (spec.hidden,), "f32"),
            ("blk.%d.attn_q.weight" % i, (spec.hidden, spec.hidden), "f16"),
            ("blk.%d.attn_k.weight" % i, (kv_width, spec.hidden), "f16"),
            ("blk.%d.attn_v.weight" % i, (kv_width, spec.hidden), "f16"),
            ("blk.%d.attn_output.weight" % i, (spec.hidden, spec.hidden), "f16"),
            ("blk.%d.ffn_norm.weight" % i, (spec.hidden,), "f32"),
            ("blk.%d.ffn_gate.weight" % i, (spec.ffn, spec.hidden), "f16"),
            ("blk.%d.ffn_up.weight" % i, (spec.ffn, spec.hidden), "f16"),
            ("blk.%d.ffn_down.weight" % i, (spec.hidden, spec.ffn), "f16"),
        ]
    shapes += [
        ("output_norm.weight", (spec.hidden,), "f32"),
        ("output.weight", (n_vocab, spec.hidden), "f16"),
    ]
    return shapes


def write_model(path: str | os.PathLike[str], spec: SynthSpec | None = None) -> dict[str, int]:
    """Write the synthetic model to ``path``; returns a size summary.

    Norm weights are ones, every matrix is N(0, scale) in F16 drawn from one
    generator seeded with ``spec.seed``, in file order.
    """
    import gguf  # optional dependency: the bench extra
    import numpy as np

    spec = spec or SynthSpec()
    spec.check()
    tokens, scores, types = vocabulary()
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_name("llamafleet synthetic llama %dL-%d-%d seed %d" % (spec.layers, spec.hidden, spec.ffn, spec.seed))
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.hidden // spec.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    rng = np.random.default_rng(spec.seed)
    summary = {"tensors": 0, "tensor_bytes": 0, "large_tensors": 0, "large_bytes": 0}
    for name, shape, dtype in tensor_shapes(spec, len(tokens)):
        if dtype == "f32":
            data = np.ones(shape, dtype=np.float32)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * spec.scale).astype(np.float16)
        writer.add_tensor(name, data)
        summary["tensors"] += 1
        summary["tensor_bytes"] += data.nbytes
        if data.nbytes > RPC_HASH_THRESHOLD:
            summary["large_tensors"] += 1
            summary["large_bytes"] += data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    summary["file_bytes"] = os.path.getsize(path)
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    defaults = SynthSpec()
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.synth",
                                     description="Write a synthetic llama GGUF with random F16 weights.")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="embedding width")
    parser.add_argument("--ffn", type=int, default=defaults.ffn, help="feed-forward width")
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--context", type=int, default=defaults.context, help="training context length")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = SynthSpec(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                     kv_heads=args.kv_heads, context=args.context, seed=args.seed)
    try:
        summary = write_model(args.out, spec)
    except ValueError as exc:
        parser.error(str(exc))
    share = 100.0 * summary["large_bytes"] / max(1, summary["tensor_bytes"])
    print("%s: %d bytes, %d tensors, %d over 10 MiB holding %.1f%% of the tensor bytes"
          % (args.out, summary["file_bytes"], summary["tensors"], summary["large_tensors"], share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
