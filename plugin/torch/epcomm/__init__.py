"""epcomm for Python.

- ``torch.distributed`` backend ``"epcomm"`` (registered by ``import epcomm``, and by ``import torch`` through
  torch's plugin entry point): ``init_process_group("epcomm")``, ``"cpu:gloo,cuda:epcomm"``,
  ``new_group(ranks, backend="epcomm")``.
- Extensions of such a group: :func:`all_to_all_v` (device counts, fixed-capacity output), :func:`dispatch`
  and :func:`combine` (torch custom ops, traceable by ``torch.compile``); :func:`set_active_ranks`,
  :func:`recover`, :func:`get_active_ranks` and :func:`get_masked_drops` (elastic ranks: the survivors of a
  dead rank go on).
- :class:`Buffer`, DeepEP's (legacy) ``Buffer`` API on epcomm, with :class:`Config`, :data:`topk_idx_t` and
  :class:`EventOverlap`.
- :mod:`epcomm._capi`, the torch-free binding of the C API that everything above is built on.
"""
from ._version import __version__
from . import _capi

HAVE_BACKEND = False  # whether the torch.distributed backend module loaded

try:
    import torch as _torch
except ImportError:  # the C API binding works without torch
    _torch = None

if _torch is not None:
    from . import _registration

    import warnings as _warnings

    try:
        from . import _backend
        HAVE_BACKEND = True
    except ImportError as _e:  # built without torch, or against another torch whose symbols differ
        _warnings.warn(f"epcomm: the torch.distributed backend is not available in this build ({_e}); reinstall "
                       "with `pip install --no-build-isolation .` so that it is compiled against the installed torch")
    if HAVE_BACKEND:
        if _backend.torch_version != _torch.__version__.split("+")[0]:
            _warnings.warn(f"epcomm: the backend was built against torch {_backend.torch_version} but torch "
                           f"{_torch.__version__} is running; rebuild it if it misbehaves")
        _registration.register()

    from .config import Config
    from .event import EventHandle, EventOverlap
    from .buffer import Buffer, topk_idx_t
    from .ops import all_to_all_v, combine, dispatch, get_active_ranks, get_masked_drops, recover, set_active_ranks

__all__ = ["__version__", "Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "all_to_all_v",
           "dispatch", "combine", "set_active_ranks", "recover", "get_active_ranks", "get_masked_drops"]
