"""The Triton kernels of ``triton_kernels`` (imported on their first use: importing triton
takes a second, and it reads ``TRITON_INTERPRET`` as it defines its own functions)."""

import triton
import triton.language as tl


@triton.jit
def _stages(x, SIZE: tl.constexpr, LOG: tl.constexpr):
    """Every butterfly stage of an FWHT of ``SIZE`` values along the last axis of a
    [ROWS, SIZE] tile, smallest stride first: (a, b) -> (a + b, a - b)."""
    rows: tl.constexpr = x.shape[0]
    # A constexpr is bound once: the unrolled loop writes the stride out, not a name for it.
    for s in tl.static_range(LOG):
        pairs = tl.reshape(x, (rows * SIZE // (2 << s), 2, 1 << s))
        a, b = tl.split(tl.permute(pairs, (0, 2, 1)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (rows, SIZE))
    return x


@triton.jit
def _packed_lanes(packed, offsets, nbytes, WIDTH: tl.constexpr):
    """Lanes ``offsets`` of ``WIDTH``-bit integers packed as ``bits.pack_bits`` packs them (lane
    j at bits [j*W, (j+1)*W) of a little-endian bit stream), as int32. A lane spans at most four
    bytes for W <= 25, and after the shift its W bits sit below the sign bit."""
    bit = offsets.to(tl.int64) * WIDTH
    byte = bit >> 3
    word = tl.zeros(offsets.shape, dtype=tl.int32)
    for k in tl.static_range(4):
        value = tl.load(packed + byte + k, mask=byte + k < nbytes, other=0)
        word = word | (value.to(tl.int32) << (8 * k))
    return (word >> (bit & 7).to(tl.int32)) & ((1 << WIDTH) - 1)


@triton.jit
def _tile_kernel(src, dst, signs, sums, length, scale, a, c,
                 T: tl.constexpr, LOG_T: tl.constexpr, LOAD: tl.constexpr,
                 LAST: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """In-tile stages of one tile. LOAD 0: x as it is; 1: x * signs, zero past ``length``
    (the encode's rotation input); 2: float(sums) * a + c (the decode's dequantization), the
    sums one int32 per lane (WIDTH 0) or WIDTH-bit lanes packed in ``length`` bytes.
    LAST: the transform ends here (block == T): scale, and the decode's signs."""
    offsets = tl.program_id(0) * T + tl.arange(0, T)
    if LOAD == 2:
        if WIDTH == 0:
            lanes = tl.load(sums + offsets)
        else:
            lanes = _packed_lanes(sums, offsets, length, WIDTH)
        x = lanes.to(tl.float32) * tl.load(a) + tl.load(c)
    else:
        x = tl.load(src + offsets, mask=offsets < length, other=0.0)
        if LOAD == 1:
            x = x * tl.load(signs + offsets, mask=offsets < length, other=0.0)
    x = tl.reshape(_stages(tl.reshape(x, (1, T)), T, LOG_T), (T,))
    if LAST:
        x = x * scale
        if LOAD == 2:
            x = x * tl.load(signs + offsets)
    tl.store(dst + offsets, x)


@triton.jit
def _cross_kernel(buf, signs, scale, R: tl.constexpr, LOG_R: tl.constexpr,
                  T: tl.constexpr, C: tl.constexpr, SIGNS: tl.constexpr):  # fmt: skip
    """Cross-tile stages of one block (strides T .. B/2) for C positions of its tiles,
    then the scale (and the decode's signs), in place."""
    block = tl.program_id(0)
    first = tl.program_id(1) * C
    rows = tl.arange(0, R)[:, None]
    offsets = block * R * T + rows * T + first + tl.arange(0, C)[None, :]
    x = tl.trans(tl.load(buf + offsets))  # [C, R]: each position's column on the last axis
    x = tl.trans(_stages(x, R, LOG_R)) * scale
    if SIGNS:
        x = x * tl.load(signs + offsets)
    tl.store(buf + offsets, x)


@triton.jit
def _quantize_kernel(y, draws, low_of_cell, inverse_width, interval, packed, a, c,
                     g: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr):  # fmt: skip
    """u = clamp(y * a + c, 0, g) rounded stochastically to table indices, packed
    little-endian ``8 // BITS`` to a byte: ``GridCodec._round_to_table`` and ``pack_bits``
    in one pass over N coordinates per program."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.program_id(0) * (N // PER) + tl.arange(0, N // PER)
    a, c = tl.load(a), tl.load(c)
    packed_byte = tl.zeros((N // PER,), dtype=tl.int32)
    for j in tl.static_range(PER):  # lane j of every byte: bits [j * BITS, (j + 1) * BITS)
        offsets = byte * PER + j
        u = tl.load(y + offsets) * a + c
        u = tl.minimum(tl.maximum(u, 0.0), g)
        cell = tl.minimum(tl.maximum(u.to(tl.int32), 0), g - 1)
        low = tl.load(low_of_cell + cell)
        up = tl.load(inverse_width + cell) * (u - low)
        rounds_up = (tl.load(draws + offsets) < up).to(tl.int32)
        index = tl.load(interval + cell).to(tl.int32) + rounds_up
        packed_byte = packed_byte | (index << (j * BITS))
    tl.store(packed + byte, packed_byte.to(tl.uint8))
