"""Prints what Meson needs to compile a C++ extension against the torch of this Python, one item a line:
version, C++11 ABI flag (0/1), library folder, the shared libstdc++ that torch runs with (a path, or an empty
line when none is mapped), then the include folders. Exits 1 when torch is missing."""
import sys

try:
    import torch
    from torch.utils import cpp_extension
except Exception as e:  # torch absent or broken: the package builds without its backend module
    print(f"torch not importable: {e}", file=sys.stderr)
    sys.exit(1)

print(torch.__version__.split("+")[0])
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(cpp_extension.library_paths()[0])
# The libstdc++ this process loaded for torch: the backend must share it (see plugin/torch/meson.build).
libstdcxx = ""
try:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libstdc++.so" in path:
                libstdcxx = path
                break
except OSError:  # not Linux: the compiler's default is all there is
    pass
print(libstdcxx)
for path in cpp_extension.include_paths():
    print(path)
