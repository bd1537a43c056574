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
def _lowbias32(x):
    """One round of ``base._lowbias32`` on uint32 (products wrap as the torch path masks)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _hashed_uniform(lo, hi, offsets):
    """``base.hashed_uniform``'s draws at ``offsets`` for the seed of 32-bit halves lo, hi."""
    x = _lowbias32(offsets.to(tl.uint32) ^ lo.to(tl.uint32))
    x = _lowbias32(x ^ hi.to(tl.uint32))
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _round_lane(u, draw, low_of_cell, inverse_width, interval, g: tl.constexpr):
    """The table index of grid position u (``GridCodec._round_to_table``), with threshold
    ``draw``."""
    u = tl.minimum(tl.maximum(u, 0.0), g)
    cell = tl.minimum(tl.maximum(u.to(tl.int32), 0), g - 1)
    low = tl.load(low_of_cell + cell)
    up = tl.load(inverse_width + cell) * (u - low)
    return tl.load(interval + cell).to(tl.int32) + (draw < up).to(tl.int32)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])  # a seed's value compiles nothing new
def _quantize_kernel(y, draws, low_of_cell, inverse_width, interval, packed, a, c, seed_lo,
                     seed_hi, g: tl.constexpr, BITS: tl.constexpr, N: tl.constexpr,
                     HASHED: tl.constexpr):  # fmt: skip
    """u = clamp(y * a + c, 0, g) rounded stochastically to table indices, packed
    little-endian ``8 // BITS`` to a byte: ``GridCodec._round_to_table`` and ``pack_bits``
    in one pass over N coordinates per program. HASHED: the thresholds are
    ``base.hashed_uniform``'s of the seed (seed_lo, seed_hi), computed here; else ``draws``."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.program_id(0) * (N // PER) + tl.arange(0, N // PER)
    a, c = tl.load(a), tl.load(c)
    packed_byte = tl.zeros((N // PER,), dtype=tl.int32)
    for j in tl.static_range(PER):  # lane j of every byte: bits [j * BITS, (j + 1) * BITS)
        offsets = byte * PER + j
        if HASHED:  # noqa: SIM108 (a constexpr branch: one of them is compiled)
            draw = _hashed_uniform(seed_lo, seed_hi, offsets)
        else:
            draw = tl.load(draws + offsets)
        index = _round_lane(tl.load(y + offsets) * a + c, draw, low_of_cell, inverse_width,
                            interval, g)  # fmt: skip
        packed_byte = packed_byte | (index << (j * BITS))
    tl.store(packed + byte, packed_byte.to(tl.uint8))


# -- a step's rows (``thc.step``): every partition of every gradient of a step, one launch ------
# Row r of a step lies at r * N of its [P, N] buffers; ``meta`` (int64, K columns per row) says
# where its input starts in the step's flat source (SRC), its length (LEN), its rotation's padded
# length (PAD) and block (LOG, log2), where its signs start (SIGNS), where its average goes in
# the step's flat output (OUT), the domain of its error feedback memory (KIND: 1 rotated, added
# after the transform; 2 the gradient's, added before) and where its sums start (SUMS, bytes).
SRC, LEN, PAD, LOG, SIGNS, OUT, KIND, SUMS = (tl.constexpr(i) for i in range(8))
# tensor scales (``_rows_tensor_scales_kernel``): the row's first piece, its number of pieces
# (0: one scale) and where its one scale's norm lies among the plain rows' summaries
PIECE0, NPIECES, SUMMARY = (tl.constexpr(i) for i in range(8, 11))


@triton.jit
def _stages_upto(x, SIZE: tl.constexpr, LOG: tl.constexpr, active):
    """``_stages``, of which only the first ``active`` (a row's own block) act: stage s pairs
    values within aligned groups of 2 << s, so a row of a smaller block transforms each of its
    blocks, and what lies past its padded length stays among itself."""
    rows: tl.constexpr = x.shape[0]
    for s in tl.static_range(LOG):
        pairs = tl.reshape(x, (rows * SIZE // (2 << s), 2, 1 << s))
        a, b = tl.split(tl.permute(pairs, (0, 2, 1)))
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (rows, SIZE))
        x = tl.where(active > s, y, x)
    return x


@triton.jit
def _bound_factor(norms, r, P, bound, BOUND: tl.constexpr):
    """``ErrorFeedback._bounded``'s factor of row r's memory, from the norms of the rows'
    inputs (norms[r]) and memories (norms[P + r])."""
    if BOUND:
        limit = tl.load(norms + r) * bound
        norm = tl.load(norms + P + r)
        return tl.where(norm > limit, tl.math.div_rn(limit, tl.maximum(norm, 1e-30)), 1.0)
    else:
        return 1.0


@triton.jit
def _rows_rotate_kernel(src, memory, norms, xp, dst, signs, meta, scales, bound, divisors,
                        lengths, P, N, K: tl.constexpr, T: tl.constexpr, LOG_T: tl.constexpr,
                        XP: tl.constexpr, MEMORY: tl.constexpr, BOUND: tl.constexpr,
                        PIECES: tl.constexpr, SELECT: tl.constexpr):  # fmt: skip
    """Tile ``program_id(1)`` of row ``program_id(0)``: the encode's rotation input (the
    row's coordinates, with its bounded gradient-domain memory added, times its signs, zero
    past its length) through the in-tile stages; where the row's block fits in a tile, the
    scale and its bounded rotated memory added too. XP: every row stores its x (+ e where its
    memory is the gradient's, KIND 2) into ``xp`` (at SRC, as the source lies), which the
    summaries and residuals read. PIECES: x + e divided by its tensor's scale (``divisors``,
    one per piece, ``_piece_of``). SELECT: which rows are rotated (``_selected``)."""
    r = tl.program_id(0).to(tl.int64)  # r * N past 2**31 in a large step
    j = tl.program_id(1) * T + tl.arange(0, T)
    row = meta + r * K
    length, padded, log_block = tl.load(row + LEN), tl.load(row + PAD), tl.load(row + LOG)
    inside = j < length
    start = tl.load(row + SRC)
    x = tl.load(src + start + j, mask=inside, other=0.0)
    f = _bound_factor(norms, r, P, bound, BOUND)
    kind = tl.load(row + KIND)
    before = j < tl.where(kind == 2, length, 0)  # (a scalar condition is a row's bound)
    if MEMORY:
        e = tl.load(memory + r * N + j, mask=before, other=0.0)
        x = tl.where(before, x + e * f, x)
    if XP:
        tl.store(xp + start + j, x, mask=inside)
    if PIECES:
        x = tl.math.div_rn(x, tl.load(divisors + _piece_of(j, row, lengths)))
    x = x * tl.load(signs + tl.load(row + SIGNS) + j, mask=inside, other=0.0)
    x = tl.reshape(_stages_upto(tl.reshape(x, (1, T)), T, LOG_T, log_block), (T,))
    last = log_block <= LOG_T
    y = x * tl.load(scales + r)
    if MEMORY:
        after = j < tl.where((kind == 1) & last, padded, 0)
        y = tl.where(after, y + tl.load(memory + r * N + j, mask=after, other=0.0) * f, y)
    tl.store(dst + r * N + j, tl.where(last, y, x),
             mask=j < tl.where(_selected(kind, SELECT), padded, 0))  # fmt: skip


@triton.jit
def _piece_of(j, row, lengths):
    """The piece (of the step's, PIECE0 on) that a row's coordinates j lie in: its tensors'
    pieces end where their ``lengths`` add up to; a row of one scale has one."""
    first = tl.load(row + PIECE0)
    piece = tl.zeros(j.shape, dtype=tl.int64) + first
    end = tl.zeros(j.shape, dtype=tl.int64)
    for k in range(tl.load(row + NPIECES) - 1):
        end = end + tl.load(lengths + first + k)
        piece = piece + (j >= end).to(piece.dtype)
    return piece


@triton.jit
def _selected(kind, SELECT: tl.constexpr):
    """Whether a row of this KIND is rotated by a launch of SELECT 0 (all rows), 1 (those of
    rotated memory: before the MAX round, which their norms take part in) or 2 (the others:
    after it, divided by their tensors' scales)."""
    if SELECT == 0:
        return kind >= 0
    elif SELECT == 1:
        return kind == 1
    else:
        return kind != 1


@triton.jit
def _rows_dequantize_kernel(sums, dst, step, offset, values, signs, meta, scales, xp, out,
                            factors, lengths, contributors, N, K: tl.constexpr, T: tl.constexpr,
                            LOG_T: tl.constexpr, WIDTH: tl.constexpr, LOOKUP: tl.constexpr,
                            RESIDUAL: tl.constexpr, PIECES: tl.constexpr):  # fmt: skip
    """Tile ``program_id(1)`` of row ``program_id(0)`` of the decode: its sums (WIDTH-bit
    lanes packed from byte SUMS; LOOKUP: table indices packed at r * N * WIDTH / 8, read as
    their table values, a payload's own sum) times step / contributors plus the row's offset,
    through the in-tile stages; where the row's block fits in a tile, finished
    (``_finish_decode``)."""
    r = tl.program_id(0).to(tl.int64)  # r * N past 2**31 in a large step
    j = tl.program_id(1) * T + tl.arange(0, T)
    row = meta + r * K
    padded, log_block = tl.load(row + PAD), tl.load(row + LOG)
    nbytes = (padded * WIDTH + 7) // 8
    if LOOKUP:  # noqa: SIM108 (a constexpr branch)
        base = r * (N * WIDTH // 8)
    else:
        base = tl.load(row + SUMS)
    lanes = _packed_lanes(sums + base, j, nbytes, WIDTH)
    if LOOKUP:
        lanes = tl.load(values + lanes, mask=j < padded, other=0)
    a = (tl.load(step + r) / contributors).to(tl.float32)
    x = lanes.to(tl.float32) * a + tl.load(offset + r)
    x = tl.reshape(_stages_upto(tl.reshape(x, (1, T)), T, LOG_T, log_block), (T,))
    last = log_block <= LOG_T
    _finish_decode(x * tl.load(scales + r), j, r, row, signs, xp, out, factors, lengths, N,
                   j < tl.where(last, padded, 0), RESIDUAL, PIECES)  # fmt: skip
    tl.store(dst + r * N + j, x, mask=j < tl.where(last, 0, padded))


@triton.jit
def _finish_decode(y, j, r, row, signs, xp, out, factors, lengths, N, valid,
                   RESIDUAL: tl.constexpr, PIECES: tl.constexpr):  # fmt: skip
    """A decoded row's coordinates j (valid ones), transformed and scaled: times its signs
    (PIECES: and its tensors' scales, ``factors`` per piece), the first LEN of them stored at OUT
    of the step's output, or (RESIDUAL) subtracted from x + e (``xp`` at SRC), its memory's
    new value, stored at r * N of ``out``."""
    length = tl.load(row + LEN)
    if RESIDUAL:  # the rows of rotated memory have theirs from the quantization
        length = tl.where(tl.load(row + KIND) == 2, length, 0)
    valid = valid & (j < length)
    y = y * tl.load(signs + tl.load(row + SIGNS) + j, mask=valid, other=0.0)
    start = tl.load(row + SRC)
    if PIECES:
        y = y * tl.load(factors + _piece_of(j, row, lengths))
    if RESIDUAL:
        tl.store(out + r * N + j, tl.load(xp + start + j, mask=valid, other=0.0) - y, mask=valid)
    else:
        tl.store(out + tl.load(row + OUT) + j, y, mask=valid)


@triton.jit
def _rows_cross_kernel(buf, memory, norms, signs, meta, scales, xp, out, bound, factors,
                       lengths, P, N,
                       K: tl.constexpr, RM: tl.constexpr, LOG_RM: tl.constexpr,
                       T: tl.constexpr, LOG_T: tl.constexpr, C: tl.constexpr,
                       DECODE: tl.constexpr, MEMORY: tl.constexpr, BOUND: tl.constexpr,
                       RESIDUAL: tl.constexpr, PIECES: tl.constexpr,
                       SELECT: tl.constexpr):  # fmt: skip
    """Cross-tile stages (strides T .. block / 2) of row ``program_id(0)`` for C positions of
    its tiles, where its block spans tiles, then its scale and the encode's rotated memory
    (into ``buf``) or the decode's finish (``_finish_decode``)."""
    r = tl.program_id(0).to(tl.int64)  # r * N past 2**31 in a large step
    row = meta + r * K
    padded, log_block = tl.load(row + PAD), tl.load(row + LOG)
    offsets = tl.arange(0, RM)[:, None] * T + tl.program_id(1) * C + tl.arange(0, C)[None, :]
    spans = (log_block > LOG_T) & _selected(tl.load(row + KIND), SELECT)  # blocks across tiles
    valid = offsets < tl.where(spans, padded, 0)
    x = tl.trans(tl.load(buf + r * N + offsets, mask=valid, other=0.0))
    x = tl.trans(_stages_upto(x, RM, LOG_RM, log_block - LOG_T)) * tl.load(scales + r)
    if DECODE:
        _finish_decode(x, offsets, r, row, signs, xp, out, factors, lengths, N, valid, RESIDUAL,
                       PIECES)  # fmt: skip
    else:
        if MEMORY:
            after = offsets < tl.where((tl.load(row + KIND) == 1) & spans, padded, 0)
            f = _bound_factor(norms, r, P, bound, BOUND)
            x = tl.where(after, x + tl.load(memory + r * N + offsets, mask=after, other=0.0) * f,
                         x)  # fmt: skip
        tl.store(buf + r * N + offsets, x, mask=valid)


@triton.jit
def _rows_quantize_kernel(y, seeds, low_of_cell, inverse_width, interval, packed, a, c, meta,
                          values, step, offset, error, N, K: tl.constexpr, g: tl.constexpr,
                          BITS: tl.constexpr, NT: tl.constexpr,
                          ERROR: tl.constexpr):  # fmt: skip
    """``_quantize_kernel`` over NT coordinates of row ``program_id(0)``, with the row's grid
    scale a and seed; ERROR: the rows of rotated memory (KIND 1) also store y minus what
    their indices decode to alone, T[index] * step + offset (``encode_transformed``)."""
    PER: tl.constexpr = 8 // BITS
    r = tl.program_id(0).to(tl.int64)  # r * N past 2**31 in a large step
    row = meta + r * K
    byte = tl.program_id(1) * (NT // PER) + tl.arange(0, NT // PER)
    padded = tl.load(row + PAD)
    valid = byte * PER < padded
    seed = tl.load(seeds + r)
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    a = tl.load(a + r)
    if ERROR:
        own = byte * PER < tl.where(tl.load(row + KIND) == 1, padded, 0)
        step, offset = tl.load(step + r), tl.load(offset + r)
    packed_byte = tl.zeros((NT // PER,), dtype=tl.int32)
    for j in tl.static_range(PER):
        offsets = byte * PER + j
        w = tl.load(y + r * N + offsets, mask=valid, other=0.0)
        index = _round_lane(w * a + c, _hashed_uniform(lo, hi, offsets), low_of_cell,
                            inverse_width, interval, g)  # fmt: skip
        packed_byte = packed_byte | (index << (j * BITS))
        if ERROR:
            value = tl.load(values + index, mask=own, other=0).to(tl.float32)
            tl.store(error + r * N + offsets, w - (value * step + offset), mask=own)
    tl.store(packed + r * (N // PER) + byte, packed_byte.to(tl.uint8), mask=valid)


@triton.jit
def _rows_scalars_kernel(shared, sqrt_padded, constants, a, step, step32, offset, own_offset,
                         ok, prior, P, BLOCK: tl.constexpr, PRIOR: tl.constexpr):  # fmt: skip
    """Every row's grid scalars from its MAX round's norm m, in float64 as
    ``thc.codec._RoundScalars`` computes them: a = where(m > 0, sqrt(padded) / m, 0) * g /
    (2 t); step = (2 t / g) * m / sqrt(padded); offset = -step * g / 2; own_offset = -step *
    g / 2 as error feedback's own decode rounds it (``constants``: g, 2 t, 2 t / g, g / 2);
    ``ok``: m is finite and >= 0 (PRIOR: and ``prior``, the tensor scales' check, holds)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = r < P
    m = tl.load(shared + r, mask=inside, other=0.0).to(tl.float64)
    root = tl.load(sqrt_padded + r, mask=inside, other=1.0)
    g, twice_clamp = tl.load(constants), tl.load(constants + 1)
    per_step, half_g = tl.load(constants + 2), tl.load(constants + 3)
    scale = tl.where(m > 0, root / tl.where(m > 0, m, 1.0), 0.0)  # the same where m > 0
    s = (per_step * m) / root
    tl.store(a + r, ((scale * g) / twice_clamp).to(tl.float32), mask=inside)
    tl.store(step + r, s, mask=inside)
    tl.store(step32 + r, s.to(tl.float32), mask=inside)
    tl.store(offset + r, (((-s) * g) / 2.0).to(tl.float32), mask=inside)
    tl.store(own_offset + r, ((-s) * half_g).to(tl.float32), mask=inside)
    valid = (m - m == 0) & (m >= 0)
    if PRIOR:
        valid = valid & (tl.load(prior + r, mask=inside, other=1) != 0)
    tl.store(ok + r, valid.to(tl.int8), mask=inside)


@triton.jit
def _rows_tensor_scales_kernel(shared, meta, sqrt_lengths, largest, factors, divisors, ok,
                               plain, pieces, W, K: tl.constexpr,
                               WB: tl.constexpr):  # fmt: skip
    """Row ``program_id(0)``'s tensor scales (``THC._tensor_scales``) from the MAX round's
    result ``shared``: the ``plain`` rows' norms (one scale), then a (W x ``pieces``) matrix
    of every worker's piece norms. A row of NPIECES > 0 pieces, from column PIECE0: each
    piece's RMS (the largest norm over the workers over the square root of its length,
    ``sqrt_lengths``), its decode factor (float32) and encode divisor (1 where the RMS is 0),
    and the largest over the workers of the norm of the row divided piece by piece, summed
    piece after piece; a row of one scale: its own norm (SUMMARY: its place among the plain
    rows), factor and divisor 1. ``largest`` float64; ``ok``: the norms are finite and >= 0."""
    r = tl.program_id(0).to(tl.int64)  # r * N past 2**31 in a large step
    row = meta + r * K
    count, first = tl.load(row + NPIECES), tl.load(row + PIECE0)
    if count == 0:
        m = tl.load(shared + tl.load(row + SUMMARY)).to(tl.float64)
        tl.store(largest + r, m)
        tl.store(factors + first, 1.0)
        tl.store(divisors + first, 1.0)
        tl.store(ok + r, ((m - m == 0) & (m >= 0)).to(tl.int8))
    else:
        w = tl.arange(0, WB)
        workers = w < W
        total = tl.zeros((WB,), dtype=tl.float64)
        bad = tl.zeros((WB,), dtype=tl.int32)
        for k in range(count):
            norms = tl.load(shared + plain + w * pieces + first + k, mask=workers, other=0.0)
            norms = norms.to(tl.float64)
            bad = bad | ((norms - norms != 0) | (norms < 0)).to(tl.int32)
            rms = tl.max(norms, axis=0) / tl.load(sqrt_lengths + first + k)
            inverse = tl.where(rms > 0, 1.0 / tl.maximum(rms, 1e-300), 0.0)
            scaled = norms * inverse
            total = total + scaled * scaled
            rms32 = rms.to(tl.float32)
            tl.store(factors + first + k, rms32)
            tl.store(divisors + first + k, tl.where(rms32 > 0, rms32, 1.0))
        tl.store(largest + r, tl.max(tl.where(workers, tl.sqrt(total), 0.0), axis=0))
        tl.store(ok + r, (tl.max(bad, axis=0) == 0).to(tl.int8))
