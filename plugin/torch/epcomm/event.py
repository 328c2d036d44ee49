"""EventHandle and EventOverlap, as DeepEP has them.

On CUDA an EventHandle is an event recorded on a stream and current_stream_wait() makes the current stream wait
for it. On the host engine every operation has finished when its call returns, so the handle is already
complete and waiting does nothing.
"""
from typing import Any, Callable, Optional, Tuple

import torch


class EventHandle:
    def __init__(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Records an event on stream, or on the current CUDA stream when CUDA is in use; else a done event."""
        self._event = None
        if stream is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream()
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def current_stream_wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def query(self) -> bool:
        return self._event is None or self._event.query()


class EventOverlap:
    """An event plus the tensors that must stay alive until it completes (instead of record_stream, which CUDA
    graphs do not allow). Use current_stream_wait() or a `with` block."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None, "EventOverlap: no event (the operation was not asynchronous)"
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
