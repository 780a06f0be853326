"""The Ulysses tile mapping against a reference All-to-All on CPU tensors (fresh random shapes and data)."""
from __future__ import annotations

import random

import pytest
import torch

from flash_a2a.mapping import check_ulysses_shapes, destination, reference_post_a2a


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_destination_matches_reference(world):
    rng = random.Random()
    b, d = rng.randint(1, 2), rng.choice([4, 8])
    h = world * rng.randint(1, 3)
    s = world * rng.randint(1, 5) * 4
    outs = [torch.randn(b, s, h // world, d) for _ in range(world)]
    ref = reference_post_a2a(outs)
    assert all(t.shape == (b, s // world, h, d) for t in ref)
    for r in range(world):
        for row in range(s):
            for hl in range(h // world):
                j, dr, dh = destination(row, hl, r, s, h, world)
                assert torch.equal(ref[j][:, dr, dh], outs[r][:, row, hl]), (r, row, hl)


def test_every_destination_slot_written_once():
    world, s, h = 4, 32, 8
    seen = set()
    for r in range(world):
        for row in range(s):
            for hl in range(h // world):
                seen.add(destination(row, hl, r, s, h, world))
    assert len(seen) == world * (s // world) * h


@pytest.mark.parametrize("s,h,p,tile,match", [
    (1024, 6, 4, 128, "not divisible by the world size"),
    (1001, 8, 2, 1, "sequence length 1001"),
    (1024, 8, 2, 384, "multiple of the 384-row tile"),
])
def test_bad_shapes_name_the_fix(s, h, p, tile, match):
    with pytest.raises(ValueError, match=match):
        check_ulysses_shapes(s, h, p, tile)
