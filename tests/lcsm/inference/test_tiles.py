import pytest

from lcsm.inference.tiles import flash_tile, lowbit, relaxed_squares


@pytest.mark.parametrize("L", [1, 2, 7, 16, 33, 64, 100])
@pytest.mark.parametrize("block", [1, 2, 4, 16])
def test_flash_tiles_cover_every_pair_once(L, block):
    """Pairs (input j, output s > j): in-block ones by the step, the rest by exactly one tile, launched in time."""
    count = {}
    for t in range(L):
        for j in range(t - t % block, t + 1):
            count[j, t] = count.get((j, t), 0) + 1
        U = flash_tile(t, block)
        for j in range(t - U + 1, t + 1) if U else ():
            assert j >= 0
            for s in range(t + 1, min(t + U, L - 1) + 1):
                count[j, s] = count.get((j, s), 0) + 1
    assert count == {(j, s): 1 for s in range(L) for j in range(s + 1)}


@pytest.mark.parametrize("L", [1, 2, 5, 16, 37, 64])
def test_relaxed_squares_cover_every_pair_once_with_known_values(L):
    count = {(0, k): 1 for k in range(L)} | {(j, 0): 1 for j in range(1, L)}  # done directly by each step
    for t in range(L):
        for j0, k0, U in relaxed_squares(t):
            for j in range(j0, j0 + U):
                for k in range(k0, k0 + U):
                    assert j <= t and k <= t < j + k, "a square must use known values and feed only later outputs"
                    if j + k < L:
                        count[j, k] = count.get((j, k), 0) + 1
    assert count == {(j, k): 1 for j in range(L) for k in range(L - j)}


def test_lowbit():
    assert [lowbit(i) for i in range(1, 9)] == [1, 2, 1, 4, 1, 2, 1, 8]
