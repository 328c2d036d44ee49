"""torch's plugin entry point (group "torch.backends"): `import torch` registers the backend "epcomm".

It runs at the end of `import torch`, where a failure would break torch itself. So it is a module of its own
(importing the epcomm package here would run all of it) and registers a creator that imports epcomm only when
a group is created; any failure becomes a warning. `import epcomm` registers the same backend when this did not.
"""


def _create_backend(store, rank, size, timeout):
    from epcomm._registration import _create_backend as create

    return create(store, rank, size, timeout)


def register():
    try:
        import torch.distributed as dist

        if dist.is_available() and not hasattr(dist.Backend, "EPCOMM"):
            dist.Backend.register_backend("epcomm", _create_backend, extended_api=False, devices=["cpu", "cuda"])
    except Exception as e:  # noqa: BLE001 - see above
        import warnings

        warnings.warn(f"epcomm: registering the torch.distributed backend at torch import failed: {e}")
