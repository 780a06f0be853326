"""flash_a2a.config: the per-shape choices (split tail, paced store, relay), each decided once by
resolve_config from models fitted on 2 x H200, and the options it refuses with a ValueError naming the fix."""
from __future__ import annotations

import pytest

from flash_a2a.config import (PACE_SAVING_KV_BLOCKS, PACE_SLOWDOWN, AttentionConfig, paced_store_pays, relay_pays,
                              resolve_config, split_tail_time, tail_launch_pays)
from flash_a2a.mapping import RELAY_START_KV, relay_events_in_loop

# the benchmark's shapes on 132 SMs at P = 2: (heads per rank, sequence length)
SHAPES = [(h, s) for h in (3, 12) for s in (8192, 16384, 32768, 49152, 65536)]


def _fused(h, s, mode="piggyback", **options) -> AttentionConfig:
    return resolve_config(mode, (s // 128) * h, 132, s // 128, 2, relay_vectors=10 ** 6, **options)


def test_split_tail_where_the_second_launch_pays():
    """"auto" splits the last round in a second launch where the split tail (split_tail_time: rounds of chunks,
    each CHUNK_TIME_FACTOR / k of a tile plus CHUNK_COST_KV_BLOCKS) saves more than the launch costs: 3 heads/8K,
    48K, 64K and 12 heads/16K, 32K, 64K; not 3 heads/16K and 12 heads/48K (120-tile tails, which no k shortens),
    nor 3 heads/32K and 12 heads/8K (108-tile tails: the chunks' cost eats the saving; measured there: +1.5 µs)."""
    picked = [(h, s) for h, s in SHAPES if _fused(h, s).tail_split]
    assert picked == [(3, 8192), (3, 49152), (3, 65536), (12, 16384), (12, 32768), (12, 65536)]
    assert picked == [(h, s) for h, s in SHAPES if tail_launch_pays((s // 128) * h, 132, s // 128, 2)]
    assert split_tail_time(60, 132, 64, 1) == 1.0 and split_tail_time(60, 132, 64, 2) < 0.7
    assert split_tail_time(108, 132, 64, 6) > 1.0
    c = _fused(3, 8192)
    assert (c.tail_split, c.split_k) == (True, 2)
    assert c.launches() == ({"walk": "rounds", "store": "st"}, {"walk": "tail", "relay": True})
    for n_tiles in (264, 100):  # full rounds; one round
        c = resolve_config("local", n_tiles, 132, 64)
        assert not c.tail_split and c.split_k == 1 and c.launches() == ({"walk": "all", "store": "st"},)


def test_split_tail_true_forces_or_refuses():
    """True splits wherever some k shortens the tail (192 tiles of 16 KV blocks: k = 2 saves less than the
    second launch costs, so "auto" leaves it), runs unsplit where there is nothing to split or no k shortens it
    (12 heads/8K), and is refused where the split kernel does not go (head_dim 64, spans) or the tail is
    not all local (P = 4, 240 tiles: a 108-tile last round but 60 local tiles; "auto" leaves it unsplit there,
    and the local kernel, whose tiles are all local, splits it)."""
    forced = resolve_config("local", 192, 132, 16, tail_split=True)
    assert (forced.tail_split, forced.split_k) == (True, 2) and not resolve_config("local", 192, 132, 16).tail_split
    assert not _fused(12, 8192, tail_split=True).tail_split
    assert not resolve_config("local", 264, 132, 64, tail_split=True).tail_split
    assert not resolve_config("local", 192, 132, 64, tail_split=False).tail_split
    for kw in ({"head_dim": 64}, {"instrument": True}):
        assert not resolve_config("local", 192, 132, 64, **kw).tail_split  # "auto" quietly unsplit
        with pytest.raises(ValueError, match="tail_split=True"):
            resolve_config("local", 192, 132, 64, tail_split=True, **kw)
    assert not resolve_config("piggyback", 240, 132, 512, 4).tail_split
    with pytest.raises(ValueError, match="not all local"):
        resolve_config("piggyback", 240, 132, 512, 4, tail_split=True)
    assert resolve_config("local", 240, 132, 512, 1).tail_split


def test_paced_store_where_it_pays():
    """store="auto" paces piggyback stores where the Q-loop's slowdown (PACE_SLOWDOWN of the kernel) costs less
    than the burst's NVLink part (PACE_SAVING_KV_BLOCKS) and each CTA has a next tile: 3 heads/16K and 12
    heads/8K (measured 3.2 / 5.1 µs against the burst's 10.9 / 11.6); not 3 heads/8K (its rounds kernel has one
    tile per CTA), nor the long kernels; never completion-coupled or FA-only."""
    assert [(h, s) for h, s in SHAPES if _fused(h, s).store == "paced"] == [(3, 16384), (12, 8192)]
    assert _fused(3, 16384, mode="completion_coupled").store == "st"
    assert resolve_config("local", 384, 132, 128).store == "st"
    assert _fused(3, 16384, store="st").store == "st" and _fused(3, 32768, store="paced").store == "paced"
    with pytest.raises(ValueError, match="paced"):
        _fused(3, 16384, mode="completion_coupled", store="paced")
    assert not paced_store_pays(192, 132, 64, True) and paced_store_pays(192, 132, 64, False)
    assert not paced_store_pays(100, 132, 64)
    limit = PACE_SAVING_KV_BLOCKS / PACE_SLOWDOWN
    assert paced_store_pays(264, 132, int(limit / 2) - 1) and not paced_store_pays(264, 132, int(limit / 2) + 1)
    c = _fused(12, 16384, store="paced")  # a split shape: the rounds kernel paces, the tail launch stores bursts
    assert c.launches() == ({"walk": "rounds", "store": "paced"}, {"walk": "tail", "relay": False})


def test_relay_where_the_rounds_kernel_is_one_round():
    """relay="auto" relays where the split's rounds kernel is one round (its peer burst has no next tile to pace
    under): 3 heads/8K only; True forces it on a split piggyback launch; everything else is refused."""
    assert [(h, s) for h, s in SHAPES if _fused(h, s).relay] == [(3, 8192)]
    assert not _fused(3, 8192, relay=False).relay
    assert not _fused(3, 8192, mode="completion_coupled").relay
    assert not resolve_config("piggyback", 192, 132, 64, 2, relay_vectors=2 ** 31).relay  # 32-bit indices
    assert _fused(12, 16384, relay=True).relay and _fused(12, 16384, relay=True, store="paced").relay
    assert not relay_pays(192, 132, 64, 2, False) and not relay_pays(192, 132, 64, 1, True)
    assert not relay_pays(192, 132, RELAY_START_KV, 2, True)
    assert relay_events_in_loop(32, 6) == 7 and relay_events_in_loop(4, 6) == 1 and relay_events_in_loop(3, 6) == 0
    for kw, match in (({"mode": "completion_coupled"}, "piggyback"), ({"tail_split": False}, "split tail")):
        with pytest.raises(ValueError, match=match):
            _fused(3, 8192, relay=True, **kw)
    with pytest.raises(ValueError, match="32-bit"):
        resolve_config("piggyback", 192, 132, 64, 2, relay_vectors=2 ** 31, relay=True)


@pytest.mark.parametrize("name,value", [("tail_split", "kernel"), ("tail_split", "launch"), ("store", "bulk"),
                                        ("store", "tma"), ("relay", "yes"), ("tail_split", 1)])
def test_unknown_options_name_the_choices(name, value):
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        resolve_config("piggyback", 192, 132, 64, 2, **{name: value})


def test_config_is_frozen():
    c = resolve_config("local", 192, 132, 64)
    with pytest.raises(AttributeError):
        c.tail_split = False  # one decision per shape: nothing downstream changes it


def test_stages_and_tile_rows_of_the_local_kernel():
    """The one-launch local kernel double-buffers Q where tiles have few KV blocks (Q_DOUBLE_BUFFER_MAX_KV) and
    always on the 192-row d = 64 tiles (with a third K/V stage); the fused and split kernels keep one Q stage,
    two K/V stages; AttentionConfig.launches passes only what differs from the kernel's defaults."""
    from flash_a2a.config import Q_DOUBLE_BUFFER_MAX_KV, local_stages

    assert local_stages(128, 4) == (2, 2) and local_stages(128, Q_DOUBLE_BUFFER_MAX_KV) == (2, 2)
    assert local_stages(128, Q_DOUBLE_BUFFER_MAX_KV + 1) == (1, 2)
    assert local_stages(192, 1000) == (2, 3)
    short = resolve_config("local", 1024, 132, 4, head_dim=128)
    assert (short.q_stages, short.kv_stages) == (2, 2) and short.launches() == ({"walk": "all", "store": "st",
                                                                                 "q_stages": 2},)
    d64 = resolve_config("local", 352, 132, 32, head_dim=64, tile_m=192)
    assert d64.launches() == ({"walk": "all", "store": "st", "tile_m": 192, "q_stages": 2, "kv_stages": 3},)
    long = resolve_config("local", 512, 132, 64, head_dim=128, tail_split=False)
    assert long.launches() == ({"walk": "all", "store": "st"},)
    fused = resolve_config("piggyback", 1024, 132, 4, 2, head_dim=128)
    assert (fused.q_stages, fused.kv_stages, fused.tile_m) == (1, 2, 128)
    split = resolve_config("local", 1100, 132, 40, head_dim=128, tail_split=True)
    assert split.tail_split and (split.q_stages, split.kv_stages) == (1, 2)
