// Marks functions that host and device code share, so the CPU tests exercise the very code kernels run.
#pragma once
#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif
