"""Platform profiles: JSON round trip, table interpolation, and strict validation."""

import copy
import json

import pytest

from calibrate import PlatformProfile, load_profile, save_profile
from calibrate.profile import (
    CapacityPoint,
    IssuePoint,
    ProfileError,
    builtin_profile_names,
    builtin_profile_path,
    load_builtin,
    profile_from_dict,
    resolve_profile,
)


def make_profile(**overrides) -> PlatformProfile:
    fields = dict(
        drain_rate_GBps=700.0,
        t_iss0_points=[IssuePoint(64, 16384, 0.4), IssuePoint(64, 32768, 0.6),
                       IssuePoint(128, 16384, 0.5), IssuePoint(128, 32768, 0.9)],
        capacity_points=[CapacityPoint(32, 1.0e6, 40000), CapacityPoint(128, 4.0e6)],
        sm_count=132,
        provenance={"source": "measured", "device": "H200", "world_size": 2, "date": "2026-01-01",
                    "command": "xstage calibrate"},
        applications={"flash_a2a": {"sigma_us_per_kv_tile": 0.5}},
        anchors={"p2p_copy_GBps": 650.0},
        fit_quality={"r2": 0.99},
    )
    fields.update(overrides)
    return PlatformProfile(**fields)


def test_round_trip(tmp_path):
    profile = make_profile()
    path = save_profile(profile, tmp_path / "nested" / "dir" / "p.json")
    assert path.is_file()
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    assert data["schema"] == "xstage.platform_profile" and data["version"] == 1
    assert "knee_bytes_per_producer" not in data["capacity"][1]  # optional field left out when absent


def test_shipped_paper_profile():
    assert "paper" in builtin_profile_names()
    profile = load_builtin("paper")
    assert profile.source == "paper" and profile.sm_count == 148 and profile.provenance["world_size"] == 8
    assert profile.drain_rate == pytest.approx(717e3)
    assert resolve_profile("paper") == profile
    assert resolve_profile(str(builtin_profile_path("paper"))) == profile


@pytest.mark.parametrize("name", builtin_profile_names())
def test_every_shipped_profile_loads_and_predicts(tmp_path, name):
    profile = load_builtin(name)
    assert profile.source == ("paper" if name == "paper" else "measured")
    k = profile.sm_count
    assert profile.drain_rate > 0 and profile.t_iss0(k, k * 32768) > 0 and profile.capacity(k) > 0
    assert load_profile(save_profile(profile, tmp_path / f"{name}.json")) == profile


def test_t_iss0_interpolates_in_bytes_within_nearest_k():
    profile = make_profile()
    assert profile.t_iss0(64, 64 * 16384) == pytest.approx(0.4)
    assert profile.t_iss0(64, 64 * 24576) == pytest.approx(0.5)  # midpoint
    assert profile.t_iss0(128, 128 * 24576) == pytest.approx(0.7)
    # K=100 is nearer to 128 than to 64 in log distance.
    assert profile.t_iss0(100, 100 * 24576) == pytest.approx(0.7)
    assert profile.t_iss0(70, 70 * 24576) == pytest.approx(0.5)


def test_t_iss0_extrapolates_linearly_and_never_below_zero():
    profile = make_profile()
    assert profile.t_iss0(128, 128 * 49152) == pytest.approx(1.3)
    assert profile.t_iss0(128, 128 * 8192) == pytest.approx(0.3)
    assert profile.t_iss0(128, 128 * 1) == pytest.approx(0.5 - 0.4 * 16383 / 16384)
    steep = make_profile(t_iss0_points=[IssuePoint(64, 16384, 0.1), IssuePoint(64, 32768, 0.6)])
    assert steep.t_iss0(64, 64 * 1) == 0.0  # the straight line would go negative
    with pytest.raises(ValueError):
        profile.t_iss0(0, 1000)


def test_t_iss0_single_point_is_constant():
    profile = make_profile(t_iss0_points=[IssuePoint(148, 32768, 0.76)])
    assert profile.t_iss0(10, 10) == pytest.approx(0.76)
    assert profile.t_iss0(148, 1e9) == pytest.approx(0.76)


def test_capacity_is_linear_in_k_and_clamped():
    profile = make_profile()
    assert profile.capacity(32) == pytest.approx(1.0e6)
    assert profile.capacity(80) == pytest.approx(2.5e6)
    assert profile.capacity(8) == pytest.approx(1.0e6)
    assert profile.capacity(148) == pytest.approx(4.0e6)


# --- validation ---------------------------------------------------------------------


def good_dict():
    return make_profile().to_dict()


def mutate(path, value):
    """good_dict() with the field at ``path`` (tuple of keys/indices) set to ``value`` or deleted."""
    data = copy.deepcopy(good_dict())
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return data


DELETE = object()

INVALID = [
    (("schema",), "other.schema", "schema"),
    (("schema",), DELETE, "schema"),
    (("version",), 2, "supported version is 1"),
    (("version",), DELETE, "supported version is 1"),
    (("drain_rate_GBps",), 0, "drain_rate_GBps must be > 0"),
    (("drain_rate_GBps",), -5.0, "drain_rate_GBps must be > 0"),
    (("drain_rate_GBps",), "fast", "drain_rate_GBps must be a number"),
    (("drain_rate_GBps",), DELETE, "missing required field 'drain_rate_GBps'"),
    (("sm_count",), 132.5, "sm_count must be an integer"),
    (("sm_count",), True, "sm_count must be an integer"),
    (("t_iss0",), [], "'t_iss0' is empty"),
    (("t_iss0",), {"producers": 1}, "must be a list"),
    (("capacity",), [], "'capacity' is empty"),
    (("capacity",), DELETE, "missing required field 'capacity'"),
    (("t_iss0", 0, "t_iss0_us"), -0.1, "t_iss0[0].t_iss0_us must be > 0"),
    (("t_iss0", 1, "bytes_per_producer"), DELETE, "t_iss0[1] is missing required field 'bytes_per_producer'"),
    (("t_iss0", 1, "bytes_per_producer"), 16384, "duplicate"),
    (("capacity", 0, "capacity_bytes"), -1, "capacity[0].capacity_bytes must be >= 0"),
    (("capacity", 0, "knee_bytes_per_producer"), -1, "knee_bytes_per_producer must be > 0"),
    (("capacity", 1, "producers"), 32, "duplicate"),
    (("capacity", 0), 5, "capacity[0] must be a JSON object"),
    (("provenance",), DELETE, "missing required field 'provenance'"),
    (("provenance", "source"), "guess", "provenance.source must be one of paper, measured"),
    (("provenance", "device"), DELETE, "provenance is missing required field 'device'"),
    (("provenance", "date"), 20260101, "provenance.date must be a string"),
    (("provenance", "world_size"), 0, "provenance.world_size must be > 0"),
    (("applications",), [], "applications must be a JSON object"),
    (("extra_field",), 1, "unknown field(s): extra_field"),
]


@pytest.mark.parametrize("path,value,message", INVALID, ids=[f"{'.'.join(map(str, p))}={v!r}"[:60]
                                                             for p, v, _ in INVALID])
def test_invalid_profiles_raise_profile_error(tmp_path, path, value, message):
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(mutate(path, value)))
    with pytest.raises(ProfileError) as info:
        load_profile(file)
    text = str(info.value)
    assert message in text and str(file) in text
    assert "\n" not in text


def test_unparsable_and_missing_files(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "absent.json")
    with pytest.raises(ProfileError, match="must be a JSON object"):
        profile_from_dict([1, 2])
    with pytest.raises(ProfileError, match="no built-in profile 'nope'.*paper"):
        resolve_profile("nope")
    assert issubclass(ProfileError, ValueError)
