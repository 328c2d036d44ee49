"""The stream discipline of one Buffer call."""
from typing import Optional

import torch

from ._pointers import stream_handle
from .event import EventHandle, EventOverlap


class Launch:
    """Stream discipline of one Buffer call, as DeepEP's: on CUDA the work runs on the Buffer's communication
    stream after the current stream (or previous_event); with async_finish the caller gets an event and the
    current stream does not wait, otherwise it waits. The host engine finishes within the call."""

    def __init__(self, buffer, previous_event: Optional[EventOverlap], async_finish: bool):
        # buffer: the calling Buffer (its device and communication stream)
        self.cuda = buffer._device.type == "cuda"
        self.async_finish = async_finish
        self.stream = 0
        self._ctx = None
        if self.cuda:
            self.compute = torch.cuda.current_stream()
            self.comm_stream = buffer._comm_stream
            self._join = buffer._join_event
            if previous_event is not None and previous_event.event is not None and previous_event.event._event:
                self.comm_stream.wait_event(previous_event.event._event)
            else:
                # the Buffer's own event, recorded again by every call (a wait takes the record of its time):
                # the same ordering as wait_stream without an event made per call
                fork = buffer._fork_event
                fork.record(self.compute)
                self.comm_stream.wait_event(fork)
            self.stream = stream_handle(self.comm_stream)

    def __enter__(self) -> "Launch":
        if self.cuda:
            self._ctx = torch.cuda.stream(self.comm_stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)

    def finish(self, tensors) -> EventOverlap:
        tensors = tuple(t for t in tensors if isinstance(t, torch.Tensor))
        if not self.cuda:
            return EventOverlap(EventHandle() if self.async_finish else None)
        if self.async_finish:
            return EventOverlap(EventHandle(self.comm_stream), tensors)
        self._join.record(self.comm_stream)
        self.compute.wait_event(self._join)
        for t in tensors:  # allocated or last used on the comm stream; now also used on the compute stream
            t.record_stream(self.compute)
        return EventOverlap(None)
