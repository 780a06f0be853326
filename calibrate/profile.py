"""Platform profiles: the calibrated X-Stage parameters (T_iss0, R, Q) of one machine.

A profile is stored as JSON (schema "xstage.platform_profile", version 1):

    {"schema": "xstage.platform_profile", "version": 1,
     "drain_rate_GBps": 717.0, "sm_count": 148,
     "t_iss0": [{"producers": 148, "bytes_per_producer": 32768, "t_iss0_us": 0.76}],
     "capacity": [{"producers": 148, "capacity_bytes": 4456296, "knee_bytes_per_producer": 33792}],
     "provenance": {"source": "paper", "device": "...", "world_size": 8, "date": "2026-07-25"},
     "applications": {...}, "anchors": {...}, "fit_quality": {...}}

``load_profile`` validates strictly and raises :class:`ProfileError` with a
one-line message, so a bad file never turns into a traceback in the CLI.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calibrate.model import gbps_to_bytes_per_us

SCHEMA = "xstage.platform_profile"
VERSION = 1
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
SOURCES = ("paper", "measured")
_TOP_LEVEL_KEYS = {
    "schema", "version", "drain_rate_GBps", "sm_count", "t_iss0", "capacity",
    "provenance", "applications", "anchors", "fit_quality",
}


class ProfileError(ValueError):
    """A platform profile is missing, unreadable or invalid."""


@dataclass(frozen=True)
class IssuePoint:
    """One measured backpressure-free issue time T_iss0 for K producers writing B bytes each."""

    producers: int
    bytes_per_producer: float
    t_iss0_us: float


@dataclass(frozen=True)
class CapacityPoint:
    """Effective outstanding capacity Q (bytes) for K producers, with the knee it came from."""

    producers: int
    capacity_bytes: float
    knee_bytes_per_producer: float | None = None


@dataclass
class PlatformProfile:
    """Calibrated platform model M_X = (T_iss0(K, V), R, Q(K)) plus its provenance."""

    drain_rate_GBps: float
    t_iss0_points: list[IssuePoint]
    capacity_points: list[CapacityPoint]
    sm_count: int
    provenance: dict
    applications: dict = field(default_factory=dict)
    anchors: dict = field(default_factory=dict)
    fit_quality: dict = field(default_factory=dict)

    @property
    def drain_rate(self) -> float:
        """Effective aggregate drain rate R in bytes/us."""
        return float(gbps_to_bytes_per_us(self.drain_rate_GBps))

    @property
    def source(self) -> str:
        return self.provenance["source"]

    def t_iss0(self, producers, volume_bytes):
        """Backpressure-free issue time (us) for ``producers`` sharing ``volume_bytes``.

        Uses the table points whose K is nearest (in log distance) to ``producers``
        and interpolates linearly in bytes per producer; outside the measured
        range it extrapolates linearly from the two nearest points, never below 0.
        """
        if producers <= 0:
            raise ValueError(f"producers must be > 0, got {producers}")
        distance = {k: abs(math.log(k / producers)) for k in {p.producers for p in self.t_iss0_points}}
        nearest_k = min(sorted(distance), key=distance.get)  # ties go to the smaller K
        points = sorted((p for p in self.t_iss0_points if p.producers == nearest_k),
                        key=lambda p: p.bytes_per_producer)
        x = np.array([p.bytes_per_producer for p in points])
        y = np.array([p.t_iss0_us for p in points])
        b = np.asarray(volume_bytes, dtype=float) / producers
        if len(points) == 1:
            return np.full_like(b, y[0])
        inside = np.interp(b, x, y)
        below = y[0] + (b - x[0]) * (y[1] - y[0]) / (x[1] - x[0])
        above = y[-1] + (b - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.maximum(np.where(b < x[0], below, np.where(b > x[-1], above, inside)), 0.0)

    def capacity(self, producers):
        """Effective outstanding capacity Q(K) in bytes: linear in K, clamped at the table ends."""
        points = sorted(self.capacity_points, key=lambda p: p.producers)
        return np.interp(np.asarray(producers, dtype=float),
                         [p.producers for p in points], [p.capacity_bytes for p in points])

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "drain_rate_GBps": self.drain_rate_GBps,
            "sm_count": self.sm_count,
            "t_iss0": [vars(p) for p in self.t_iss0_points],
            "capacity": [
                {k: v for k, v in vars(p).items() if v is not None} for p in self.capacity_points
            ],
            "provenance": self.provenance,
            "applications": self.applications,
            "anchors": self.anchors,
            "fit_quality": self.fit_quality,
        }


# --- validation -----------------------------------------------------------------


def _number(value, where: str, *, positive: bool = False, integer: bool = False):
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ProfileError(f"{where} must be {kind}, got {json.dumps(value)}")
    if not math.isfinite(value):
        raise ProfileError(f"{where} must be finite, got {value}")
    if value < 0 or (positive and value == 0):
        raise ProfileError(f"{where} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


def _require(mapping: dict, key: str, where: str):
    if key not in mapping:
        raise ProfileError(f"{where} is missing required field '{key}'")
    return mapping[key]


def _dict(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _table(data: dict, key: str) -> list[dict]:
    rows = _require(data, key, "profile")
    if not isinstance(rows, list):
        raise ProfileError(f"profile field '{key}' must be a list of points")
    if not rows:
        raise ProfileError(f"profile table '{key}' is empty: it needs at least one point")
    return [_dict(row, f"{key}[{i}]") for i, row in enumerate(rows)]


def _issue_points(data: dict) -> list[IssuePoint]:
    points = []
    for i, row in enumerate(_table(data, "t_iss0")):
        where = f"t_iss0[{i}]"
        points.append(IssuePoint(
            producers=_number(_require(row, "producers", where), f"{where}.producers", positive=True, integer=True),
            bytes_per_producer=_number(_require(row, "bytes_per_producer", where),
                                       f"{where}.bytes_per_producer", positive=True),
            t_iss0_us=_number(_require(row, "t_iss0_us", where), f"{where}.t_iss0_us", positive=True),
        ))
    keys = [(p.producers, p.bytes_per_producer) for p in points]
    if len(set(keys)) != len(keys):
        raise ProfileError("t_iss0 table has duplicate (producers, bytes_per_producer) points")
    return points


def _capacity_points(data: dict) -> list[CapacityPoint]:
    points = []
    for i, row in enumerate(_table(data, "capacity")):
        where = f"capacity[{i}]"
        knee = row.get("knee_bytes_per_producer")
        points.append(CapacityPoint(
            producers=_number(_require(row, "producers", where), f"{where}.producers", positive=True, integer=True),
            capacity_bytes=_number(_require(row, "capacity_bytes", where), f"{where}.capacity_bytes"),
            knee_bytes_per_producer=None if knee is None else _number(
                knee, f"{where}.knee_bytes_per_producer", positive=True),
        ))
    producers = [p.producers for p in points]
    if len(set(producers)) != len(producers):
        raise ProfileError("capacity table has duplicate producers values")
    return points


def _provenance(data: dict) -> dict:
    provenance = _dict(_require(data, "provenance", "profile"), "provenance")
    source = _require(provenance, "source", "provenance")
    if source not in SOURCES:
        raise ProfileError(f"provenance.source must be one of {', '.join(SOURCES)}; got {json.dumps(source)}")
    for key in ("device", "date"):
        if not isinstance(_require(provenance, key, "provenance"), str):
            raise ProfileError(f"provenance.{key} must be a string")
    _number(_require(provenance, "world_size", "provenance"), "provenance.world_size", positive=True, integer=True)
    return provenance


def profile_from_dict(data) -> PlatformProfile:
    """Validate a decoded JSON document and build the profile (raises ProfileError)."""
    data = _dict(data, "profile")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise ProfileError(f"not a platform profile: schema is {json.dumps(schema)}, expected \"{SCHEMA}\"")
    if "version" not in data:
        raise ProfileError(f"profile has no 'version'; supported version is {VERSION}")
    if data["version"] != VERSION:
        raise ProfileError(f"unsupported profile version {json.dumps(data['version'])}; supported version is {VERSION}")
    unknown = sorted(set(data) - _TOP_LEVEL_KEYS)
    if unknown:
        raise ProfileError(f"profile has unknown field(s): {', '.join(unknown)}")
    return PlatformProfile(
        drain_rate_GBps=_number(_require(data, "drain_rate_GBps", "profile"), "drain_rate_GBps", positive=True),
        t_iss0_points=_issue_points(data),
        capacity_points=_capacity_points(data),
        sm_count=_number(_require(data, "sm_count", "profile"), "sm_count", positive=True, integer=True),
        provenance=_provenance(data),
        applications=_dict(data.get("applications", {}), "applications"),
        anchors=_dict(data.get("anchors", {}), "anchors"),
        fit_quality=_dict(data.get("fit_quality", {}), "fit_quality"),
    )


# --- files ------------------------------------------------------------------------


def load_profile(path) -> PlatformProfile:
    """Read and validate a profile JSON file; raises ProfileError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    try:
        return profile_from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"profile {path}: {exc}") from None


def save_profile(profile: PlatformProfile, path) -> Path:
    """Write the profile as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def builtin_profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def builtin_profile_path(name: str) -> Path:
    """Path of calibrate/profiles/<name>.json; raises ProfileError if there is none."""
    path = PROFILES_DIR / f"{name}.json"
    if not path.is_file():
        raise ProfileError(f"no built-in profile '{name}' (available: {', '.join(builtin_profile_names())})")
    return path


def load_builtin(name: str) -> PlatformProfile:
    return load_profile(builtin_profile_path(name))


def resolve_profile(name_or_path) -> PlatformProfile:
    """Load a built-in profile by name, or a profile file by path (anything with / or .json)."""
    text = str(name_or_path)
    if text.endswith(".json") or "/" in text:
        return load_profile(text)
    return load_builtin(text)


def default_profile_name() -> str:
    """The measured two-GPU profile once it has been calibrated, else the paper's numbers."""
    return "h200x2" if (PROFILES_DIR / "h200x2.json").is_file() else "paper"
