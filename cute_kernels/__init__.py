"""CuTe DSL pieces shared by xstage's kernels.

- ``compile``: compile a kernel for an explicit architecture (sm_90a) on fake tensors, keep PTX/cubin.
- ``timers``: globaltimer / clock64 span recording.
- ``flags``: bounded spin-waits, grid arrival barriers and the error word the host turns into exceptions.
- ``remote_store``: 128-bit store atoms (local or peer-mapped destinations).
- ``tile_store``: the first real kernel, a vectorized tile copy with per-CTA span records.
- ``runtime``: host-side helpers (error-word checks, device queries, test markers).
"""
