"""The tile schedules of Flash Inference: which block of past inputs feeds which block of future outputs, and when.

Flash (data-independent filter): after the output at 0-based step t, with U = lowbit(t + 1), inputs y[t-U+1 .. t]
feed outputs z[t+1 .. t+U] through filter lags 1 .. 2U-1, a U x U Toeplitz block. With a base block size b (a power
of two), steps with U < b are skipped and the pairs they would cover (input and output in the same b-aligned block)
are summed directly by the sequential part of each step instead.

Relaxed (data-dependent filter, both factors arrive online): besides the row j = 0 and column k = 0 of the
(input j, lag k) grid, which each step handles directly, step t adds for every power of two U dividing t + 1 with
q = (t + 1) / U >= 2 the square inputs [U, 2U) x lags [t-U+1, t], and when q >= 3 its mirror, inputs [t-U+1, t] x
lags [U, 2U). Both land on outputs [t+1, t+2U-1] and use only values known at step t.
"""


def lowbit(i: int) -> int:
    """The largest power of two dividing i > 0."""
    return i & -i


def flash_tile(t: int, block: int = 1) -> int:
    """Size U of the tile launched after step t (inputs t-U+1..t -> outputs t+1..t+U), or 0 if none."""
    U = lowbit(t + 1)
    return U if U >= block else 0


def relaxed_squares(t: int) -> list[tuple[int, int, int]]:
    """Squares (first input, first lag, size) of the relaxed product computed after step t."""
    squares = []
    U = 1
    while (t + 1) % U == 0 and (t + 1) // U >= 2:
        squares.append((U, t - U + 1, U))
        if (t + 1) // U >= 3:
            squares.append((t - U + 1, U, U))
        U *= 2
    return squares
