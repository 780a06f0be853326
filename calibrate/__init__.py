"""X-Stage calibration: the Burst-Gap model, platform profiles and the design-test CLI."""

from calibrate.profile import PlatformProfile, load_profile, save_profile

__all__ = ["PlatformProfile", "load_profile", "save_profile"]
