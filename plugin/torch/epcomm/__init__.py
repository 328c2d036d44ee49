"""epcomm for Python.

- ``torch.distributed`` backend ``"epcomm"`` (registered by ``import epcomm``, and by ``import torch`` through
  torch's plugin entry point): ``init_process_group("epcomm")``, ``"cpu:gloo,cuda:epcomm"``,
  ``new_group(ranks, backend="epcomm")``.
- Extensions of such a group: :func:`all_to_all_v` (device counts, fixed-capacity output), :func:`dispatch`
  and :func:`combine` (torch custom ops, traceable by ``torch.compile``).
- :class:`Buffer`, DeepEP's (legacy) ``Buffer`` API on epcomm, with :class:`Config`, :data:`topk_idx_t` and
  :class:`EventOverlap`.
- :mod:`epcomm._capi`, the torch-free binding of the C API that everything above is built on.
"""
from ._version import __version__
from . import _capi

try:
    import torch as _torch
except ImportError:  # the C API binding works without torch
    _torch = None

if _torch is not None:
    from . import _registration

    try:
        from . import _backend  # noqa: F401
        HAVE_BACKEND = True
    except ImportError as _e:
        HAVE_BACKEND = False
        _BACKEND_ERROR = str(_e)
        import warnings as _warnings

        _warnings.warn("epcomm: the torch.distributed backend is not available in this build "
                       f"({_BACKEND_ERROR}); reinstall with `pip install --no-build-isolation .` so that it is "
                       "compiled against the installed torch")
    if HAVE_BACKEND:
        _registration.register()

    from .config import Config
    from .event import EventHandle, EventOverlap
    from .buffer import Buffer, topk_idx_t
    from .ops import all_to_all_v, combine, dispatch

__all__ = ["__version__", "Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "all_to_all_v",
           "dispatch", "combine"]
