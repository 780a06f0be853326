"""CuTe DSL pieces shared by xstage's kernels (none of them imports a kernel package).

- ``compile``: compile a kernel for an explicit architecture (sm_90a) on fake tensors, keep PTX/cubin/SASS.
- ``tile_scheduler``: the persistent tile walk (a scheduler object; the Ulysses tile order and the split tail
  as its policies), plain index math shared by kernels, host code and tests.
- ``tile_epilogue``: a warpgroup's staged output tile to local HBM or a peer's symmetric buffer, in one burst
  or one vector at a time (the remote-store epilogue).
- ``epoch``: the epoch-flag protocol of kernels that store into other ranks' buffers (ready, data, completion).
- ``flags``: bounded spin-waits, grid arrival barriers and the error word the host turns into exceptions.
- ``timers``: globaltimer / clock64 span recording.
- ``remote_store``: 128-bit store atoms (local or peer-mapped destinations).
- ``tile_store``: a vectorized tile copy with per-CTA span records (the calibration's local control).
- ``dist``, ``runtime``: host-side helpers (process groups, error-word checks, provenance).
"""
