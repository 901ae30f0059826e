"""Generate a synthetic llama-architecture GGUF model with random weights.

Real small models keep almost every tensor under llama.cpp's 10 MiB RPC hash
threshold, so they cannot exercise the rpc-server weight cache. This model is
shaped like a slice of a 3B model instead: with the defaults (2 layers, hidden
2560, FFN 6912, 20 heads, F16) it is about 321 MB and 99% of its bytes sit in 14
tensors over 10 MiB. llama.cpp loads it like any model and generates (noise).

``--preset 7b`` is the llama-2-7B shape (32 layers, hidden 4096, FFN 11008, 32
heads) in Q8_0: 6.41 GiB, more than any lab host may hold. Q8_0 blocks are
written directly (random int8, one small F16 scale), never through a quantizer,
and tensor data is generated and written in chunks: memory stays at a few tens
of MB whatever the model's size. Norm weights are F32, as llama.cpp expects.

Everything is a pure function of the arguments: the same spec and seed give a
byte-identical file, whatever the chunk size.

    python -m llamafleet.bench.synth OUT.gguf [--preset 7b] [--layers 2] [--hidden 2560] [--type q8_0] ...
    python -m llamafleet.bench.synth OUT.gguf --preset 7b --plan   # sizes only, writes nothing

Needs the ``gguf`` and ``numpy`` packages (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import os
import string
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple, TextIO

# A tensor goes through rpc-server's hash cache when it is larger than RPC_HASH_THRESHOLD (ggml-rpc.cpp).
from llamafleet.core.constants import RPC_HASH_THRESHOLD
from llamafleet.core.gguf import GGML_TYPES, tensor_nbytes

_SPACE = "\u2581"  # SentencePiece's word-boundary marker

# weight type name -> (ggml type id, llama_ftype written as general.file_type)
WEIGHT_TYPES: dict[str, tuple[int, int]] = {"f16": (1, 1), "q8_0": (8, 7)}
_F32 = 0
# Q8_0 block (ggml-common.h block_q8_0): a little-endian F16 scale d, then 32 int8 q; weight = d * q
_Q8_BLOCK = 32
# the standard deviation of q uniform over [-128, 127]: d = scale / this gives weights of std ``scale``
_Q8_STD = ((256 ** 2 - 1) / 12.0) ** 0.5
# bytes of tensor data generated and written at a time
CHUNK_BYTES = 16 * 1024 * 1024


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
    wtype: str = "f16"

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
        if self.wtype not in WEIGHT_TYPES:
            raise ValueError("weight type %r is none of %s" % (self.wtype, ", ".join(sorted(WEIGHT_TYPES))))
        block = GGML_TYPES[WEIGHT_TYPES[self.wtype][0]][1]
        if self.hidden % block or self.ffn % block:
            raise ValueError("hidden (%d) and ffn (%d) must be multiples of the %s block size %d"
                             % (self.hidden, self.ffn, self.wtype, block))


# Named shapes. 7b: llama-2-7B (32 layers, 4096, 11008, 32 heads, no GQA, context 4096) in Q8_0.
PRESETS: dict[str, SynthSpec] = {
    "7b": SynthSpec(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, context=4096, wtype="q8_0"),
}


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


class SynthTensor(NamedTuple):
    """One tensor of the synthetic model: numpy shape (ggml's reversed), weight type name, ggml type, bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ggml_type: int
    nbytes: int


def tensor_shapes(spec: SynthSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, dtype) of every tensor, in file order.

    numpy shapes are the reverse of ggml's: token_embd is ggml [hidden, vocab].
    dtype is ``f32`` for the norm weights and ``spec.wtype`` for every matrix,
    the token embedding and the output included (llama.cpp's Q8_0 files do the same).
    """
    head_dim = spec.hidden // spec.heads
    kv_width = head_dim * spec.kv_heads
    matrix = spec.wtype
    shapes: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (n_vocab, spec.hidden), matrix)]
    for i in range(spec.layers):
        shapes += [
            ("blk.%d.attn_norm.weight" % i, (spec.hidden,), "f32"),
            ("blk.%d.attn_q.weight" % i, (spec.hidden, spec.hidden), matrix),
            ("blk.%d.attn_k.weight" % i, (kv_width, spec.hidden), matrix),
            ("blk.%d.attn_v.weight" % i, (kv_width, spec.hidden), matrix),
            ("blk.%d.attn_output.weight" % i, (spec.hidden, spec.hidden), matrix),
            ("blk.%d.ffn_norm.weight" % i, (spec.hidden,), "f32"),
            ("blk.%d.ffn_gate.weight" % i, (spec.ffn, spec.hidden), matrix),
            ("blk.%d.ffn_up.weight" % i, (spec.ffn, spec.hidden), matrix),
            ("blk.%d.ffn_down.weight" % i, (spec.hidden, spec.ffn), matrix),
        ]
    shapes += [
        ("output_norm.weight", (spec.hidden,), "f32"),
        ("output.weight", (n_vocab, spec.hidden), matrix),
    ]
    return shapes


def tensor_table(spec: SynthSpec) -> list[SynthTensor]:
    """Every tensor with its ggml type and size in bytes, in file order; writes nothing."""
    spec.check()
    table = []
    for name, shape, dtype in tensor_shapes(spec, len(vocabulary()[0])):
        ggml_type = _F32 if dtype == "f32" else WEIGHT_TYPES[dtype][0]
        table.append(SynthTensor(name, shape, dtype, ggml_type, tensor_nbytes(shape[::-1], ggml_type)))
    return table


def plan(spec: SynthSpec) -> dict[str, int]:
    """Tensor count and bytes, and how many of them sit in tensors over the RPC hash threshold."""
    sizes = [tensor.nbytes for tensor in tensor_table(spec)]
    large = [size for size in sizes if size > RPC_HASH_THRESHOLD]
    return {"tensors": len(sizes), "tensor_bytes": sum(sizes), "large_tensors": len(large), "large_bytes": sum(large)}


class _Progress:
    """Bytes written and MB/s on a stream, at most once per ``interval`` seconds, and a last line."""

    def __init__(self, stream: TextIO | None, total: int, interval: float = 2.0) -> None:
        self.stream, self.total, self.interval = stream, total, interval
        self.done = 0
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.stream is not None and now - self.last >= self.interval:
            self.last = now
            self._line(now, "")

    def finish(self) -> float:
        """Print the last line; returns the seconds taken."""
        now = time.monotonic()
        if self.stream is not None:
            self._line(now, " done")
        return now - self.start

    def _line(self, now: float, suffix: str) -> None:
        assert self.stream is not None
        rate = self.done / 1e6 / max(now - self.start, 1e-9)
        share = 100.0 * self.done / max(1, self.total)
        self.stream.write("synth: %d / %d MB (%.0f%%), %.0f MB/s%s\n"
                          % (self.done // 10**6, self.total // 10**6, share, rate, suffix))
        self.stream.flush()


def _chunks(tensor: SynthTensor, spec: SynthSpec, rng: Any, chunk_bytes: int) -> Any:
    """Yield the tensor's bytes as numpy arrays of whole rows, about ``chunk_bytes`` each.

    The generator draws values in file order, row after row, so the bytes do not
    depend on the chunk size.
    """
    import numpy as np

    if tensor.dtype == "f32":
        yield np.ones(tensor.shape, dtype=np.float32)
        return
    rows, cols = tensor.shape
    row_bytes = tensor.nbytes // rows
    step = max(1, chunk_bytes // row_bytes)
    if tensor.dtype == "f16":
        for first in range(0, rows, step):
            count = min(step, rows - first)
            yield (rng.standard_normal((count, cols), dtype=np.float32) * spec.scale).astype(np.float16)
        return
    # q8_0: random int8 quants straight from the bit generator (4 uint64 per block), one constant scale
    scale = np.frombuffer(np.array(spec.scale / _Q8_STD, dtype="<f2").tobytes(), dtype=np.uint8)
    for first in range(0, rows, step):
        blocks = min(step, rows - first) * cols // _Q8_BLOCK
        data = np.empty((blocks, 2 + _Q8_BLOCK), dtype=np.uint8)
        data[:, :2] = scale
        quants = rng.bit_generator.random_raw(blocks * _Q8_BLOCK // 8).astype("<u8", copy=False)
        data[:, 2:] = quants.view(np.uint8).reshape(blocks, _Q8_BLOCK)
        yield data


def _writer(path: str, spec: SynthSpec, table: list[SynthTensor]) -> Any:
    """A GGUFWriter for ``path`` holding the model's metadata and tensor table, nothing written yet."""
    import gguf  # optional dependency: the bench extra
    import numpy as np

    tokens, scores, types = vocabulary()
    ggml_type, file_type = WEIGHT_TYPES[spec.wtype]
    suffix = "" if spec.wtype == "f16" else " " + spec.wtype
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("llamafleet synthetic llama %dL-%d-%d%s seed %d"
                    % (spec.layers, spec.hidden, spec.ffn, suffix, spec.seed))
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.hidden // spec.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(file_type)
    if GGML_TYPES[ggml_type][1] > 1:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for tensor in table:
        writer.add_tensor_info(tensor.name, tensor.shape, np.dtype(np.float32), tensor.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType(tensor.ggml_type))
    return writer


def _write_head(writer: Any) -> Any:
    """Write the header, metadata and tensor table, pad to the data alignment; returns the open file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None and len(writer.fout) == 1
    out = writer.fout[0]
    writer.write_padding(out, out.tell())
    return out


def file_bytes(spec: SynthSpec) -> int:
    """The exact size of the file ``write_model`` writes, found by writing only its head (a few kB)."""
    import gguf
    import tempfile

    table = tensor_table(spec)
    with tempfile.TemporaryDirectory(prefix="synth-") as tmp:
        writer = _writer(os.path.join(tmp, "head.gguf"), spec, table)
        head = _write_head(writer).tell()
        writer.close()
    return head + sum(gguf.GGUFWriter.ggml_pad(tensor.nbytes, writer.data_alignment) for tensor in table)


def write_model(path: str | os.PathLike[str], spec: SynthSpec | None = None, *,
                progress: TextIO | None = None, chunk_bytes: int = CHUNK_BYTES) -> dict[str, int]:
    """Write the synthetic model to ``path``; returns a size summary (``plan`` plus file_bytes, ms).

    Norm weights are ones; every matrix is drawn from one generator seeded with
    ``spec.seed``, in file order: N(0, scale) for F16, uniform int8 quants times
    one F16 scale for Q8_0 (weights of standard deviation ``scale``). The header
    and tensor table go first, then the data in chunks of about ``chunk_bytes``,
    so memory does not grow with the model. The file appears at ``path`` only
    when complete (written as ``path.part``, then renamed). ``progress``: a stream
    for bytes written and MB/s, every 2 s.
    """
    import numpy as np

    spec = spec or SynthSpec()
    table = tensor_table(spec)
    final = os.fspath(path)
    partial = final + ".part"
    writer = _writer(partial, spec, table)
    summary = plan(spec)
    meter = _Progress(progress, summary["tensor_bytes"])
    rng = np.random.default_rng(spec.seed)
    try:
        out = _write_head(writer)
        for tensor in table:
            written = 0
            for chunk in _chunks(tensor, spec, rng, chunk_bytes):
                out.write(np.ascontiguousarray(chunk).data)
                written += chunk.nbytes
                meter.add(chunk.nbytes)
            if written != tensor.nbytes:
                raise AssertionError("%s: wrote %d bytes, expected %d" % (tensor.name, written, tensor.nbytes))
            writer.write_padding(out, tensor.nbytes)
        writer.close()
        os.replace(partial, final)
    except BaseException:
        writer.close()
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    summary["ms"] = round(1000 * meter.finish())
    summary["file_bytes"] = os.path.getsize(final)
    return summary


_SHAPE_OPTIONS = ("layers", "hidden", "ffn", "heads", "kv_heads", "context", "seed", "wtype")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(prog="python -m llamafleet.bench.synth",
                                     description="Write a synthetic llama GGUF with random F16 or Q8_0 weights.")
    parser.add_argument("out", help="output .gguf path")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named shape (7b: llama-2-7B in Q8_0, 6.41 GiB); the options below override it")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int, help="embedding width")
    parser.add_argument("--ffn", type=int, help="feed-forward width")
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--context", type=int, help="training context length")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--type", dest="wtype", choices=sorted(WEIGHT_TYPES), help="matrix weight type")
    parser.add_argument("--plan", action="store_true", help="print the sizes only; write nothing")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    base = PRESETS[args.preset] if args.preset else SynthSpec()
    given = {name: getattr(args, name) for name in _SHAPE_OPTIONS if getattr(args, name) is not None}
    spec = replace(base, **given)
    try:
        if args.plan:
            summary = {**plan(spec), "file_bytes": file_bytes(spec)}
        else:
            summary = write_model(args.out, spec, progress=None if args.quiet else sys.stderr)
    except ValueError as exc:
        parser.error(str(exc))
    share = 100.0 * summary["large_bytes"] / max(1, summary["tensor_bytes"])
    shape = ", ".join("%s=%s" % (field.name, getattr(spec, field.name)) for field in fields(spec))
    if args.plan:
        print("%s would be %d bytes (%.2f GiB; %s): %d tensor bytes, %d tensors, %d over 10 MiB holding %d bytes,"
              " %.2f%% of the tensor bytes" % (args.out, summary["file_bytes"], summary["file_bytes"] / 2**30, shape,
                                               summary["tensor_bytes"], summary["tensors"], summary["large_tensors"],
                                               summary["large_bytes"], share))
        return 0
    print("%s: %d bytes, %d tensors, %d over 10 MiB holding %.1f%% of the tensor bytes, written at %.0f MB/s"
          % (args.out, summary["file_bytes"], summary["tensors"], summary["large_tensors"], share,
             summary["file_bytes"] / 1000.0 / max(1, summary["ms"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
