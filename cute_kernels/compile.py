"""Compile CuTe DSL kernels for an explicit GPU architecture and keep their PTX and cubin.

With no GPU present the DSL silently targets sm_100a, and ``sm_90`` without the ``a`` rejects WGMMA,
so every compile here names its architecture. The dump directory is created first: the DSL ignores one
that does not exist yet.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_ARCH = "sm_90a"


@dataclass
class CompiledKernel:
    """A compiled ``@cute.jit`` host function with the artifacts CI inspects."""

    fn: Any
    arch: str
    ptx: str
    cubin: bytes
    dump_dir: str

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def ptx_count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.ptx))


def set_target_arch(arch: str = DEFAULT_ARCH) -> None:
    """Point the DSL at ``arch`` for tracing too (atoms such as WGMMA check it at trace time)."""
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch must look like 'sm_90a', got {arch!r}")
    os.environ["CUTE_DSL_ARCH"] = arch
    from cutlass.cutlass_dsl import CuTeDSL

    CuTeDSL._get_dsl().envar.arch = arch


def compile_kernel(
    jit_fn: Callable,
    *args: Any,
    arch: str = DEFAULT_ARCH,
    dump_dir: str | None = None,
    tvm_ffi: bool = True,
    options: str = "",
) -> CompiledKernel:
    """``cute.compile`` for ``arch`` with PTX and cubin kept in ``dump_dir`` (a fresh temp dir by default).

    ``tvm_ffi`` compiles the host entry for TVM-FFI so the result takes torch tensors directly and
    launches on torch's current stream (CUDA-Graph capturable).
    """
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import CuTeDSL

    set_target_arch(arch)
    dump_dir = dump_dir or tempfile.mkdtemp(prefix="xstage-dump-")
    os.makedirs(dump_dir, exist_ok=True)
    CuTeDSL._get_dsl().envar.dump_dir = dump_dir
    opts = f"--gpu-arch {arch} --keep-ptx --keep-cubin"
    if tvm_ffi:
        opts += " --enable-tvm-ffi"
    if options:
        opts += " " + options
    fn = cute.compile(jit_fn, *args, options=opts)
    ptx = fn.__ptx__ or ""
    cubin = fn.__cubin__ or b""
    if isinstance(cubin, str):
        cubin = cubin.encode()
    return CompiledKernel(fn=fn, arch=arch, ptx=ptx, cubin=cubin, dump_dir=dump_dir)


@dataclass
class ResourceUsage:
    """What ``ptxas -v`` reports per kernel entry."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    raw: str = field(repr=False, default="")


def ptxas_resource_usage(ptx: str, arch: str = DEFAULT_ARCH) -> dict[str, ResourceUsage] | None:
    """Assemble ``ptx`` with ptxas -v and parse registers/stack/spills per entry.

    None when no ptxas is on PATH or it is too old for the PTX ISA the DSL emitted.
    """
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=False,
        )
    if proc.returncode != 0 and "Unsupported .version" in proc.stderr:
        return None  # this ptxas is older than the DSL's PTX ISA (e.g. CUDA 13.0 vs the DSL's 13.4 NVVM)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed on the generated PTX:\n{proc.stderr[-2000:]}")
    usage: dict[str, ResourceUsage] = {}
    read: dict[str, set] = {}  # which of an entry's two report lines were found
    current = props_of = None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            usage[current] = ResourceUsage(0, 0, 0, 0, "")
            read[current] = set()
            continue
        if current is None:
            continue
        u = usage[current]
        u.raw += line + "\n"
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_of = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            # The entry's own line, or a non-inlined callee's: a callee's local memory counts against the entry.
            stack, stores, loads = map(int, m.groups())
            u.stack_bytes += stack
            u.spill_stores += stores
            u.spill_loads += loads
            if props_of == current:
                read[current].add("spills")
        m = re.search(r"Used (\d+) registers", line)
        if m:
            u.registers = int(m.group(1))
            read[current].add("registers")
    # An entry whose lines were not found would read as zero spills: a check that checked nothing.
    unread = [name for name, found in read.items() if found != {"spills", "registers"}]
    if not usage or unread:
        raise RuntimeError(f"cannot read registers and spills of {unread or 'any entry'} from ptxas -v:\n"
                           f"{proc.stderr[-2000:]}")
    return usage


def register_split_shortfall(ptx: str, registers: int) -> int:
    """Registers a warp-specialized kernel's setmaxnreg split asks for beyond what its launch holds (0: it fits).

    The launch gives every thread ``registers`` (ptxas's count) for ``.reqntid`` threads; the first warpgroup then
    shrinks to the ``setmaxnreg.dec`` count and the others grow to the ``setmaxnreg.inc`` count. A split that
    asks for more than the CTA holds leaves ``setmaxnreg.inc`` waiting forever: a hang, not an error.
    """
    threads = re.search(r"\.reqntid\s+(\d+)", ptx)
    dec = re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)
    inc = re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)
    if threads is None or len(set(dec)) != 1 or len(set(inc)) != 1:
        raise ValueError(f"not one .reqntid and one setmaxnreg split in the PTX (dec {dec}, inc {inc})")
    n = int(threads.group(1))
    need = 128 * int(dec[0]) + (n - 128) * int(inc[0])
    return max(0, need - registers * n)


def _nvdisasm() -> str | None:
    """nvdisasm from PATH, else the copy triton ships (a dependency of quack), else None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton

        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        return cand if os.access(cand, os.X_OK) else None
    except ImportError:
        return None


def sass(cubin: bytes) -> str | None:
    """The SASS of a compiled cubin (``nvdisasm -c``), or None where no nvdisasm is available."""
    tool = _nvdisasm()
    if tool is None or not cubin:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else None


def softmax_overlap(sass_text: str) -> list[tuple[int, int]]:
    """For each ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` (S ready, PV still running) in the SASS: how many
    ``MUFU.EX2`` and ``FFMA`` come before the following ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (PV done), i.e.
    how much of the softmax actually overlaps the warpgroup's own PV GEMM."""
    lines = sass_text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in lines[i]:
            j = i + 1
            while j < len(lines) and "WARPGROUP.DEPBAR.LE gsb0, 0x0" not in lines[j]:
                j += 1
            seg = lines[i:j]
            out.append((sum("MUFU.EX2" in s for s in seg), sum(" FFMA " in s for s in seg)))
            i = j
        i += 1
    return out


SYNC_MARKS = ("HGMMA", "BAR.", "SYNCS", "DEPBAR", "WARPGROUP.ARRIVE", "BRA")


def loop_outline(body: list[str]) -> list[tuple[str, object]]:
    """A KV loop's body (``hgmma_loop``) as its synchronization skeleton: ("sync", instruction) for each
    HGMMA, barrier, mbarrier op, warpgroup fence/wait and branch, in order, and between two of them
    ("ops", {opcode base: count}) for the arithmetic ptxas placed there (MUFU, FFMA, FMUL, F2FP...). Two
    kernels with the same instructions but another schedule differ here (e.g. what sits between the QKᵀ
    HGMMAs, or how many MUFU precede the PV wait)."""
    out: list[tuple[str, object]] = []
    ops: dict[str, int] = {}
    for ins in body:
        op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
        if any(mark in ins for mark in SYNC_MARKS):
            if ops:
                out.append(("ops", ops))
                ops = {}
            out.append(("sync", ins))
        else:
            base = op.split(".")[0]
            ops[base] = ops.get(base, 0) + 1
    if ops:
        out.append(("ops", ops))
    return out


def hgmma_loop(sass_text: str, hgmmas: int) -> list[str] | None:
    """The instructions of the shortest backward-branch loop in the SASS that holds exactly ``hgmmas``
    HGMMAs (the attention kernel's KV-block loop: 16 at d = 128), or None."""
    return sass_loop(sass_text, lambda body: sum("HGMMA" in x for x in body) == hgmmas)


def sass_loop(sass_text: str, accept) -> list[str] | None:
    """The instructions of the shortest backward-branch loop in the SASS whose body ``accept`` (a predicate
    on the instruction list) takes, or None. E.g. the TMA producer's KV loop: ``"UTMALDG"`` in a body."""
    ins, labels = [], {}
    for line in sass_text.splitlines():
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    best = None
    for i, t in enumerate(ins):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", t)
        j = labels.get(m.group(1)) if m else None
        if j is not None and j < i and accept(ins[j:i + 1]):
            if best is None or i - j < len(best):
                best = ins[j:i + 1]
    return best
