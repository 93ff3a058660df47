"""Types of lmd._native, the C++ extension built from native/ (see native/transport.h).

Errors: ValueError for bad arguments (out-of-range copies, foreign or closed regions,
malformed descriptors), RuntimeError for what the system refused (CUDA missing, a peer's
region gone, a failed copy batch), BufferError for a buffer over a closed or GPU region.
"""

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final, Protocol, Self, TypedDict

from typing_extensions import Buffer

ABI_VERSION: Final[int]

class _Int64Array(Protocol):
    """A C-contiguous int64 array of shape [N, 3] (numpy), read through its buffer."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...

class CudaProbe(TypedDict):
    available: bool
    devices: int
    reason: str

def probe_cuda() -> CudaProbe:
    """Load the CUDA driver at run time and count devices; never raises."""

def w4a16_rows_ready(device: int) -> str:
    """Load the W4A16 decode kernels on a CUDA device; "" when loaded, else why not."""

def w4a16_rows(
    device: int,
    x: int,
    q: int,
    s: int,
    z: int,
    bias: int,
    y: int,
    rows: int,
    n: int,
    k: int,
    x_stride: int,
    bf16: bool,
    warps: int,
    stream: int,
    gated: bool = False,
) -> None:
    """y = x W^T (+ b) for 1-16 rows on the tensor cores, enqueued on a CUstream;
    `gated`: y = silu(x gate^T) * (x up^T), W = gate | up."""

def w4a16_rows_normed(
    device: int,
    x: int,
    residual: int,
    gamma: int,
    summed: int,
    eps: float,
    q: int,
    s: int,
    z: int,
    bias: int,
    y: int,
    n: int,
    k: int,
    bf16: bool,
    warps: int,
    stream: int,
    gated: bool = False,
) -> None:
    """w4a16_rows for one row of RMSNorm(x + residual), made in the launch."""

def w4a16_experts(
    device: int,
    x: int,
    q: int,
    s: int,
    z: int,
    pairs: int,
    experts: int,
    weights: int,
    y: int,
    rows: int,
    blocks: int,
    num_pairs: int,
    row_div: int,
    n: int,
    k: int,
    x_stride: int,
    bf16: bool,
    warps: int,
    stream: int,
    gated: bool = False,
    mixed: bool = False,
) -> None:
    """y[p] = x[p / row_div] W_e^T (* weights[p]) for blocks of 8 or 16 pairs sorted by
    expert (64 on Hopper; gated: silu(gate) * up; mixed: one token's pairs summed into
    y [1, n]), on the tensor cores, enqueued on a CUstream."""

def w4a16_wide(
    device: int,
    x: int,
    q: int,
    s: int,
    z: int,
    bias: int,
    y: int,
    work: int,
    counters: int,
    rows: int,
    n: int,
    k: int,
    x_stride: int,
    splits: int,
    bf16: bool,
    stream: int,
) -> None:
    """y = x W^T (+ b) for up to 32 rows, K split over `splits` ranges, on a CUstream."""

def w4a16_wgmma_ready(device: int) -> str:
    """Load the W4A16 wgmma kernel (33-64 rows; sm_90 only); "" when loaded, else why not."""

def w4a16_wgmma(
    device: int,
    x: int,
    q: int,
    s: int,
    z: int,
    bias: int,
    y: int,
    work: int,
    counters: int,
    rows: int,
    n: int,
    k: int,
    x_stride: int,
    splits: int,
    bf16: bool,
    stream: int,
    gated: bool = False,
) -> None:
    """y = x W^T (+ b) for up to 64 rows on Hopper, K split over `splits` (at most 8, all
    CTAs resident at once; work [ceil(n / 256) * splits, 64, 256] float32 and counters
    ceil(n / 256) uint64 multiples of 840 when more than one), on a CUstream. `gated`: W
    is gate | up and y [rows, n / 2] = silu(x gate^T) * (x up^T) (one split, no bias, n a
    multiple of 64)."""

def w4a16_wgmma_ctas(device: int) -> int:
    """How many CTAs of the wgmma kernel the device runs at once."""

def fp8_rows_ready(device: int) -> str:
    """Load the FP8 decode kernels on a CUDA device (sm_89+); "" when loaded, else why not."""

def fp8_rows(
    device: int,
    x: int,
    w: int,
    s: int,
    bias: int,
    y: int,
    rows: int,
    n: int,
    k: int,
    x_stride: int,
    s_stride: int,
    bf16: bool,
    warps: int,
    stream: int,
) -> None:
    """y = x W^T (+ b) for 1-16 rows of x by e4m3 W on the tensor cores, on a CUstream."""

class Region(Buffer):
    """Local memory registered with a transport; a CPU region is a writable uint8 buffer."""

    @property
    def transport(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def exportable(self) -> bool: ...
    def descriptor(self) -> bytes: ...
    def close(self) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None: ...

class RemoteRegion:
    """A peer's region, opened from its descriptor."""

    @property
    def transport(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None: ...

class Ticket:
    """One submitted batch of copies."""

    @property
    def nbytes(self) -> int: ...
    @property
    def num_copies(self) -> int: ...
    def poll(self) -> bool: ...
    def wait(self, timeout_s: float | None = None) -> bool: ...

class Transport:
    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def create_region(self, size: int) -> Region: ...
    def register(self, ptr: int, size: int, device: str) -> Region: ...
    def open(self, descriptor: bytes) -> RemoteRegion: ...
    def submit(
        self,
        src: Region,
        dst: RemoteRegion,
        copies: Sequence[tuple[int, int, int]] | _Int64Array | Buffer,
        wait_stream: int | None = None,
    ) -> Ticket: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> None: ...

class HostTransport(Transport):
    def __init__(self, num_threads: int = 0) -> None: ...
    @property
    def num_threads(self) -> int: ...

class CudaIpcTransport(Transport):
    def __init__(self, device: str, *, copy_kernel: bool = True) -> None: ...
    @property
    def device(self) -> str: ...

def cpu_kernels_supported() -> bool: ...
def panel_gemm_wide(enable: int = -1) -> bool: ...
def pair_gemm_supported() -> bool: ...
def panel_gemm(
    x: int,
    rows: int,
    k: int,
    x_stride: int,
    weights: int,
    bits: int,
    scales: int,
    mins: int,
    group: int,
    n: int,
    y: int,
    y_stride: int,
    bias: int,
    threads: int,
    /,
) -> None: ...

pair_gemm = panel_gemm  # the same arguments; W as native/pair_gemm.h lays it out

def paged_decode_attention(
    q: int,
    rows: int,
    heads_kv: int,
    groups: int,
    dim: int,
    kv: int,
    num_blocks: int,
    num_layers: int,
    block_size: int,
    layer: int,
    tables: int,
    table_width: int,
    positions: int,
    window: int,
    scale: float,
    out: int,
    threads: int,
    /,
) -> None: ...
