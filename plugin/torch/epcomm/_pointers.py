"""How tensors cross into epcomm._capi: data pointer, dtype code, byte count, stream handle."""
import torch

from . import _capi

_DTYPES = {
    torch.float32: _capi.FLOAT32,
    torch.float16: _capi.FLOAT16,
    torch.bfloat16: _capi.BFLOAT16,
    torch.float8_e4m3fn: _capi.FLOAT8_E4M3,
    torch.int32: _capi.INT32,
    torch.int64: _capi.INT64,
    torch.uint8: _capi.UINT8,
}


def ep_dtype(dtype: torch.dtype) -> int:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"epcomm: dtype {dtype} is not supported (supported: {', '.join(map(str, _DTYPES))})") from None


def ptr(t) -> int:
    """data_ptr() of t; 0 for None. torch gives empty tensors a NULL data pointer, which the C API may refuse
    even where 0 bytes are needed, so those get a valid dummy address instead."""
    if t is None:
        return 0
    if t.numel() == 0:
        return _capi.dummy_ptr()
    return t.data_ptr()


def nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def stream_handle(stream) -> int:
    """The cudaStream_t of a torch.cuda.Stream as an integer; 0 (ignored by the host engine) without one."""
    return 0 if stream is None else stream.cuda_stream
